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

:func:`function_tool` builds a tool from a typed function (the schema from pydantic); its
docstring (Google, numpy or reST style) gives the tool description and the per-argument
descriptions::

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
import functools
import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import docstring_parser
import jsonschema
import pydantic
from pydantic import TypeAdapter

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
_PY_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


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
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ...}``),
            checked with ``jsonschema`` (the draft its ``$schema`` names, else 2020-12);
            unless it says otherwise, the object takes no argument outside ``properties``.
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
        try:  # a schema that is not one fails here, where the tool is made, not mid-episode
            _validator(json.dumps(self.parameters, sort_keys=True))
        except UserError as exc:
            raise ValueError(f"tool {name!r}: {exc}") from None
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
        expected = self._signature_text()
        args = _parse_arguments(arguments, expected)
        _validate_object(args, self.parameters, expected)
        for key, convert in self._converters.items():
            if key in args:
                try:
                    args[key] = convert(args[key])
                except pydantic.ValidationError as exc:
                    problem = exc.errors()[0]["msg"]
                    raise _BadArguments(
                        f"argument {key!r} is invalid: {problem}. {expected}"
                    ) from None
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
    """Raise :class:`_BadArguments` naming the first argument that breaks ``schema`` and how
    (unknown arguments first, then missing ones, then the rest in the order written)."""
    order = list(args)
    errors = _validator(json.dumps(schema, sort_keys=True)).iter_errors(args)
    first = min(errors, key=lambda e: _rank(e, order), default=None)
    if first is not None:
        raise _BadArguments(f"{_problem(first)}. {expected}")


@functools.lru_cache(maxsize=1024)
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    """The compiled validator of a tool's parameters (cached per schema, so every bound copy
    of a tool shares it). The object is closed unless the schema says otherwise."""
    schema = {"additionalProperties": False, **json.loads(schema_json)}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise UserError(f"tool parameters are not a valid JSON schema: {exc.message}") from None
    return cls(schema)


def _rank(error: jsonschema.ValidationError, order: list[str]) -> tuple[int, int, int]:
    path = list(error.absolute_path)
    if not path:
        return (0 if error.validator == "additionalProperties" else 1, 0, 0)
    return (2, order.index(path[0]) if path[0] in order else len(order), len(path))


def _problem(error: jsonschema.ValidationError) -> str:
    """The model-facing text of one validation error: where, what is wrong, what is wanted."""
    value, schema, kind = error.instance, error.schema, error.validator
    head, *rest = [*error.absolute_path] or [None]
    where = " ".join(
        [f"argument {head!r}"] + [f"item {p}" if isinstance(p, int) else f"key {p!r}" for p in rest]
    )
    if kind == "additionalProperties" and isinstance(value, dict) and isinstance(schema, dict):
        key = next((k for k in value if k not in schema.get("properties", {})), "?")
        return f"unknown argument {key!r}" if head is None else f"{where} has unknown key {key!r}"
    if kind == "required" and isinstance(value, dict):
        key = next((k for k in error.validator_value if k not in value), "?")
        return (
            f"missing required argument {key!r}"
            if head is None
            else f"{where} is missing key {key!r}"
        )
    if head is None:
        return f"arguments are invalid: {error.message}"
    if kind == "enum":
        choices = ", ".join(json.dumps(c) for c in error.validator_value)
        return f"{where} must be one of {choices}, got {json.dumps(value, default=str)}"
    if kind in ("type", "anyOf", "oneOf") and isinstance(schema, dict):
        return f"{where} must be {_describe_type(schema)}, got {_show(value)}"
    return f"{where} is invalid: {error.message}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _PY_TYPES:
        if isinstance(value, kind):
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


_PLAIN_TYPES: tuple[Any, ...] = (str, int, float, bool, list, dict, Any, type(None))


def type_schema(
    hint: Any, *, where: str = ""
) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """JSON schema of a type annotation, and the converter from the validated JSON value.

    Both come from pydantic's ``TypeAdapter``: ``int`` accepts integral JSON numbers
    (``3.0``) and converts them to ``int``; ``float`` accepts any number; ``Enum`` accepts a
    member's value and converts it to the member. The schema is self-contained (no ``$defs``,
    no titles), and an optional single type is written ``{"type": [T, "null"]}``.
    Raises ``TypeError`` naming ``where`` for an unsupported annotation.
    """
    _check_supported(hint, where)
    adapter: TypeAdapter[Any] = TypeAdapter(hint)
    schema = adapter.json_schema()
    return _tidy(schema, schema.pop("$defs", {})), adapter.validate_python


def _check_supported(hint: Any, where: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and args and args[0] is not str:
        raise TypeError(f"{where}: dict keys must be str for a JSON schema, got {args[0]!r}")
    if origin in (list, dict, typing.Union, types.UnionType):
        for arg in args:
            _check_supported(arg, where)
    elif not (
        hint in _PLAIN_TYPES
        or origin is Literal
        or (isinstance(hint, type) and issubclass(hint, enum.Enum))
    ):
        raise TypeError(
            f"{where}: unsupported type {hint!r} for a tool argument; expected str, int, "
            "float, bool, list[...], dict[str, ...], Literal[...], X | None or an Enum (or "
            "name the parameter in state_params and bind it)"
        )


def _tidy(schema: Any, defs: Mapping[str, Any]) -> Any:
    """Pydantic's schema in this module's conventions: references inlined, no titles (nor an
    Enum's docstring), a one-value Literal as an ``enum``, a nullable single type as a type
    list, no empty ``items`` or ``additionalProperties: true``."""
    if isinstance(schema, list):
        return [_tidy(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        schema = {k: v for k, v in target.items() if k != "description"}
    out = {k: _tidy(v, defs) for k, v in schema.items() if k != "title"}
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if out.get("items") == {}:
        del out["items"]
    if out.get("additionalProperties") is True:
        del out["additionalProperties"]
    members = out.get("anyOf", [])
    if len(members) == 2 and {"type": "null"} in members:
        (inner,) = [m for m in members if m != {"type": "null"}]
        if isinstance(inner.get("type"), str):
            del out["anyOf"]
            out.update(inner, type=[inner["type"], "null"])
            if "enum" in inner:
                out["enum"] = [*inner["enum"], None]
    return out


# ---------------------------------------------------------------------------- docstrings


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into its description and per-argument descriptions.

    Google (``Args:``), numpy (``Parameters``) and reST (``:param [type] name:``) styles, as
    ``docstring_parser`` reads them; an argument's text is joined onto one line.
    """
    parsed = docstring_parser.parse(doc)
    args = {
        p.arg_name.lstrip("*"): " ".join((p.description or "").split())
        for p in parsed.params
        if p.args[0] != "attribute"
    }
    return (parsed.description or "").strip(), args
