"""Chat templates and tokenization without transformers (and so without torch).

The proxy applies the chat template itself and sends token ids to the engine, and it must
not import torch, which ``import transformers`` does. :class:`ChatTokenizer` reads a Hugging
Face tokenizer directory with the ``tokenizers`` library and renders its chat template with
jinja2 the way ``transformers``' ``apply_chat_template`` does: the same sandboxed environment
and options (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag), the same globals (``raise_exception``, ``strftime_now``, a safe
``namespace`` and ``dict``), the same ``tojson`` filter (no HTML escaping, ``ensure_ascii=False``
by default, ``indent``/``separators``/``sort_keys``), the same variables (``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the named special tokens ``bos_token``,
``eos_token``, ... and any extra keyword such as ``enable_thinking``). ``encode_chat`` returns
the ids ``apply_chat_template(..., tokenize=True)`` returns.

Messages are normalised the way the OpenAI API allows them:

- keys whose value is ``None`` are dropped (as transformers does), except ``content``: a
  ``None`` or missing content becomes ``""`` (OpenAI sends ``content: null`` beside
  ``tool_calls``, and most templates concatenate the content);
- a content list of text parts (``{"type": "text", "text": ...}``) is joined with ``"\\n"``
  (as vLLM does); other part types are refused with a ``ValueError``;
- tool call ``arguments`` are passed as given (the OpenAI JSON string) when the template
  tests ``arguments is string``/``is mapping`` (Qwen3 inserts a string verbatim, so the model's
  own text comes back unchanged), and decoded into a mapping when the template pipes them
  through ``tojson`` without such a test (it would double-encode a string otherwise);
- ``reasoning_content``, ``reasoning`` and ``thinking`` are aliases: whichever is set fills
  ``reasoning_content`` and ``thinking`` (as transformers does).

Templates without tool support
------------------------------
When the template does not read ``tools`` (``supports_tools`` is ``False``, e.g. SmolLM2's
ChatML), :meth:`ChatTokenizer.render` writes the tools into the conversation itself, in the
Hermes format, before applying the template:

1. With ``tools``, the system message gets a ``# Tools`` section (after a blank line; a new
   system message holding only the section goes first when there is none; note that this
   replaces a template's default system prompt)::

       # Tools

       You can call these functions (JSON schemas, one per line):
       <tools>
       {"type": "function", "function": {"name": "add", ...}}
       </tools>

       To call one, answer with a JSON object of its name and arguments inside
       <tool_call></tool_call> tags, one block per call:
       <tool_call>
       {"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}
       </tool_call>
       Each result comes back inside <tool_response></tool_response> tags.

2. An assistant message with ``tool_calls`` becomes one whose content is its text (if any)
   and then one block per call, joined by ``"\\n"``::

       <tool_call>
       {"name": "add", "arguments": {"a": 1, "b": 2}}
       </tool_call>

   ``arguments`` is written verbatim when it is a string (the model's own text, kept by
   :func:`areal_agents.serve.toolcall.parse_tool_calls`), so the rendered assistant turn is exactly
   what the model generated when it followed the format.
3. Each run of consecutive ``tool`` messages becomes ONE ``user`` message holding one
   ``<tool_response>\\n{content}\\n</tool_response>`` block per result, joined by ``"\\n"``.
   A ``user`` turn is the only non-assistant turn small ChatML models were trained on; this
   is also how Qwen's own template renders tool results.

This conversion also applies to tool calls and tool results in the history when ``tools``
is not given; only the ``# Tools`` section needs ``tools``.

Not supported: ``continue_final_message``, callables as tools (pass JSON schemas),
``return_assistant_tokens_mask`` (the ``{% generation %}`` tag renders its body unchanged).

Example (runs with any tokenizer directory that has ``tokenizer.json``)::

    tok = load_tokenizer("path/to/model")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}], tools=tools)
    text = tok.decode(ids)
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from areal_agents.errors import ModelNotFound

__all__ = ["ChatTokenizer", "format_tool_call", "load_tokenizer", "render_tool_prompt"]

Message = Mapping[str, Any]

# The named special tokens passed to every template (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "sep_token")
_SPECIAL_TOKEN_NAMES += ("pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")
# transformers writes int(1e30) as model_max_length when the model gives none.
_UNSET_MAX_LENGTH = 10**18


# --- the tool prompt for templates without tool support --------------------------------------

_TOOL_PROMPT_HEAD = (
    "# Tools\n\nYou can call these functions (JSON schemas, one per line):\n<tools>\n"
)
_TOOL_PROMPT_TAIL = (
    "\n</tools>\n\n"
    "To call one, answer with a JSON object of its name and arguments inside\n"
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}\n'
    "</tool_call>\n"
    "Each result comes back inside <tool_response></tool_response> tags."
)


def render_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``# Tools`` system-prompt section for templates that do not render tools.

    >>> print(render_tool_prompt([{"type": "function", "function": {"name": "f"}}]))
    ... # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
    # Tools
    <BLANKLINE>
    You can call these functions (JSON schemas, one per line):
    <tools>
    {"type": "function", "function": {"name": "f"}}
    </tools>
    ...
    """
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _TOOL_PROMPT_HEAD + lines + _TOOL_PROMPT_TAIL


