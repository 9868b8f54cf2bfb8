"""Reading and writing the training config: YAML, dotted overrides, checks, suggestions.

``load_config`` reads a YAML file and ``a.b=c`` overrides into a
:class:`~areal_agents.trainer.config.TrainConfig`: every key is checked against the
sections' fields (an unknown key gets the nearest valid one), every value against its
annotation (converted where YAML wrote it otherwise, e.g. ``1e4`` for an int), then every
section's value rules; one ``ConfigError`` lists every problem. ``dump_yaml`` and
``format_config`` write the resolved config back (``load_config`` reads it to an equal
object), ``to_dict`` gives it as plain dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from areal_agents.errors import ConfigError
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_checks import (
    CORE_KEYS,
    Checked,
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
    """``value`` checked against annotation ``tp`` and converted, or ``_INVALID``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_section(tp):
        return _build(tp, value, where + ".", problems)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        problems.append(choice_problem(where, value, args))
        return _INVALID
    if origin in (types.UnionType, typing.Union) and type(None) in args:  # X | None
        inner = next(a for a in args if a is not type(None))
        return None if value is None else _coerce(inner, value, where, problems)
    if origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        want = "a mapping with string keys"
    elif origin is tuple:
        variadic, seq = args[1:] == (Ellipsis,), value if isinstance(value, list | tuple) else None
        kinds = [args[0]] * len(seq) if variadic and seq is not None else list(args)
        items = [_scalar(kind, v) for kind, v in zip(kinds, seq or (), strict=False)]
        if seq is not None and len(seq) == len(kinds) and _INVALID not in items:
            return tuple(items)
        want = f"a list of {args[0].__name__}" + ("" if variadic else f" (length {len(args)})")
    else:
        converted = _scalar(tp, value)
        if converted is not _INVALID:
            return converted
        want = tp.__name__
    problems.append(f"{where}: expected {want}, got {value!r}")
    return _INVALID


def _scalar(tp: Any, value: Any) -> Any:
    """``value`` as a bool, int, float or str, or ``_INVALID``. Bools are never numbers."""
    if tp is bool or isinstance(value, bool):
        return value if tp is bool and isinstance(value, bool) else _INVALID
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e4 written for 10000
    if tp is float and isinstance(value, int):
        return float(value)
    return value if tp in (int, float, str) and isinstance(value, tp) else _INVALID


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
    """The value problems of ``section`` and of every section inside it, with full keys."""
    out = []
    for f in dataclasses.fields(section):
        if isinstance(child := getattr(section, f.name), Checked):
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
