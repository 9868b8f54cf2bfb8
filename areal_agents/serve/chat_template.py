"""Chat templates rendered the way ``transformers``' ``apply_chat_template`` renders them.

The same sandboxed jinja2 environment and options (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension and the ``{% generation %}`` tag, which renders its body
unchanged), the same globals (``raise_exception``, ``strftime_now``, a safe ``namespace`` and
``dict``) and the same ``tojson`` filter (no HTML escaping, ``ensure_ascii=False`` by
default, ``indent``/``separators``/``sort_keys``). Compiled templates and the variables
each template reads are cached by source.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["compile_template", "template_variables", "wants_mapping_arguments"]


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
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the chat-template environment."""
    return _environment().from_string(source)


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads that it does not set itself."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))


def wants_mapping_arguments(source: str) -> bool:
    """Whether the template needs tool call arguments as a mapping (a mapping when it pipes
    them through ``tojson`` without testing ``arguments is string``/``is mapping``; see
    :mod:`areal_agents.serve.chat_messages`)."""
    if re.search(r"arguments\s+is\s+(?:not\s+)?(?:string|mapping)", source):
        return False
    return re.search(r"arguments\s*\|\s*tojson", source) is not None
