"""Every key of the training config is read by something outside the config's own modules
(``trainer/config*.py``).

A key that passes validation and is read by nothing is a lie told by the config: a user
sets it and nothing changes. This walks the config tree (every dataclass section reachable
from ``TrainConfig``) and looks for a read of each field in the package sources (except
the config modules). A bare ``.name`` would be found for most keys whether read or not
(``.path``, ``.kind``, ``.max_context`` are common attribute names), so a read is qualified
by its section:

* ``<section>.<name>``, e.g. ``cfg.optim.schedule`` or ``self.cfg.model.lora.r``;
* ``<alias>.<name>`` where ``<alias> = <...>.<section>`` was assigned in the same sources
  (``o = cfg.optim`` then ``o.warmup_steps``);
* ``getattr(<...>.<section>, "<name>"``;
* top-level keys: ``cfg.<name>``;
* a section of overrides of the algorithm's preset (``loss``, ``advantage``: made by
  ``areal_agents.trainer.algorithms.overrides_of`` from ``LossSpec`` / ``AdvantageSpec``,
  which ``resolve`` copies whole): the field of the resolved spec, read as
  ``spec.<name>`` or ``spec.<section>.<name>`` (``spec`` or any ``*_spec`` / ``*spec``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from areal_agents.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("areal_agents", "trainer", "envs", "tools")
# The config's own modules: the sections, their shared checks and the YAML loading.
CONFIG_MODULES = {
    (ROOT / "trainer" / name).resolve()
    for name in ("config.py", "config_rollout.py", "config_checks.py", "config_io.py")
}

SECTION_ALIASES: dict[str, tuple[str, ...]] = {
    # Sections whose class is an object of a lower layer, read under its own name there.
    "context": ("policy",),  # serve.context.ContextPolicy, read in serve/fitting.py
    "launch": ("launch",),  # engines.server_launch.LaunchConfig, read through a Launch
}

ALLOWED: dict[str, str] = {
    # Keys consumed inside the config modules themselves, each with the reason. Keep this minimal.
}


def _is_section(tp: object) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _overrides() -> set[str]:
    """The sections made by ``overrides_of``."""
    hints = typing.get_type_hints(TrainConfig)
    return {
        f.name
        for f in dataclasses.fields(TrainConfig)
        if hasattr(hints[f.name], "__overrides_of__")
    }


def _keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted key of every field of ``cls`` and of the sections inside it (a section
    itself is not a key to read: its fields are)."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            out.extend(_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            out.append(prefix + f.name)
    return out


def _sources() -> str:
    files = [
        p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if p.resolve() not in CONFIG_MODULES
    ]
    assert files, f"no sources found under {ROOT}"
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def _is_read(key: str, text: str) -> bool:
    *parents, name = key.split(".")
    n = re.escape(name)
    if not parents:
        return re.search(rf"\bcfg\.{n}\b", text) is not None
    sec = re.escape(parents[-1])
    if parents[0] in _overrides():
        return re.search(rf"\b\w*spec\.(?:{sec}\.)?{n}\b", text) is not None
    aliases = set(re.findall(rf"^\s*(\w+)\s*=\s*[\w.]*\.{sec}\s*$", text, re.MULTILINE))
    aliases |= set(SECTION_ALIASES.get(parents[-1], ()))
    patterns = [
        rf"\.{sec}\.{n}\b",
        rf"getattr\(\s*[\w.]*\.{sec}\s*,\s*['\"]{n}['\"]",
        *(rf"\b{re.escape(a)}\.{n}\b" for a in aliases),
    ]
    return any(re.search(p, text) for p in patterns)


def test_the_walk_covers_every_section() -> None:
    keys = set(_keys(TrainConfig))
    assert {"optim.schedule", "model.max_context", "sft.kind", "model.lora.r"} <= keys
    assert "env.id" in keys and "scheduler" in keys


def test_the_search_finds_a_read_and_misses_an_unread_key() -> None:
    text = "o = cfg.optim\nx = o.warmup_steps\ny = cfg.model.lora.r\nz = engine.max_context\n"
    assert _is_read("optim.warmup_steps", text) and _is_read("model.lora.r", text)
    assert not _is_read("model.max_context", text)  # an engine's attribute is not the key
    assert _overrides() == {"loss", "advantage"}
    overrides = "a = spec.loss.proximal\nif spec.kl_coef:\n"
    assert _is_read("loss.proximal", overrides) and _is_read("loss.kl_coef", overrides)
    assert not _is_read("loss.agg", overrides + "x.agg\ncfg.loss.agg\n")  # the spec's field


def test_every_config_key_is_read_outside_the_config_module() -> None:
    text = _sources()
    unread = [key for key in _keys(TrainConfig) if key not in ALLOWED and not _is_read(key, text)]
    assert not unread, (
        f"config keys read by nothing outside trainer/config*.py: {unread}; implement them or "
        "remove them from the config (and its docs)"
    )


def test_the_allow_list_names_real_keys_with_reasons() -> None:
    assert set(ALLOWED) <= set(_keys(TrainConfig))
    assert all(reason.strip() for reason in ALLOWED.values())
