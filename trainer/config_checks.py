"""What every training config section is built on: value checks run when it is built.

``Checked`` is the mixin of every section of ``areal_agents.trainer.config.TrainConfig``: a
section lists its ``(field, holds, rule)`` checks and raises one ``ConfigError`` with every
problem when built directly. ``cores_ok`` and ``choice_problem`` are rules and messages that
sections and the loader (:mod:`areal_agents.trainer.config_io`) share.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from areal_agents.errors import ConfigError


def cores_ok(cores: tuple[int, ...] | None) -> bool:
    """None, or a non-empty list of distinct core numbers >= 0."""
    return cores is None or (bool(cores) and min(cores) >= 0 and len(set(cores)) == len(cores))


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
