"""What every training config section is built on: value checks run when it is built.

``Checked`` is the mixin of every section of ``areal_agents.trainer.config.TrainConfig``: a
section lists its ``(field, holds, rule)`` checks and raises one ``ConfigError`` with every
problem when built directly. ``cores_ok`` and ``choice_problem`` are rules and messages that
sections and the loader (:mod:`areal_agents.trainer.config_io`) share; ``allowed_cores``
reads the loader's ``allowed[...]`` form of a core list.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

from areal_agents.errors import ConfigError

CORE_KEYS = (("rollout", "engine_cpus"), ("rollout", "idle_engine_cpus"), ("train", "cpus"))
"""The core lists a config file may write as ``allowed[...]`` (:func:`allowed_cores`)."""

SHARED_LAYOUT = (
    "scheduler=local rollout.engine_cpus=null rollout.idle_engine_cpus=null train.cpus=null"
)
"""The overrides that put the engine and the trainer in one process on the same cores."""

_ALLOWED = re.compile(r"allowed(?:\[(-?\d*)(:?)(-?\d*)\])?")


def cores_ok(cores: tuple[int, ...] | None) -> bool:
    """None, or a non-empty list of distinct core numbers >= 0."""
    if cores is None:
        return True
    ints = bool(cores) and all(isinstance(c, int) and not isinstance(c, bool) for c in cores)
    return ints and min(cores) >= 0 and len(set(cores)) == len(cores)


def allowed_cores(spec: str, where: str) -> tuple[int, ...]:
    """The cores that ``spec`` picks from those this process may run on
    (``os.sched_getaffinity(0)``, sorted): ``allowed`` (all of them), ``allowed[i]`` (the
    i-th, from 0; negative counts from the end) or ``allowed[i:j]`` (a Python slice).

    So a recipe says "the first core this process may use" instead of core 0, which a
    container or ``taskset`` may not give it.

    Raises:
        ConfigError: ``spec`` is not of that form, or picks no core (on a one-core machine
            the message names the overrides of the shared layout).
    """
    match = _ALLOWED.fullmatch(spec.strip())
    start, colon, stop = match.groups() if match else ("", "", "")
    if match is None or (match.group(0) != "allowed" and not colon and not start):
        raise ConfigError(
            f"{where}: expected a list of core numbers, or allowed / allowed[i] / "
            f"allowed[i:j] (positions among the cores this process may use), got {spec!r}"
        )
    getaffinity = getattr(os, "sched_getaffinity", None)
    allowed = sorted(getaffinity(0)) if getaffinity else list(range(os.cpu_count() or 1))
    if colon:
        picked = allowed[slice(int(start) if start else None, int(stop) if stop else None)]
    elif start:
        index = int(start)
        picked = [allowed[index]] if -len(allowed) <= index < len(allowed) else []
    else:
        picked = allowed
    if picked:
        return tuple(picked)
    if len(allowed) == 1:
        raise ConfigError(
            f"{where}: {spec!r} names no core: this process may use one core only "
            f"(core {allowed[0]}), and a layout with cores of their own for the engine and the "
            f"trainer needs two; run the shared layout instead: {SHARED_LAYOUT}"
        )
    raise ConfigError(
        f"{where}: {spec!r} names no core: this process may use {len(allowed)} cores "
        f"({allowed}, positions 0-{len(allowed) - 1}); pick among them, or run the shared "
        f"layout: {SHARED_LAYOUT}"
    )


class Checked:
    """Mixin: a section checks its values when built (all problems at once)."""

    def __post_init__(self) -> None:
        if problems := self._problems():
            raise ConfigError(f"invalid {type(self).__name__}", problems=problems)

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        """``(field, holds, rule)`` for each value check of this section."""
        return ()

    def _problems(self) -> list[str]:
        """This section's value problems, each as ``"field: what is wrong"``."""
        return [
            f"{n}: must be {r}, got {getattr(self, n)!r}" for n, ok, r in self._rules() if not ok
        ]


def choice_problem(where: str, value: Any, options: Sequence[Any]) -> str:
    """``where: expected one of ...``, with the nearest option as a hint."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: expected one of {', '.join(map(repr, options))}, got {value!r}{hint}"
