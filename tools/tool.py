"""Tools an agent can call: a Python function plus the JSON schema the model sees.

A :class:`Tool` has a ``name``, a ``description`` and ``parameters`` (a JSON schema of type
``object``). ``tool.schema`` is the OpenAI tool schema::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}

``tool.call(arguments)`` runs the tool on the arguments the model wrote (a JSON string or a
dict) and returns a :class:`ToolResult`. A model mistake is data, never an exception: bad
JSON, an unknown, missing or wrongly typed argument, an exception inside the function, or a
timeout all become ``ToolResult(content="Error: ...", error=<kind>)`` whose content tells the
model what was wrong and what is expected. The kinds are ``"bad_arguments"``,
``"tool_exception"`` and ``"timeout"``.

:func:`function_tool` builds a tool from a typed function; its docstring (Google or reST
style) gives the tool description and the per-argument descriptions::

    >>> @function_tool
    ... def add(a: int, b: int = 1) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: The first term.
    ...         b: The second term.
    ...     '''
    ...     return a + b
    >>> add.call('{"a": 2, "b": 3}').content
    '5'
    >>> result = add.call('{"a": "two"}')
    >>> result.error
    'bad_arguments'
    >>> print(result.content)  # doctest: +NORMALIZE_WHITESPACE
    Error: argument 'a' must be an integer, got a string ("two").
    Expected arguments: a (integer, required), b (integer, default 1).

Episode state (a database, a sandbox) is passed with :meth:`Tool.bind`: bound parameters
vanish from the schema and are filled in on every call. Parameters whose type has no JSON
schema (an ``EpisodeState`` object) must be named in ``function_tool(state_params=...)``.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from areal_agents.errors import ToolError, UserError

__all__ = ["Tool", "ToolResult", "function_tool"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        content: What the model reads in the ``tool`` message.
        error: ``None`` on success, else the kind of failure: ``"bad_arguments"``,
            ``"tool_exception"`` or ``"timeout"`` (envs add ``"unknown_tool"``).
    """

    content: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the call succeeded."""
        return self.error is None


class _BadArguments(Exception):
    """Raised inside validation; becomes a ``bad_arguments`` result."""


class Tool:
    """A callable tool with the JSON schema of its arguments.

    Args:
        name: The name the model calls (letters, digits, ``_`` and ``-``; at most 64).
        description: What the tool does, for the model.
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ...}``).
            The subset used for validation: ``type`` (or a list of types), ``enum``,
            ``items``, ``properties``, ``required``, ``additionalProperties``, ``anyOf``.
        fn: The function, called with the validated arguments as keywords; plain or async.
        timeout_s: Optional wall-clock limit per call.
        converters: Optional per-argument functions applied after validation (e.g. to build
            an ``Enum`` member from its value).
        state_params: Parameters of ``fn`` absent from the schema that must be bound with
            :meth:`bind` before the tool is called.
        bound: Values already bound (see :meth:`bind`).
    """

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        fn: Callable[..., Any],
        *,
        timeout_s: float | None = None,
        converters: Mapping[str, Callable[[Any], Any]] | None = None,
        state_params: Collection[str] = (),
        bound: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"tool name must match {_NAME_RE.pattern}, got {name!r}")
        if dict(parameters).get("type") != "object":
            raise ValueError(
                f"tool parameters must be a JSON schema of type 'object', got {parameters!r}"
            )
        self.name = name
        self.description = description
        self.parameters: dict[str, Any] = json.loads(json.dumps(dict(parameters)))
        self.parameters.setdefault("properties", {})
        self.fn = fn
        self.timeout_s = timeout_s
        self._converters = dict(converters or {})
        self.state_params = tuple(state_params)
        self._bound = dict(bound or {})

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, parameters={list(self.parameters['properties'])})"

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def bind(self, **fixed: Any) -> Tool:
        """Return a copy whose parameters ``fixed`` are always filled with these values.

        Bound parameters vanish from the schema; a model that passes one gets an
        ``unknown argument`` error. Binding a name the function does not take is a
        ``TypeError``.
        """
        accepted = set(self.parameters["properties"]) | set(self._unbound_state_params())
        unknown = sorted(set(fixed) - accepted)
        if unknown:
            raise TypeError(
                f"cannot bind {unknown} on tool {self.name!r}: expected one of {sorted(accepted)}"
            )
        params = json.loads(json.dumps(self.parameters))
        for key in fixed:
            params["properties"].pop(key, None)
        if "required" in params:
            params["required"] = [r for r in params["required"] if r not in fixed]
        return Tool(
            self.name,
            self.description,
            params,
            self.fn,
            timeout_s=self.timeout_s,
            converters=self._converters,
            state_params=self.state_params,
            bound={**self._bound, **fixed},
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly (bound parameters filled in)."""
        return self.fn(*args, **{**self._bound, **kwargs})

    def call(self, arguments: str | Mapping[str, Any] | None = None) -> ToolResult:
        """Run the tool on the model's arguments; never raises for model mistakes."""
        try:
            kwargs = self._prepare(arguments)
        except _BadArguments as exc:
            return ToolResult(f"Error: {exc}", error="bad_arguments")
        if inspect.iscoroutinefunction(self.fn):
            return _run_coroutine_sync(self._acall_validated(kwargs))
        if self.timeout_s is not None:
            return _run_coroutine_sync(self._acall_validated(kwargs))
        try:
            return _to_result(self.fn(**kwargs))
        except Exception as exc:
            return _exception_result(exc)

    async def acall(self, arguments: str | Mapping[str, Any] | None = None) -> ToolResult:
        """Async :meth:`call`: awaits async functions, honours ``timeout_s``."""
        try:
            kwargs = self._prepare(arguments)
        except _BadArguments as exc:
            return ToolResult(f"Error: {exc}", error="bad_arguments")
        return await self._acall_validated(kwargs)

    async def _acall_validated(self, kwargs: dict[str, Any]) -> ToolResult:
        try:
            if inspect.iscoroutinefunction(self.fn):
                awaitable: Awaitable[Any] = self.fn(**kwargs)
            elif self.timeout_s is not None:
                awaitable = asyncio.to_thread(self.fn, **kwargs)
            else:
                return _to_result(self.fn(**kwargs))
            return _to_result(await asyncio.wait_for(awaitable, self.timeout_s))
        except TimeoutError:
            return ToolResult(
                f"Error: tool {self.name!r} timed out after {self.timeout_s} s", error="timeout"
            )
        except Exception as exc:
            return _exception_result(exc)

    def _unbound_state_params(self) -> list[str]:
        return [p for p in self.state_params if p not in self._bound]

    def _prepare(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        missing_state = self._unbound_state_params()
        if missing_state:
            raise UserError(
                f"tool {self.name!r} needs bind({', '.join(f'{p}=...' for p in missing_state)}) "
                "before it is called"
            )
        args = _parse_arguments(arguments, self._signature_text())
        _validate_object(args, self.parameters, self._signature_text())
        for key, convert in self._converters.items():
            if key in args:
                args[key] = convert(args[key])
        return {**self._bound, **args}

    def _signature_text(self) -> str:
        props = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", []))
        if not props:
            return "Expected no arguments: {}."
        parts = []
        for key, sub in props.items():
            kind = _describe_type(sub).removeprefix("an ").removeprefix("a ")
            if key in required:
                parts.append(f"{key} ({kind}, required)")
            elif "default" in sub:
                parts.append(f"{key} ({kind}, default {json.dumps(sub['default'])})")
            else:
                parts.append(f"{key} ({kind}, optional)")
        return "Expected arguments: " + ", ".join(parts) + "."


# ---------------------------------------------------------------------------- calling


def _run_coroutine_sync(coro: Awaitable[ToolResult]) -> ToolResult:
    """Run a coroutine to completion from sync code, inside or outside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    box: list[ToolResult] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(coro)))  # type: ignore[arg-type]
    thread.start()
    thread.join()
    return box[0]


def _to_result(value: Any) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult("")
    if isinstance(value, str):
        return ToolResult(value)
    if isinstance(value, (dict, list, tuple)):
        return ToolResult(json.dumps(value, default=str))
    return ToolResult(str(value))


def _exception_result(exc: Exception) -> ToolResult:
    if isinstance(exc, ToolError):
        return ToolResult(f"Error: {exc}", error="tool_exception")
    return ToolResult(f"Error: {type(exc).__name__}: {exc}", error="tool_exception")


# ---------------------------------------------------------------------------- validation


def _parse_arguments(arguments: str | Mapping[str, Any] | None, expected: str) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise _BadArguments(
                f"arguments are not valid JSON ({exc.msg} at position {exc.pos}); "
                f"write a JSON object. {expected}"
            ) from None
    if not isinstance(arguments, Mapping):
        raise _BadArguments(
            f"arguments must be a JSON object, got {_json_type(arguments)}. {expected}"
        )
    return dict(arguments)


def _validate_object(args: dict[str, Any], schema: Mapping[str, Any], expected: str) -> None:
    props = schema.get("properties", {})
    unknown = [k for k in args if k not in props]
    if unknown and not schema.get("additionalProperties", False):
        raise _BadArguments(f"unknown argument {unknown[0]!r}. {expected}")
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        raise _BadArguments(f"missing required argument {missing[0]!r}. {expected}")
    for key, value in args.items():
        problem = _check(value, props.get(key, {}))
        if problem:
            raise _BadArguments(f"argument {key!r} {problem}. {expected}")


def _check(value: Any, schema: Mapping[str, Any]) -> str | None:
    """Return a description of how ``value`` violates ``schema``, or None."""
    if "anyOf" in schema:
        if any(_check(value, sub) is None for sub in schema["anyOf"]):
            return None
        return f"must be {_describe_type(schema)}, got {_show(value)}"
    types_ = schema.get("type")
    if types_ is not None:
        allowed = [types_] if isinstance(types_, str) else list(types_)
        if not any(_is_type(value, t) for t in allowed):
            return f"must be {_describe_type(schema)}, got {_show(value)}"
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(json.dumps(c) for c in schema["enum"])
        return f"must be one of {choices}, got {json.dumps(value, default=str)}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problem = _check(item, schema["items"])
            if problem:
                return f"item {i} {problem}"
    if isinstance(value, dict):
        return _check_mapping(value, schema)
    return None


def _check_mapping(value: dict[str, Any], schema: Mapping[str, Any]) -> str | None:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if sub is None and extra is False:
            return f"has unknown key {key!r}"
        problem = _check(item, sub or {})
        if problem:
            return f"key {key!r} {problem}"
    missing = [k for k in schema.get("required", []) if k not in value]
    return f"is missing key {missing[0]!r}" if missing else None


def _is_type(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        is_int = isinstance(value, int) and not isinstance(value, bool)
        return is_int or (isinstance(value, float) and value.is_integer())
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    checks: dict[str, Callable[[Any], bool]] = {
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    return checks.get(json_type, lambda v: True)(value)


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name) and not (name == "integer" and isinstance(value, float)):
            return _JSON_TYPE_NAMES[name]
    return type(value).__name__


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_json_type(value)} ({text})" if value is not None else "null"


def _describe_type(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(c) for c in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe_type(s) for s in schema["anyOf"])
    types_ = schema.get("type")
    if types_ is None:
        return "any value"
    names = [types_] if isinstance(types_, str) else list(types_)
    described = []
    for name in names:
        text = _JSON_TYPE_NAMES.get(name, name)
        if name == "array" and "items" in schema:
            text += f" of {_describe_type(schema['items']).removeprefix('a ').removeprefix('an ')}s"
        described.append(text)
    return " or ".join(described)


# ---------------------------------------------------------------------------- function_tool


def function_tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    state_params: Collection[str] = (),
    timeout_s: float | None = None,
) -> Any:
    """Turn a typed function (plain or async) into a :class:`Tool`.

    Usable bare (``@function_tool``) or with options (``@function_tool(name="calc")``).

    Args:
        fn: The function. Every parameter needs a type annotation among ``str``, ``int``,
            ``float``, ``bool``, ``list[...]``, ``dict[str, ...]``, ``Literal[...]``,
            ``X | None`` and ``Enum`` subclasses, unless it is named in ``state_params``.
        name: Tool name; the function's name by default.
        description: Tool description; the docstring's text before its argument section
            by default.
        state_params: Parameters filled from episode state with :meth:`Tool.bind`, never
            shown to the model.
        timeout_s: Optional wall-clock limit per call.
    """

    def build(func: Callable[..., Any]) -> Tool:
        summary, arg_docs = parse_docstring(inspect.getdoc(func) or "")
        parameters, converters = _parameters_schema(func, arg_docs, set(state_params))
        return Tool(
            name or func.__name__,
            description if description is not None else summary,
            parameters,
            func,
            timeout_s=timeout_s,
            converters=converters,
            state_params=state_params,
        )

    return build if fn is None else build(fn)


def _parameters_schema(
    func: Callable[..., Any], arg_docs: dict[str, str], hidden: set[str]
) -> tuple[dict[str, Any], dict[str, Callable[[Any], Any]]]:
    signature = inspect.signature(func)
    hints = _resolve_hints(func, hidden)
    unknown_hidden = hidden - set(signature.parameters)
    if unknown_hidden:
        raise TypeError(
            f"state_params {sorted(unknown_hidden)} are not parameters of {func.__name__}"
        )
    properties: dict[str, Any] = {}
    required: list[str] = []
    converters: dict[str, Callable[[Any], Any]] = {}
    for pname, param in signature.parameters.items():
        if pname in hidden or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise TypeError(
                f"parameter {pname!r} of {func.__name__} needs a type annotation "
                "(str, int, float, bool, list[...], dict[str, ...], Literal[...], Enum)"
            )
        prop, convert = type_schema(hints[pname], where=f"{func.__name__}.{pname}")
        if convert is not None:
            converters[pname] = convert
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            default = param.default.value if isinstance(param.default, enum.Enum) else param.default
            if _json_safe(default):
                prop["default"] = default
        properties[pname] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    schema["additionalProperties"] = False
    return schema, converters


def _resolve_hints(func: Callable[..., Any], hidden: set[str]) -> dict[str, Any]:
    """Type hints of the parameters shown to the model (state params may be unresolvable)."""
    raw = inspect.get_annotations(inspect.unwrap(func))
    shown = {k: v for k, v in raw.items() if k not in hidden and k != "return"}
    holder = types.SimpleNamespace(__annotations__=shown)
    try:
        return typing.get_type_hints(holder, globalns=getattr(func, "__globals__", {}))
    except NameError as exc:
        raise TypeError(
            f"cannot resolve the type annotations of {func.__name__}: {exc}; "
            "use types defined at module level"
        ) from None


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_PRIMITIVE_CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    int: lambda v: int(v) if isinstance(v, float) else v,
    float: float,
}


def type_schema(
    hint: Any, *, where: str = ""
) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """JSON schema of a type annotation, and an optional converter from the JSON value.

    ``int`` accepts integral JSON numbers (``3.0``) and converts them to ``int``; ``float``
    accepts any number; ``Enum`` accepts a member's value and converts it to the member.
    Raises ``TypeError`` naming ``where`` for an unsupported annotation.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}, _PRIMITIVE_CONVERTERS.get(hint)
    if hint is Any:
        return {}, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        return {"type": _literal_type(values), "enum": values}, hint
    if origin is Literal:
        return {"type": _literal_type(list(args)), "enum": list(args)}, None
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args, where)
    if hint is list or origin is list:
        if not args:
            return {"type": "array"}, None
        items, item_convert = type_schema(args[0], where=where)
        return {"type": "array", "items": items}, (
            (lambda v: [item_convert(x) for x in v]) if item_convert else None
        )
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}, None
        if args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str for a JSON schema, got {args[0]!r}")
        value_schema, value_convert = type_schema(args[1], where=where)
        return {"type": "object", "additionalProperties": value_schema}, (
            (lambda v: {k: value_convert(x) for k, x in v.items()}) if value_convert else None
        )
    raise TypeError(
        f"{where}: unsupported type {hint!r} for a tool argument; expected str, int, float, "
        "bool, list[...], dict[str, ...], Literal[...], X | None or an Enum (or name the "
        "parameter in state_params and bind it)"
    )


