"""A training step one reader can walk: the policy and critic the loop and the step use are
typed protocols (``areal_agents.trainer.protocols``) that every concrete class meets, with no
``Any`` in their signatures or in ``Trainer``'s, enforced by mypy
(``disallow_any_explicit``); the step's home lists the path a batch takes, and
``Trainer.run`` fits on a screen."""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
import typing
from pathlib import Path

import pytest

from areal_agents.trainer import protocols, step
from areal_agents.trainer.critic import Critic
from areal_agents.trainer.distributed import DistributedCritic, DistributedPolicy
from areal_agents.trainer.loop import Trainer
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.time_budget import TimeBoxed

REPO = Path(__file__).resolve().parents[2]

IMPLEMENTATIONS = [
    (protocols.Policy, Policy),
    (protocols.Policy, DistributedPolicy),
    (protocols.Critic, Critic),
    (protocols.Critic, DistributedCritic),
    (protocols.Trainable, TimeBoxed),
]


def _members(proto: type) -> dict[str, object]:
    """The methods and properties ``proto`` declares (its own and its protocol bases')."""
    out: dict[str, object] = {}
    for base in reversed(proto.__mro__):
        if base is object or base is typing.Protocol or base is typing.Generic:
            continue
        for name, value in vars(base).items():
            if (not name.startswith("_") or name == "__call__") and (
                inspect.isfunction(value) or isinstance(value, property)
            ):
                out[name] = value
    return out


def _parameters(fn: typing.Callable[..., object]) -> list[tuple[str, object, object]]:
    """Each parameter's name, kind and default (``self`` left out)."""
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize(("proto", "cls"), IMPLEMENTATIONS, ids=lambda x: x.__qualname__)
def test_every_policy_and_critic_has_the_protocols_methods_with_their_parameters(proto, cls):
    """Structurally, parameter for parameter (names, kinds, defaults; mypy checks the
    types): a property is a property of the class or an attribute its ``__init__`` sets."""
    for name, member in _members(proto).items():
        if isinstance(member, property):
            have = inspect.getattr_static(cls, name, None)
            assert isinstance(have, property) or re.search(
                rf"\bself\.{name}\s*=", inspect.getsource(cls.__init__)
            ), f"{cls.__qualname__}.{name}: not a property nor set by __init__"
            continue
        have = inspect.getattr_static(cls, name, None)
        assert have is not None, f"{cls.__qualname__} has no {name}"
        assert _parameters(getattr(cls, name)) == _parameters(member), (
            f"{cls.__qualname__}.{name}{inspect.signature(getattr(cls, name))} is not the "
            f"protocol's {name}{inspect.signature(member)}"
        )


def _mentions_any(tp: object) -> bool:
    if tp is typing.Any:
        return True
    return any(_mentions_any(arg) for arg in typing.get_args(tp))


def _any_in_signatures(owner: type) -> list[str]:
    """``owner``'s methods and properties whose resolved annotations contain ``Any``."""
    found = []
    for name, member in vars(owner).items():
        fn = member.fget if isinstance(member, property) else member
        if isinstance(fn, staticmethod | classmethod):
            fn = fn.__func__
        if not inspect.isfunction(fn):
            continue
        hints = typing.get_type_hints(fn)
        found += [f"{owner.__qualname__}.{name}: {k}" for k, t in hints.items() if _mentions_any(t)]
    return found


def test_no_any_in_the_protocols_or_in_trainers_methods():
    owners = [
        protocols.PolicyLoss,
        protocols.CriticLoss,
        protocols.Trainable,
        protocols.Policy,
        protocols.Critic,
        Trainer,
    ]
    assert [f for owner in owners for f in _any_in_signatures(owner)] == []


def test_mypy_refuses_any_in_the_protocols_the_step_and_the_loop():
    """CI's ``mypy`` takes ``disallow_any_explicit`` for these modules (pyproject.toml)."""
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    strict: set[str] = set()
    for override in mypy.get("overrides", []):
        if override.get("disallow_any_explicit"):
            modules = override["module"]
            strict.update([modules] if isinstance(modules, str) else modules)
    want = {"protocols", "step", "loop"}
    assert {f"areal_agents.trainer.{m}" for m in want} <= strict


def test_the_steps_home_lists_the_path_of_a_batch_in_order():
    """The module docstring of ``step`` names each stop from the source to the optimizer, in
    order, and each name is a function (or method) that exists."""
    doc = step.__doc__ or ""
    stops = [
        "loop.Trainer._next_batch",
        "rollout.GroupSource.next_batch",
        "loop.Trainer._train_step",
        "batch.build_batch",
        "step.train_on_batch",
        "Policy.logprobs",
        "step.measure_mismatch",
        "Policy.ref_logprobs",
        "Critic.values",
        "batch.add_gae",
        "step.policy_updates",
        "batch.split_batch",
        "step.make_loss_fn",
        "step.apply_update",
        "Policy.train_step",
        "loss.policy_loss",
        "Policy.step_schedule",
        "Critic.train_step",
        "step.make_value_loss_fn",
        "loss.value_loss",
        "Critic.step_schedule",
        "step.record_train_tokens",
        "loop.Trainer._publish",
    ]
    at = [doc.find(f"``{s}``") for s in stops]
    assert all(i >= 0 for i in at), [s for s, i in zip(stops, at, strict=True) if i < 0]
    assert at == sorted(at), "the stops are listed out of order"
    for s in stops:
        head, *rest = s.split(".")
        obj: object = (
            getattr(protocols, head)
            if head in ("Policy", "Critic")
            else importlib.import_module(f"areal_agents.trainer.{head}")
        )
        for part in rest:
            obj = getattr(obj, part)
        assert callable(obj), s


def test_trainer_run_fits_on_one_screen():
    lines = inspect.getsource(Trainer.run).splitlines()
    assert len(lines) <= 50, f"Trainer.run has {len(lines)} lines"
