"""Reading and writing the training config: YAML, dotted overrides, checks, suggestions.

``load_config`` reads a YAML file and ``a.b=c`` overrides into a
:class:`~areal_agents.trainer.config.TrainConfig`: every key is checked against the
sections' fields (an unknown key gets the nearest valid one), every value against its
annotation by pydantic (strict scalars; ``1e4`` for an int and a list for a tuple are
accepted), then every section's value rules; one ``ConfigError`` lists every problem.
``dump_yaml`` and ``format_config`` write the resolved config back (``load_config`` reads
it to an equal object), ``to_dict`` gives it as plain dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

from areal_agents.errors import ConfigError
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_checks import (
    CORE_KEYS,
    allowed_cores,
    choice_problem,
)


class _Loader(yaml.SafeLoader):
    """A SafeLoader that reads ``1e-6`` as a float (as YAML 1.2 does), refuses duplicate keys."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key_node, deep=deep) for key_node, _ in node.value]
        if dup := [key for i, key in enumerate(keys) if key in keys[:i]]:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {dup[0]!r}", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """A SafeDumper that quotes the strings ``_Loader`` would read as floats (``'1e-6'``)."""


_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _yaml in (_Loader, _Dumper):
    _yaml.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))

_INVALID: Any = object()  # a value that failed its type check (its problem is recorded)


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML file (None: the defaults), apply ``a.b=c`` overrides, check everything.

    Raises one ``ConfigError`` listing every problem: unknown keys (with the nearest valid
    key), wrong types, values out of range and inconsistent combinations.
    """
    problems: list[str] = []
    data = {} if path is None else _read_file(Path(path), problems)
    for item in overrides:
        _apply_override(data, item, problems)
    if problems:  # the file or an override cannot be read: report those first
        raise ConfigError("cannot read the training config", problems=problems)
    _resolve_cores(data, problems)
    cfg: TrainConfig = _build(TrainConfig, data, "", problems)
    problems.extend(_value_problems(cfg, ""))
    if problems:
        raise ConfigError("invalid training config", problems=problems)
    return cfg


def _read_file(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"cannot read config file '{path}': {exc}")
        return {}
    if not isinstance(data, dict | None):
        problems.append(f"config file '{path}': expected a mapping of keys, got {data!r}")
    return data if isinstance(data, dict) else {}


def _apply_override(data: dict[str, Any], item: str, problems: list[str]) -> None:
    """Set ``a.b.c=value`` in the raw nested dict ``data``, creating sections as needed."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        problems.append(f"override {item!r}: expected key=value, e.g. rollout.group_size=8")
        return
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        problems.append(f"override {item!r}: cannot parse {text!r} as YAML; quote it")
        return
    for part in keys[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[keys[-1]] = value


def _resolve_cores(data: dict[str, Any], problems: list[str]) -> None:
    """Replace each core list written as ``allowed[...]`` by the cores it picks here
    (:func:`~areal_agents.trainer.config_checks.allowed_cores`): the config holds, and the
    run directory's config.yaml records, core numbers."""
    for section, key in CORE_KEYS:
        values = data.get(section)
        if isinstance(values, dict) and isinstance(values.get(key), str):
            try:
                values[key] = list(allowed_cores(values[key], f"{section}.{key}"))
            except ConfigError as exc:
                problems.append(str(exc))
                del values[key]  # reported once, not again as a wrong type


def _build(cls: type[Any], data: Any, prefix: str, problems: list[str]) -> Any:
    """Build dataclass ``cls`` from raw ``data``, recording unknown keys and type problems.

    Value checks are left to ``_value_problems`` (run once over the whole tree, so that every
    problem is reported at once); a field with a wrong type keeps its default meanwhile.
    """
    if not isinstance(data, Mapping):
        if data is not None:
            problems.append(f"{prefix.rstrip('.')}: expected a mapping of keys, got {data!r}")
        data = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems.extend(
        _unknown_key_problem(prefix + str(k), list(fields), prefix) for k in data if k not in fields
    )
    hints, values = typing.get_type_hints(cls), {}
    for name, f in fields.items():
        where, tp = prefix + name, hints[name]
        value = _coerce(tp, data[name], where, problems) if name in data else _INVALID
        if value is _INVALID and f.default is not dataclasses.MISSING:
            value = f.default
        elif value is _INVALID and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        elif value is _INVALID:  # required: a section is built from {}, else it is a problem
            value = _build(tp, {}, where + ".", problems) if _is_section(tp) else None
            if value is None and name not in data:
                problems.append(f"{where}: required, but missing")
        values[name] = value
    obj = object.__new__(cls)  # a frozen instance, built without __post_init__'s checks
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    """``value`` validated against annotation ``tp`` by pydantic (:func:`_adapter`), or
    ``_INVALID`` with its problem recorded."""
    if _is_section(tp):
        return _build(tp, value, where + ".", problems)
    try:
        return _adapter(tp).validate_python(value)
    except pydantic.ValidationError:
        choices = _choices(tp)
        if choices is not None and (value is not None or type(None) not in typing.get_args(tp)):
            problems.append(choice_problem(where, value, choices))
        else:
            problems.append(f"{where}: expected {_want(tp)}, got {value!r}")
        return _INVALID