def _union_schema(
    args: tuple[Any, ...], where: str
) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    members = [a for a in args if a is not type(None)]
    nullable = len(members) < len(args)
    subs = [type_schema(a, where=where) for a in members]
    if len(subs) == 1:
        schema, convert = subs[0]
        schema = dict(schema)
        if nullable and isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
            if "enum" in schema:
                schema["enum"] = [*schema["enum"], None]
        elif nullable:
            schema = {"anyOf": [schema, {"type": "null"}]}
    else:
        schema = {"anyOf": [s for s, _ in subs] + ([{"type": "null"}] if nullable else [])}
        convert = None
    if convert is not None and nullable:
        return schema, lambda v, c=convert: None if v is None else c(v)
    return schema, convert


def _literal_type(values: list[Any]) -> str | list[str]:
    names = sorted({_json_type(v).split(" ")[-1] for v in values})
    return names[0] if len(names) == 1 else names


# ---------------------------------------------------------------------------- docstrings

_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|"
    r"Attributes|See Also)\s*:?\s*$"
)
_GOOGLE_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_REST_PARAM_RE = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into its description and per-argument descriptions.

    Understands Google style (an ``Args:`` section of ``name (type): text`` lines, with
    deeper-indented continuation lines) and reST style (``:param [type] name: text``).
    """
    summary: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for raw in inspect.cleandoc(doc).splitlines():
        line, indent = raw.strip(), len(raw) - len(raw.lstrip())
        rest = _REST_PARAM_RE.match(line)
        header = _SECTION_RE.match(line)
        google = _GOOGLE_ARG_RE.match(line)
        if rest:
            section, current = "rest", rest.group(1)
            args[current] = rest.group(2).strip()
        elif line.startswith(":") or header:
            section = header.group(1).lower() if header else "rest"
            current, arg_indent = None, None
        elif section is None:
            summary.append(line)
        elif section in _ARG_SECTIONS and google and indent <= (arg_indent or indent):
            arg_indent, current = indent, google.group(1).lstrip("*")
            args[current] = google.group(3).strip()
        elif section in (*_ARG_SECTIONS, "rest") and current and line:
            args[current] = f"{args[current]} {line}".strip()
    return "\n".join(summary).strip(), args


_ARG_SECTIONS = ("args", "arguments", "parameters", "params")
