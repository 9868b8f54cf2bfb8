"""Chat messages as templates take them: normalised, and tools written for templates
without tool support.

Messages are normalised the way the OpenAI API allows them (:func:`normalize_messages`):

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
ChatML), :meth:`~areal_agents.serve.chat.ChatTokenizer.render` writes the tools into the
conversation itself, in the Hermes format, before applying the template
(:func:`inline_tools`):

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
   :func:`areal_agents.serve.toolcall.parse_tool_calls`), so the rendered assistant turn is
   exactly what the model generated when it followed the format.
3. Each run of consecutive ``tool`` messages becomes ONE ``user`` message holding one
   ``<tool_response>\\n{content}\\n</tool_response>`` block per result, joined by ``"\\n"``.
   A ``user`` turn is the only non-assistant turn small ChatML models were trained on; this
   is also how Qwen's own template renders tool results.

This conversion also applies to tool calls and tool results in the history when ``tools``
is not given; only the ``# Tools`` section needs ``tools``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = [
    "check_tools",
    "format_tool_call",
    "inline_tools",
    "normalize_messages",
    "plain",
    "render_tool_prompt",
]

Message = Mapping[str, Any]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


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


# --- message normalisation -------------------------------------------------------------------

_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types; other objects become ``"<TypeName>"``."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return value
    # Plain dicts and lists first, their scalars copied in place: the same result as the
    # general cases below, with far fewer calls.
    if kind is dict:
        return {
            (key if type(key) is str else plain(key)): (
                item if type(item) in _JSON_SCALARS else plain(item)
            )
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) in _JSON_SCALARS else plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. the OpenAI SDK's messages
        return plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return plain(value.item())
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


def normalize_messages(messages: Sequence[Message], as_mapping: bool) -> list[dict[str, Any]]:
    """``messages`` as templates take them (see the module docstring); ``as_mapping``: tool
    call arguments decoded into mappings, for templates that need them so
    (:func:`~areal_agents.serve.chat_template.wants_mapping_arguments`)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(f"expected messages as a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("cannot render an empty conversation; give at least one message")
    normalized = []
    for index, message in enumerate(plain(list(messages))):
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


def inline_tools(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[dict[str, Any]]:
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


def check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Any] | None:
    """``tools`` as a list of plain JSON schemas (None stays None); a ``TypeError`` for
    anything else."""
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
    return list(plain(list(tools)))
