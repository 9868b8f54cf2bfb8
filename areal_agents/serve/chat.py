"""Chat templates and tokenization without transformers (and so without torch).

The proxy applies the chat template itself and sends token ids to the engine, and it must
not import torch, which ``import transformers`` does. :class:`ChatTokenizer` reads a Hugging
Face tokenizer directory with the ``tokenizers`` library and renders its chat template with
jinja2 the way ``transformers``' ``apply_chat_template`` does
(:mod:`areal_agents.serve.chat_template`: the same sandboxed environment, options, globals
and ``tojson`` filter), with the same variables (``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the named special tokens ``bos_token``, ``eos_token``, ... and any
extra keyword such as ``enable_thinking``). ``encode_chat`` returns the ids
``apply_chat_template(..., tokenize=True)`` returns.

Messages are normalised the way the OpenAI API allows them, and templates without tool
support get the tools, tool calls and tool results written in the Hermes format
(:mod:`areal_agents.serve.chat_messages`).

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
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from areal_agents.errors import ModelNotFound
from areal_agents.serve.chat_messages import (
    Message,
    check_tools,
    inline_tools,
    normalize_messages,
    plain,
)
from areal_agents.serve.chat_template import (
    compile_template,
    template_variables,
    wants_mapping_arguments,
)

__all__ = ["ChatTokenizer", "load_tokenizer"]

# The named special tokens passed to every template (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "sep_token")
_SPECIAL_TOKEN_NAMES += ("pad_token", "cls_token", "mask_token")
# transformers writes int(1e30) as model_max_length when the model gives none.
_UNSET_MAX_LENGTH = 10**18


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
        return "tools" in template_variables(self.template_source(tools=[]))

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
        tool_list = check_tools(tools)
        source = self.template_source(tool_list)
        conversation = normalize_messages(messages, wants_mapping_arguments(source))
        if not self.supports_tools:
            conversation = inline_tools(conversation, tool_list)
        variables = plain({**self.special_tokens, **template_kwargs})
        documents = variables.pop("documents", None)
        try:
            return compile_template(source).render(
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