def format_tool_call(name: str, arguments: str | Mapping[str, Any]) -> str:
    """One Hermes ``<tool_call>`` block, the way the tool prompt asks the model to write it.

    A string ``arguments`` is written verbatim; a mapping as JSON (``ensure_ascii=False``).

    >>> format_tool_call("add", '{"a": 1}')
    '<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>'
    """
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    head = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {head}, "arguments": {args}}}\n</tool_call>'


# --- the jinja environment -------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace, got {name!r}"
            )


class _DictFactory:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# Attribute names an exact ``dict`` resolves with ``getattr`` (its methods and object's).
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with the same decisions, made faster for chat templates.

    Two shortcuts, both exact: ``message.role`` on a plain ``dict`` goes straight to the
    item when ``dict`` has no attribute of that name (the sandbox would try ``getattr``
    first, fail and then subscript), and whether an attribute is safe, which jinja decides
    from the object's type and the attribute's name only, is remembered per (type, name).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe: dict[tuple[type, str], bool] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < 4096:
                self._safe[key] = safe
        return safe


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_DictFactory(),
        namespace=_Namespace,
    )
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@lru_cache(maxsize=32)
def _template_variables(source: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))


def _wants_mapping_arguments(source: str) -> bool:
    """Whether the template needs tool call arguments as a mapping (see the module doc)."""
    if re.search(r"arguments\s+is\s+(?:not\s+)?(?:string|mapping)", source):
        return False
    return re.search(r"arguments\s*\|\s*tojson", source) is not None


# --- message normalisation -------------------------------------------------------------------


_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types; other objects become ``"<TypeName>"``."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return value
    # Plain dicts and lists first, their scalars copied in place: the same result as the
    # general cases below, with far fewer calls.
    if kind is dict:
        return {
            (key if type(key) is str else _plain(key)): (
                item if type(item) in _JSON_SCALARS else _plain(item)
            )
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) in _JSON_SCALARS else _plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. the OpenAI SDK's messages
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"message {index}: expected text content parts, got a {kind!r} part; "
                    "this tokenizer renders text only"
                )
        return "\n".join(texts)
    raise TypeError(
        f"message {index}: expected content as a str, None or a list of text parts, "
        f"got {type(content).__name__}"
    )