@functools.cache
def _adapter(tp: Any) -> pydantic.TypeAdapter[Any]:
    """pydantic's validator of annotation ``tp`` with the config's rules: scalars strict (a
    bool is never a number, a quoted string never a number or a bool), an int may be written
    as an integral float (``1e4``), a tuple as a YAML list."""
    return pydantic.TypeAdapter(_strict(tp))


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


_STRICT: dict[Any, Any] = {
    int: Annotated[int, pydantic.BeforeValidator(_integral), pydantic.Strict()],
    float: Annotated[float, pydantic.Strict()],
    bool: Annotated[bool, pydantic.Strict()],
    str: Annotated[str, pydantic.Strict()],
}


def _strict(tp: Any) -> Any:
    """``tp`` with each scalar replaced by its strict form (``_STRICT``); containers stay
    lax (a list validates as a tuple). A mapping's values are left to its section's rules,
    which name the entry that is wrong."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _STRICT:
        return _STRICT[tp]
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, [_strict(a) for a in args])
    if origin is tuple:
        return tuple[tuple(_strict(a) if a is not Ellipsis else a for a in args)]  # type: ignore[misc]
    if origin is dict:
        return dict[_strict(args[0]), Any]  # type: ignore[misc]
    return tp


def _choices(tp: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal`` annotation (or of ``Literal | None``), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return args
    inner = [a for a in args if a is not type(None)]
    if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
        return typing.get_args(inner[0])
    return None


def _want(tp: Any) -> str:
    """What annotation ``tp`` expects, in words (the message of a wrong value)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_want(a) for a in args if a is not type(None))
    if origin is dict:
        return "a mapping with string keys"
    if origin is tuple:
        name = getattr(args[0], "__name__", str(args[0]))
        return f"a list of {name}" + ("" if args[1:] == (Ellipsis,) else f" (length {len(args)})")
    return getattr(tp, "__name__", str(tp))


def _unknown_key_problem(key: str, siblings: list[str], prefix: str) -> str:
    """``unknown key 'a.b'`` with the nearest valid key: a sibling, else a key elsewhere."""
    leaf = key.rsplit(".", 1)[-1]
    near = [prefix + c for c in difflib.get_close_matches(leaf, siblings, n=1)]
    if not near:  # e.g. a top-level 'lr' -> 'optim.lr' or 'sft.lr'
        every = _all_keys(TrainConfig)
        leaves = {k.rsplit(".", 1)[-1] for k in every}
        match = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.75)
        near = [k for k in every if match and k.rsplit(".", 1)[-1] == match[0]][:3]
    if near:
        return f"unknown key {key!r}; did you mean {' or '.join(map(repr, near))}?"
    return f"unknown key {key!r}; valid keys here: {', '.join(siblings)}"


def _all_keys(cls: type[Any], prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls``, sections included."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if _is_section(hints[f.name]):
            out.extend(_all_keys(hints[f.name], f"{prefix}{f.name}."))
    return out


def _value_problems(section: Any, prefix: str) -> list[str]:
    """The value problems of ``section`` and of every section inside it, with full keys: each
    section's ``_problems()`` (``Checked``'s, or a section declared below the trainer, such
    as ``areal_agents.serve.context.ContextPolicy``, with its own)."""
    out = []
    for f in dataclasses.fields(section):
        child = getattr(section, f.name)
        if dataclasses.is_dataclass(child) and hasattr(child, "_problems"):
            out.extend(_value_problems(child, f"{prefix}{f.name}."))
    own = section._problems()
    return out + (own if isinstance(section, TrainConfig) else [prefix + p for p in own])


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config (or one section) as plain nested dicts, lists and scalars, for YAML or JSON."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _plain(value: Any) -> Any:
    if _is_section(type(value)):
        return to_dict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def dump_yaml(cfg: TrainConfig, path: str | os.PathLike[str]) -> None:
    """Write ``format_config(cfg)`` to ``path`` atomically; ``load_config(path)`` reads it back."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(format_config(cfg) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def format_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML (for ``--dry-run``), ending with what differs from defaults."""
    text = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    defaults = _build(TrainConfig, {"env": {"id": cfg.env.id}}, "", [])  # not validated
    now, base = _flatten(to_dict(cfg)), to_dict(defaults)
    changed = ", ".join(f"{k} (default {v!r})" for k, v in _flatten(base).items() if now[k] != v)
    return text + "# changed from the defaults: " + (changed or "nothing")


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one dict with dotted keys (``env.kwargs`` stays one value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and prefix + key != "env.kwargs":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
