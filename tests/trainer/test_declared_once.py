"""Each setting of the training config is declared once.

Walks every section reachable from ``TrainConfig`` and every dataclass of the packages that
build things from it (trainer, rollout, engines, serve), and fails where a class declares
two or more of a section's settings again (the same field names, declared in its own body).
A section of overrides (``loss``, ``advantage``) is made from the class it overrides
(``areal_agents.trainer.algorithms.overrides_of``), so it declares nothing of its own.

A few classes below the trainer's import layer repeat a handful of names on purpose: they
are APIs used without any training config (the engine's sampling parameters, the proxy
server), and the layers contract forbids them to import it. Each is listed in ``ALLOWED``
with the reason; nothing else may repeat a section's settings.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import typing

import pytest

import areal_agents.engines
import areal_agents.rollout
import areal_agents.serve
import areal_agents.trainer
from areal_agents.trainer.config import LossConfig, TrainConfig

PACKAGES = (areal_agents.trainer, areal_agents.rollout, areal_agents.engines, areal_agents.serve)

ALLOWED: dict[tuple[str, str], str] = {
    ("areal_agents.engines.protocol.SamplingParams", "sampling"): (
        "the engine's request API (proxy, eval, serve use it without a training config); "
        "trainer/engine_build.py fills it from the sampling section"
    ),
    ("areal_agents.engines.protocol.SamplingParams", "eval"): (
        "the engine's request API; the held-out evaluation fills it from the eval section"
    ),
    ("areal_agents.rollout.cluster.EmbeddedSpec", "model"): (
        "the recipe an engine host builds an engine from on another node (pickled to Ray "
        "actors); the rollout layer cannot import the config"
    ),
    ("areal_agents.serve.server.ProxyServer", "workers"): (
        "the proxy server's own address (host, port), a different server than the worker API"
    ),
    ("areal_agents.rollout.runner.AgentTask", "rewards.judge"): (
        "an agent task's proxy URL and model name, not the judge's"
    ),
    ("areal_agents.trainer.memory.MemoryEstimate", "train"): (
        "a report of the inputs the estimate was computed for"
    ),
    ("areal_agents.trainer.schedule.LrSchedule", "optim"): (
        "the resolved schedule (total_steps = optim.total_steps or train.steps), computed once "
        "from the optim section for policies built without a config"
    ),
}


def _sections(cls: type, prefix: str = "", out: dict[type, str] | None = None) -> dict[type, str]:
    """Every section class reachable from ``cls``, by its dotted key."""
    out = {} if out is None else out
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out[tp] = prefix + f.name
            _sections(tp, f"{prefix}{f.name}.", out)
    return out


def _own_settings(cls: type) -> set[str]:
    """The fields ``cls`` declares in its own body that hold a value (not a section, not a
    spec holding one); none for a section made by ``overrides_of``."""
    if "__overrides_of__" in cls.__dict__:
        return set()
    inherited = {
        f.name
        for b in cls.__mro__[1:]
        if dataclasses.is_dataclass(b)
        for f in dataclasses.fields(b)
    }
    try:
        hints = typing.get_type_hints(cls)
    except NameError:  # an annotation only importable under TYPE_CHECKING
        hints = {}
    out = set()
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in inner):
            continue
        if f.name not in inherited:
            out.add(f.name)
    return out


def _classes() -> list[type]:
    found: dict[str, type] = {}
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if "migrations" in info.name:  # alembic's scripts, run by alembic only
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional dependency (e.g. ray) is missing here
                continue
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def _repeats() -> dict[tuple[str, str], set[str]]:
    """(class, section key) -> the settings of the section the class declares again."""
    sections = _sections(TrainConfig)
    out = {}
    for cls in _classes():
        if cls in sections or cls is TrainConfig:
            continue
        own = _own_settings(cls)
        for section, key in sections.items():
            shared = own & _own_settings(section)
            if len(shared) >= 2:
                out[(f"{cls.__module__}.{cls.__qualname__}", key)] = shared
    return out


def test_no_setting_is_declared_in_two_classes() -> None:
    repeats = {k: v for k, v in _repeats().items() if k not in ALLOWED}
    assert not repeats, (
        "these classes declare a config section's settings again; give them the section "
        f"itself (or the resolved object) instead: {repeats}"
    )


def test_the_allowed_repeats_are_real_and_have_reasons() -> None:
    repeats = _repeats()
    stale = [k for k in ALLOWED if k not in repeats]
    assert not stale, f"no longer repeated, remove from ALLOWED: {stale}"
    assert all(len(reason) > 30 for reason in ALLOWED.values())


def test_the_walk_finds_a_repeated_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the optim section's fields in a trainer class is found."""

    @dataclasses.dataclass
    class Copied:
        lr: float = 1e-3
        weight_decay: float = 0.0

    Copied.__module__ = "areal_agents.trainer.planted"
    Copied.__qualname__ = "Copied"
    real = _classes()
    monkeypatch.setattr(f"{__name__}._classes", lambda: [*real, Copied])
    assert _repeats()[("areal_agents.trainer.planted.Copied", "optim")] == {"lr", "weight_decay"}


def test_the_overrides_sections_are_made_from_the_specs() -> None:
    from areal_agents.trainer.algorithms import LossSpec

    assert LossConfig.__overrides_of__ is LossSpec  # type: ignore[attr-defined]
    assert [f.name for f in dataclasses.fields(LossConfig)] == [
        f.name for f in dataclasses.fields(LossSpec)
    ]
    assert all(f.default is None for f in dataclasses.fields(LossConfig))