def _normalize_tool_call(call: Any, index: int, as_mapping: bool) -> Any:
    if not isinstance(call, dict):
        raise TypeError(f"message {index}: expected each tool call as a dict, got {call!r}")
    function = call.get("function")
    if not as_mapping or not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(
                f"message {index}: tool call {function.get('name')!r} has arguments that are "
                f"not valid JSON ({e.msg} at char {e.pos}); expected a JSON object string"
            ) from None
        call = {**call, "function": {**function, "arguments": decoded}}
    return call


def _normalize_messages(messages: Sequence[Message], as_mapping: bool) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(f"expected messages as a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("cannot render an empty conversation; give at least one message")
    normalized = []
    for index, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise TypeError(f"message {index}: expected a dict, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message.get("role"), str):
            raise ValueError(f'message {index}: expected a "role" string, got {message!r}')
        message["content"] = _content_text(message.get("content"), index)
        if "tool_calls" in message:
            calls = message["tool_calls"]
            if not isinstance(calls, list | tuple):
                raise TypeError(f"message {index}: expected tool_calls as a list, got {calls!r}")
            message["tool_calls"] = [_normalize_tool_call(c, index, as_mapping) for c in calls]
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _inline_tools(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[dict[str, Any]]:
    """Write tools, tool calls and tool results as text (the documented Hermes format)."""
    out: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_was_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous_was_tool = True
            continue
        previous_was_tool = False
        if role == "assistant" and message.get("tool_calls"):
            blocks = [message["content"]] if message["content"] else []
            for call in message["tool_calls"]:
                function = call.get("function", call)
                blocks.append(format_tool_call(function["name"], function.get("arguments", {})))
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(blocks)
        out.append(message)
    if tools:
        section = render_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# --- the tokenizer ---------------------------------------------------------------------------


def _added_token_splitter(tokenizer: Tokenizer) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """A regex that splits text at added tokens exactly as the tokenizer does, or ``None``
    when some added token has matching options (strip, single word, normalized) that a plain
    split would not reproduce."""
    decoder = tokenizer.get_added_tokens_decoder()
    if not decoder:
        return None
    for token in decoder.values():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None
    added = {token.content: i for i, token in decoder.items()}
    # Longest first, so that the alternation picks the leftmost-longest match.
    alternatives = sorted(added, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")"), added


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte for byte-level BPE vocabularies (GPT-2 style).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to the
    code points 256, 257, ... in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if chr(b) not in alphabet)
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_GIL_FREE_CHARS = 16_384
"""Texts from this long are encoded without holding the GIL (see ``_encode_text``)."""


class PieceCache:
    """A least-recently-used map of text to token ids, bounded in (estimated) bytes.

    Ids are kept as 32-bit arrays; an entry costs its text plus 4 bytes per id.
    Texts whose entry would exceed ``max_entry_bytes`` are not kept (a long prompt that is
    refused for its length must not evict everything, nor stay). Thread-safe.
    """

    def __init__(self, max_bytes: int = 32 * 2**20, max_entry_bytes: int = 2 * 2**20) -> None:
        self.max_bytes, self.max_entry_bytes = max_bytes, max_entry_bytes
        self.bytes = 0
        """The estimated size of what is kept now."""
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def cost(text: str, ids: Sequence[int]) -> int:
        return sys.getsizeof(text) + 4 * len(ids) + 128

    def get(self, text: str) -> array[int] | None:
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
            return ids

    def put(self, text: str, ids: Sequence[int]) -> array[int]:
        """Keep ``text`` -> ``ids`` if it fits; returns the ids as an array."""
        packed = array("I", ids)
        size = self.cost(text, packed)
        if size > min(self.max_entry_bytes, self.max_bytes):
            return packed
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self.bytes -= self.cost(text, old)
            self._entries[text] = packed
            self.bytes += size
            while self.bytes > self.max_bytes and self._entries:
                gone, gone_ids = self._entries.popitem(last=False)
                self.bytes -= self.cost(gone, gone_ids)
        return packed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


class ChatTokenizer:
    """A Hugging Face tokenizer and its chat template, without transformers.

    Build one with :meth:`from_dir` (or :func:`load_tokenizer`). Rendering is pure and the
    object is not mutated after construction, so one instance serves concurrent requests,
    from several threads too: calls into the Rust tokenizer that encode are serialized by a
    lock, and :attr:`piece_cache` is bounded in bytes.

    Attributes:
        chat_template: The template source, or a mapping of named templates (``default``,
            ``tool_use``, ...) chosen like transformers does (``tool_use`` when tools are
            given).
        special_tokens: The named special tokens (``eos_token``, ...) passed to templates.
        eos_token_ids: The ids that end generation: the tokenizer's eos, then any in
            ``generation_config.json`` and ``config.json``.
        pad_token_id: The padding id: the pad token's, else the model config's; ``None`` if neither.
        model_max_length: The context length: the smaller of the tokenizer's
            ``model_max_length`` and the model's ``max_position_embeddings`` (whichever are
            known), or ``None``.
        name_or_path: Where it was loaded from.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        model_max_length: int | None = None,
        name_or_path: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        eos = [self.token_id(self.special_tokens.get("eos_token", "")), *eos_token_ids]
        self.eos_token_ids = list(dict.fromkeys(i for i in eos if i is not None))
        if pad_token_id is None:
            pad_token_id = self.token_id(self.special_tokens.get("pad_token", ""))
        self.pad_token_id = pad_token_id
        self.model_max_length = model_max_length
        self.name_or_path = name_or_path
        self._added = {
            i: token.content for i, token in tokenizer.get_added_tokens_decoder().items()
        }
        self._bytes_cache: dict[int, bytes] = {}
        self._decoder_kind = _decoder_kind(tokenizer)
        self._splitter = _added_token_splitter(tokenizer)
        self._lock = threading.Lock()
        self.piece_cache = PieceCache()
        """Token ids of recently seen text between added tokens (bounded in bytes)."""
        self._max_token_bytes: int | None = None

    def __repr__(self) -> str:
        return (
            f"ChatTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"supports_tools={self.supports_tools})"
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ChatTokenizer:
        """Load a tokenizer directory as ``save_pretrained`` writes it.

        Reads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template,
        ``model_max_length``), ``special_tokens_map.json`` (older directories),
        ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (which win over the
        config, as in transformers), ``chat_template.json``, and, when present,
        ``generation_config.json`` and ``config.json`` (eos ids, pad id, context length).

        Raises:
            ModelNotFound: ``path`` has no ``tokenizer.json``.
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFound(
                f"no tokenizer.json in {str(directory)!r}; expected a directory written by "
                "save_pretrained (for a GGUF file, load it once with transformers' "
                "AutoTokenizer.from_pretrained(dir, gguf_file=name) and save_pretrained it)"
            )
        config = _read_json(directory / "tokenizer_config.json")
        legacy_map = _read_json(directory / "special_tokens_map.json")
        special = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = _token_text(config[name] if name in config else legacy_map.get(name))
            if value is not None:
                special[name] = value
        generation = _read_json(directory / "generation_config.json")
        model = _read_json(directory / "config.json")
        text_model = model.get("text_config") or {}
        max_lengths = [
            config.get("model_max_length"),
            model.get("max_position_embeddings"),
            text_model.get("max_position_embeddings"),
        ]
        known = [n for n in max_lengths if isinstance(n, int) and 0 < n < _UNSET_MAX_LENGTH]
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        pad_ids = [
            tokenizer.token_to_id(special["pad_token"]) if "pad_token" in special else None,
            generation.get("pad_token_id"),
            model.get("pad_token_id"),
        ]
        return cls(
            tokenizer,
            chat_template=_read_chat_template(directory, config),
            special_tokens=special,
            eos_token_ids=[*_ids(generation.get("eos_token_id")), *_ids(model.get("eos_token_id"))],
            pad_token_id=next((i for i in pad_ids if isinstance(i, int)), None),
            model_max_length=min(known) if known else None,
            name_or_path=str(directory),
        )

    # --- templates ---------------------------------------------------------------------------

    def template_source(self, tools: Sequence[Any] | None = None) -> str:
        """The template used for a request (``tool_use`` when tools are given and it exists).

        Raises:
            ValueError: The tokenizer has no chat template, or several without a default.
        """
        template = self.chat_template
        if isinstance(template, Mapping):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ValueError(
                f"{self.name_or_path!r} has several chat templates and no 'default' one "
                f"(it has {sorted(template)}); add a chat_template.jinja"
            )
        if template is None:
            raise ValueError(
                f"{self.name_or_path!r} has no chat template; add chat_template.jinja to it"
            )
        return template

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` itself.

        When it does not, :meth:`render` writes the documented Hermes tool prompt.
        """
        return "tools" in _template_variables(self.template_source(tools=[]))

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the chat template, as ``apply_chat_template`` does.

        Args:
            messages: OpenAI chat messages (dicts, dataclasses or pydantic models).
            tools: OpenAI tool schemas (``{"type": "function", "function": {...}}``).
            add_generation_prompt: End with the header of a new assistant turn.
            **template_kwargs: Extra template variables, e.g. ``enable_thinking=False``;
                they override the special tokens of the same name.

        Raises:
            TypeError, ValueError: The messages or tools are malformed, or the template
                rejected them (its ``raise_exception``); the message says which.
        """
        tool_list = _check_tools(tools)
        source = self.template_source(tool_list)
        conversation = _normalize_messages(messages, _wants_mapping_arguments(source))
        if not self.supports_tools:
            conversation = _inline_tools(conversation, tool_list)
        variables = _plain({**self.special_tokens, **template_kwargs})
        documents = variables.pop("documents", None)
        try:
            return _compile(source).render(
                messages=conversation,
                tools=tool_list,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected the conversation: {e}") from e

    # --- ids ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text becomes those tokens; nothing is added.

        With the Qwen3 tokenizer, ``encode("<|im_start|>user")`` is ``[151644, 872]``.
        """
        if self._splitter is None:
            return self._encode_text(text)
        # The tokenizer splits on added tokens before anything else, so the pieces between
        # them tokenize independently: cache them (system prompts, tool lists and history
        # repeat across the turns of an episode).
        ids: list[int] = []
        pattern, added = self._splitter
        for k, piece in enumerate(pattern.split(text)):
            if k % 2:
                ids.append(added[piece])
            elif piece:
                ids.extend(self._piece_ids(piece))
        return ids

    def _piece_ids(self, piece: str) -> Sequence[int]:
        cached = self.piece_cache.get(piece)
        if cached is not None:
            return cached
        return self.piece_cache.put(piece, self._encode_text(piece))

    def _encode_text(self, text: str) -> list[int]:
        """The Rust tokenizer's ids of ``text``, one call at a time. Long texts go through
        ``encode_batch``, which lets other Python threads (the proxy's event loop) run
        meanwhile; ``encode`` holds the GIL throughout."""
        if len(text) < _GIL_FREE_CHARS:  # encoding only reads the tokenizer: no lock needed
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        with self._lock:
            (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=False)
            return list(encoding.ids)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, far cheaper than encoding (0 when none is
        known): each piece between added tokens, normalized as the tokenizer does, needs at
        least its UTF-8 length over the longest token's. Exact reasoning for byte-level BPE
        vocabularies; other tokenizers get 0."""
        if self._splitter is None or self._decoder_kind != "byte_level":
            return 0
        longest = self._max_token_bytes
        if longest is None:
            lengths = (len(self._bytes_of(i)) for i in range(self.vocab_size))
            longest = self._max_token_bytes = max(1, *lengths)
        normalizer = self._tokenizer.normalizer
        pattern, _ = self._splitter
        count = 0
        for k, piece in enumerate(pattern.split(text)):
            if k % 2:
                count += 1
            elif piece:
                if normalizer is not None:
                    piece = normalizer.normalize_str(piece)
                count += -(-len(piece.encode("utf-8", "surrogatepass")) // longest)
        return count

    def encode_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """``encode(render(...))``: the ids ``apply_chat_template(..., tokenize=True)`` gives."""
        text = self.render(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (incomplete UTF-8 at the edges shows as U+FFFD)."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The exact bytes each token stands for (OpenAI logprobs ``bytes``).

        For byte-level BPE and byte-fallback vocabularies, ``b"".join(token_bytes(ids))`` is
        the UTF-8 of ``decode(ids)`` even when a character spans several tokens.
        """
        return [self._bytes_of(i) for i in ids]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (OpenAI logprobs ``token``); a token holding part of a
        character shows U+FFFD, as ``decode([id])`` does."""
        return [self._bytes_of(i).decode("utf-8", errors="replace") for i in ids]

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry or added token, or ``None``."""
        return self._tokenizer.token_to_id(token) if token else None

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included (``len()`` of a transformers tokenizer)."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def _bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            value = self._added[token_id].encode()
        else:
            piece = self._tokenizer.id_to_token(token_id)
            if piece is None:
                raise ValueError(
                    f"token id {token_id} is out of range (vocab_size {self.vocab_size})"
                )
            value = self._piece_bytes(token_id, piece)
        self._bytes_cache[token_id] = value
        return value

    def _piece_bytes(self, token_id: int, piece: str) -> bytes:
        if self._decoder_kind == "byte_level":
            alphabet = _BYTE_ALPHABET
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        elif self._decoder_kind == "sentencepiece":
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()


_BYTE_ALPHABET = _byte_level_alphabet()


def _decoder_kind(tokenizer: Tokenizer) -> str:
    """``byte_level``, ``sentencepiece`` (▁ for spaces, ``<0xNN>`` byte fallback) or ``other``."""
    decoder = tokenizer.decoder
    if decoder is None:
        return "other"
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return "other"
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    kinds = {part.get("type") for part in parts}
    if kinds == {"ByteLevel"}:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"} and kinds <= {
        "ByteFallback",
        "Metaspace",
        "Replace",
        "Fuse",
        "Strip",
    }:
        return "sentencepiece"
    return "other"


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"expected tools as a list of JSON schemas, got {type(tools).__name__}")
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TypeError(
                f"expected each tool as a JSON schema dict, got {type(tool).__name__}; "
                "convert functions to schemas first"
            )
    return list(_plain(list(tools)))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _read_chat_template(directory: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The template(s) of a directory, with transformers' precedence: ``chat_template.jinja``
    and ``additional_chat_templates/*.jinja`` over ``tokenizer_config.json`` over
    ``chat_template.json``."""
    files: dict[str, str] = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template if isinstance(template, str) else None


def load_tokenizer(path_or_dir: str | os.PathLike[str] | ChatTokenizer) -> ChatTokenizer:
    """A :class:`ChatTokenizer` from a directory, a file in it (``tokenizer.json``,
    ``config.json``...), or an existing instance (returned as is).

    Raises:
        ModelNotFound: The path does not exist, has no ``tokenizer.json``, or is a GGUF file.
    """
    if isinstance(path_or_dir, ChatTokenizer):
        return path_or_dir
    path = Path(path_or_dir)
    if not path.exists():
        raise ModelNotFound(f"no tokenizer at {str(path)!r}: the path does not exist")
    if path.suffix == ".gguf":
        raise ModelNotFound(
            f"{str(path)!r} is a GGUF file; load it once with transformers' "
            "AutoTokenizer.from_pretrained(dir, gguf_file=name), save_pretrained it to a "
            "directory, and pass that directory"
        )
    return ChatTokenizer.from_dir(path if path.is_dir() else path.parent)
