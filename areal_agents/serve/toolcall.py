"""Parse the tool calls (and the reasoning) out of a model's generated text.

The proxy turns every completion into an OpenAI assistant message. Models write their tool
calls in one of a few text formats; :func:`parse_tool_calls` recognises them all:

=================  ==========================================================================
format             what the model writes
=================  ==========================================================================
Hermes / Qwen      ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number of
                   them, text around them is content. A missing ``</tool_call>`` at the end of
                   the text (the model stopped right after the JSON) is tolerated.
function tag       ``<function=f>{"x": 1}</function>`` (Llama 3.x custom-tool style), also
                   inside ``<tool_call>``, and with XML parameters
                   (``<function=f><parameter=x>1</parameter></function>``, Qwen3-Coder style).
Mistral            ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (older) or
                   ``[TOOL_CALLS]f[ARGS]{...}`` (newer); text before the marker is content.
Llama 3.1 JSON     the whole message is one JSON object ``{"name": "f", "parameters": {...}}``
                   (or a list of them), optionally after ``<|python_tag|>``.
=================  ==========================================================================

Qwen3-style reasoning, ``<think>...</think>``, is split off first into ``reasoning``; a
``</think>`` without an opening tag (the template wrote ``<think>`` into the prompt) makes
everything before it reasoning, and an unclosed ``<think>`` (generation cut off while
thinking) makes the rest of the text reasoning. Tool calls inside the reasoning are ignored.

Rules, so that a bad tool call is data and never a crash:

- A call that cannot be parsed stays in ``content`` verbatim and adds an entry to ``errors``
  saying why and where (``invalid JSON in <tool_call> at char 17: Expecting ',' delimiter``).
  Character positions index the text passed in.
- With ``tool_names`` given, a call to an unknown tool IS returned (the environment answers it
  with an error message the model can read, which keeps the conversation well-formed) and
  ALSO adds an error (``unknown tool 'f' at char 0; known tools: a, b``), so the recorder can
  count it.
- ``arguments`` is always a JSON string holding an object. It is the model's own text for the
  arguments, byte for byte, so re-rendering the parsed message reproduces the generated text
  (the chat template inserts a string argument verbatim). A model that wrote the arguments as
  a JSON string holding an object gets that inner string.

Example:

>>> ids = iter(["call_1", "call_2"])
>>> out = parse_tool_calls(
...     '<think>\\nAdd them.\\n</think>\\n\\nSure.\\n<tool_call>\\n'
...     '{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>',
...     id_factory=lambda: next(ids),
... )
>>> out.reasoning, out.content, out.errors
('Add them.', 'Sure.', [])
>>> out.tool_calls
[{'id': 'call_1', 'type': 'function', 'function': {'name': 'add', 'arguments': '{"a": 1, "b": 2}'}}]
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedOutput", "new_call_id", "parse_tool_calls"]


@dataclass(frozen=True)
class ParsedOutput:
    """A model's generated text, split into reasoning, content and tool calls.

    Attributes:
        content: The text outside the tool calls (and outside the reasoning), stripped;
            ``None`` when nothing is left.
        tool_calls: The parsed calls in OpenAI format: ``{"id": "call_<hex>", "type":
            "function", "function": {"name": str, "arguments": <JSON string>}}``.
        reasoning: The text inside ``<think>...</think>``, stripped; ``None`` when absent
            or empty.
        errors: One line per problem found (unparsable call, unknown tool); empty when
            the text was clean.
    """

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None
    errors: list[str] = field(default_factory=list)

    def to_message(self) -> dict[str, Any]:
        """The OpenAI assistant message for this output.

        ``reasoning_content`` is set only when there is reasoning, ``tool_calls`` only when
        there are calls.

        >>> ParsedOutput(content="Hi").to_message()
        {'role': 'assistant', 'content': 'Hi'}
        """
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        return message


def new_call_id() -> str:
    """A fresh random tool call id, ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(
    text: str,
    *,
    tool_names: Iterable[str] | None = None,
    id_factory: Callable[[], str] | None = None,
) -> ParsedOutput:
    """Split generated text into reasoning, content and OpenAI tool calls.

    Args:
        text: The decoded completion (special tokens such as ``<|im_end|>`` removed or not:
            a trailing end-of-turn token is ignored).
        tool_names: The tools offered in the request. When given, a call to another name is
            still returned but also reported in ``errors``.
        id_factory: Makes the call ids; defaults to :func:`new_call_id`. Pass a deterministic
            one in tests.

    Returns:
        A :class:`ParsedOutput`; see the module docstring for the formats and the rules.

    >>> parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', id_factory=lambda: "c").tool_calls
    [{'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}]
    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>').errors
    ['invalid JSON in <tool_call> at char 46: Expecting property name enclosed in double quotes']
    """
    if not isinstance(text, str):
        raise TypeError(f"expected the generated text as str, got {type(text).__name__}")
    make_id = id_factory or new_call_id
    reasoning, body, offset = _split_reasoning(text)
    calls, errors, content = _parse_body(body, offset)

    known = None if tool_names is None else set(tool_names)
    tool_calls = []
    for call in calls:
        if known is not None and call.name not in known:
            listed = ", ".join(sorted(known)) or "(none)"
            errors.append(f"unknown tool {call.name!r} at char {call.pos}; known tools: {listed}")
        tool_calls.append(
            {
                "id": call.id or make_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        )
    return ParsedOutput(
        content=content.strip() or None,
        tool_calls=tool_calls,
        reasoning=reasoning,
        errors=errors,
    )


# --- internals -------------------------------------------------------------------------------


@dataclass
class _Call:
    name: str
    arguments: str
    pos: int
    id: str | None = None


class _CallError(ValueError):
    """A call that cannot be used. The message ends with where: ``... at char <pos>``."""

    def __init__(self, message: str, pos: int, detail: str | None = None) -> None:
        super().__init__(f"{message} at char {pos}" + (f": {detail}" if detail else ""))


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>")
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_TAG = re.compile(r"<function=([^>\s]+)>")
_FUNCTION_CLOSE = "</function>"
_PARAMETER_TAG = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_MISTRAL_MARKER = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


def _skip_ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match else i


def _split_reasoning(text: str) -> tuple[str | None, str, int]:
    """Return (reasoning, the rest of the text, the offset of the rest in ``text``)."""
    open_, close = text.find(_THINK_OPEN), text.find(_THINK_CLOSE)
    opened = open_ != -1 and (close == -1 or open_ < close)
    if opened and text[:open_].strip():
        return None, text, 0  # <think> after real content: not reasoning, leave it alone
    if close == -1:
        if not opened:
            return None, text, 0
        return text[open_ + len(_THINK_OPEN) :].strip() or None, "", len(text)  # cut off
    start = open_ + len(_THINK_OPEN) if opened else 0
    rest = close + len(_THINK_CLOSE)
    return text[start:close].strip() or None, text[rest:], rest


def _parse_body(body: str, offset: int) -> tuple[list[_Call], list[str], str]:
    """Find the calls in ``body``; return (calls, errors, content left over)."""
    while (stripped := body.rstrip()).endswith(_END_OF_TURN):
        body = stripped[: stripped.rindex("<")]  # every end-of-turn token starts with "<"
    if _MISTRAL_MARKER in body:
        return _parse_mistral(body, offset)
    if _TOOL_CALL_OPEN in body or _FUNCTION_TAG.search(body):
        return _parse_tagged(body, offset)
    return _parse_whole_json(body, offset)


def _parse_tagged(body: str, offset: int) -> tuple[list[_Call], list[str], str]:
    """Hermes ``<tool_call>`` blocks and bare ``<function=...>`` blocks, in text order."""
    calls: list[_Call] = []
    errors: list[str] = []
    kept: list[str] = []
    i = 0
    fn = _FUNCTION_TAG.search(body)
    while True:
        tc = body.find(_TOOL_CALL_OPEN, i)
        if fn is not None and fn.start() < i:  # search again only once passed: linear time
            fn = _FUNCTION_TAG.search(body, i)
        if tc == -1 and fn is None:
            break
        if fn is None or (tc != -1 and tc <= fn.start()):
            start, inner = tc, tc + len(_TOOL_CALL_OPEN)
            close = body.find(_TOOL_CALL_CLOSE, inner)
            following = body.find(_TOOL_CALL_OPEN, inner)
            if close == -1 or -1 < following < close:  # unclosed: runs to the next call or the end
                inner_end = end = following if following != -1 else len(body)
            else:
                inner_end, end = close, close + len(_TOOL_CALL_CLOSE)
        else:
            start = inner = fn.start()
            close = body.find(_FUNCTION_CLOSE, fn.end())
            inner_end = end = len(body) if close == -1 else close + len(_FUNCTION_CLOSE)
        kept.append(body[i:start])
        try:
            calls.append(_parse_block(body, inner, inner_end, offset))
        except _CallError as e:
            errors.append(str(e))
            kept.append(body[start:end])
        i = end
    kept.append(body[i:])
    return calls, errors, "".join(kept)


def _parse_block(body: str, start: int, end: int, offset: int) -> _Call:
    """The inside of one ``<tool_call>`` (JSON or a function tag), or one function tag."""
    i = _skip_ws(body, start)
    if i >= end:
        raise _CallError("empty <tool_call>", offset + start)
    fn = _FUNCTION_TAG.match(body, i)
    if fn:
        return _parse_function_tag(body, fn, end, offset)
    obj, raw, _ = _decode_json(body[i:end], "<tool_call>", offset + i)
    return _call_from_object(obj, raw, "<tool_call>", offset + i)


def _parse_function_tag(body: str, fn: re.Match[str], end: int, offset: int) -> _Call:
    """``<function=name>`` followed by a JSON object or by ``<parameter=...>`` tags."""
    name, pos = fn.group(1), offset + fn.start()
    close = body.find(_FUNCTION_CLOSE, fn.end(), end)
    inner_end = close if close != -1 else end
    i = _skip_ws(body, fn.end())
    inner = body[i:inner_end].rstrip()
    if not inner:
        return _Call(name=name, arguments="{}", pos=pos)
    if inner.startswith("<parameter="):
        args = {}
        for key, value in _PARAMETER_TAG.findall(inner):
            value = value.strip("\n")
            try:
                args[key] = json.loads(value)
            except (json.JSONDecodeError, RecursionError):  # kept as text
                args[key] = value
        return _Call(name=name, arguments=json.dumps(args, ensure_ascii=False), pos=pos)
    where = f"<function={name}>"
    obj, _, _ = _decode_json(inner, where, offset + i)
    if not isinstance(obj, dict):
        raise _CallError(where, pos, f"arguments must be a JSON object, not {_json_type(obj)}")
    return _Call(name=name, arguments=inner, pos=pos)


def _parse_mistral(body: str, offset: int) -> tuple[list[_Call], list[str], str]:
    """``[TOOL_CALLS]`` then a JSON list or object, or ``name[ARGS]{...}`` per marker."""
    starts = [m.start() for m in re.finditer(re.escape(_MISTRAL_MARKER), body)]
    content = body[: starts[0]]
    calls: list[_Call] = []
    errors: list[str] = []
    for k, marker in enumerate(starts):
        begin = marker + len(_MISTRAL_MARKER)
        piece = body[begin : starts[k + 1] if k + 1 < len(starts) else len(body)]
        lead = _skip_ws(piece, 0)
        text, pos = piece.strip(), offset + begin + lead
        try:
            if text.startswith(("[", "{")):
                calls.extend(_calls_from_json(text, _MISTRAL_MARKER, pos))
            elif "[ARGS]" in text:
                head, _, args = text.partition("[ARGS]")
                name, _, call_id = head.partition("[CALL_ID]")
                args_pos = pos + len(head) + len("[ARGS]") + _skip_ws(args, 0)
                obj, _, _ = _decode_json(args.strip(), _MISTRAL_MARKER, args_pos)
                if not isinstance(obj, dict):
                    detail = f"arguments must be a JSON object, not {_json_type(obj)}"
                    raise _CallError(f"tool call {name.strip()!r}", pos, detail)
                calls.append(_Call(name.strip(), args.strip(), pos, call_id.strip() or None))
            elif text:
                raise _CallError("expected a JSON list after [TOOL_CALLS]", pos)
        except _CallError as e:
            errors.append(str(e))
            content += _MISTRAL_MARKER + piece
    return calls, errors, content


def _parse_whole_json(body: str, offset: int) -> tuple[list[_Call], list[str], str]:
    """Llama 3.1: the whole message is a call object or a list of them; else it is content."""
    lead = _skip_ws(body, 0)
    if body.startswith(_PYTHON_TAG, lead):
        lead = _skip_ws(body, lead + len(_PYTHON_TAG))
    text = body[lead:].rstrip()
    if not text.startswith(("{", "[")):
        return [], [], body
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return [], [], body  # JSON-looking content, not a call: nothing to report
    items = value if isinstance(value, list) else [value]
    if not items or not all(_looks_like_call(item) for item in items):
        return [], [], body
    try:
        return _calls_from_json(text, "JSON tool call", offset + lead), [], ""
    except _CallError as e:
        return [], [str(e)], body


def _looks_like_call(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and ("parameters" in item or "arguments" in item)
    )


def _calls_from_json(text: str, where: str, pos: int) -> list[_Call]:
    """A JSON object or a list of objects, each one call; ``text`` is stripped."""
    value, raw, _ = _decode_json(text, where, pos)
    if isinstance(value, dict):
        return [_call_from_object(value, raw, where, pos)]
    if not isinstance(value, list):
        raise _CallError(f"expected a JSON list or object in {where}, not {_json_type(value)}", pos)
    calls = []
    i = _skip_ws(text, 1)
    for _ in value:  # walk the list again to keep each element's raw text
        obj, raw, end = _decode_json(text[i:], where, pos + i, allow_trailing=True)
        calls.append(_call_from_object(obj, raw, where, pos + i))
        i = _skip_ws(text, _skip_ws(text, i + end) + 1)  # past the ',' (or the closing ']')
    return calls


def _call_from_object(obj: Any, raw: dict[str, str], where: str, pos: int) -> _Call:
    if not isinstance(obj, dict):
        raise _CallError(f"expected a JSON object in {where}, not {_json_type(obj)}", pos)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _CallError(f'missing "name" in {where}', pos)
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):  # the arguments written as a JSON string holding the object
        try:
            inner = json.loads(args)
        except json.JSONDecodeError as e:
            detail = f'"{key}" is a string but not JSON ({e.msg})'
            raise _CallError(f"tool call {name!r}", pos, detail) from None
        except RecursionError:
            detail = f'"{key}" is nested too deeply'
            raise _CallError(f"tool call {name!r}", pos, detail) from None
        if not isinstance(inner, dict):
            raise _CallError(f"tool call {name!r}", pos, f'"{key}" must hold a JSON object')
        text = args
    elif isinstance(args, dict):
        text = raw.get(key) or json.dumps(args, ensure_ascii=False)
    else:
        detail = f'"{key}" must be a JSON object, not {_json_type(args)}'
        raise _CallError(f"tool call {name!r}", pos, detail)
    call_id = obj.get("id")
    return _Call(name, text, pos, call_id if isinstance(call_id, str) and call_id else None)


def _decode_json(
    text: str, where: str, pos: int, *, allow_trailing: bool = False
) -> tuple[Any, dict[str, str], int]:
    """Decode the JSON value ``text`` starts with; ``pos`` is where ``text`` starts in the
    original text. Return the value, the raw text of each member's value when it is an
    object, and the end of the value in ``text``."""
    try:
        value, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError as e:
        raise _CallError(f"invalid JSON in {where}", pos + e.pos, e.msg) from None
    except RecursionError:
        raise _CallError(f"JSON nested too deeply in {where}", pos) from None
    if not allow_trailing and text[end:].strip():
        raise _CallError(f"unexpected text after the JSON in {where}", pos + end)
    raw: dict[str, str] = {}
    if isinstance(value, dict):
        i = _skip_ws(text, 1)
        while text[i] == '"':  # the object decoded above, so this walk cannot fail
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past the ':'
            _, value_end = _DECODER.raw_decode(text, i)
            raw[key] = text[i:value_end]
            i = _skip_ws(text, value_end)
            if text[i] == ",":
                i = _skip_ws(text, i + 1)
    return value, raw, end


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else "null"
