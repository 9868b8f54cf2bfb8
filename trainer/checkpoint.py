"""Run state, checkpoints and the ledger of consumed groups.

A checkpoint directory ``checkpoints/step-NNNNNN`` holds the policy (and critic) weights with
their optimizer state, ``state.json`` (:class:`RunState`) and the RNG states. It is written
under a ``.tmp`` name and renamed, so it is complete or absent; ``checkpoints/latest`` names
the newest. ``groups.jsonl`` (the ledger) gets one line per consumed group (its sessions, trained
completion ids and rewards); on resume the
lines past the restored step are dropped, so a group consumed after the checkpoint is
consumed again, once.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class RunState:
    """What a checkpoint must remember besides the weights and the optimizer."""

    step: int = 0
    next_group: int = 0
    """The next new group number (group g resets its env with seed ``seed_base + g``)."""
    consumed_groups: list[int] = field(default_factory=list)
    skipped_groups: list[int] = field(default_factory=list)
    """Groups rejected (too few usable episodes, or uniform rewards under dynamic sampling)."""
    episodes_consumed: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """Wall-clock seconds of the run so far (warm start included), summed over resumes."""

    def unfinished_groups(self) -> list[int]:
        """Groups started before the checkpoint but neither consumed nor skipped: a resumed
        run generates them again, in order."""
        done = set(self.consumed_groups) | set(self.skipped_groups)
        return [g for g in range(self.next_group) if g not in done]


def save_checkpoint(out: Path, state: RunState, policy: Any, critic: Any = None) -> Path:
    """Write checkpoint ``step-{state.step}`` atomically and point ``latest`` at it."""
    d = out / "checkpoints" / f"step-{state.step:06d}"
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
    if critic is not None:
        critic.save(tmp / "critic")
    (tmp / "state.json").write_text(json.dumps(state.__dict__))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)  # a checkpoint directory is complete or absent
    (out / "checkpoints" / "latest").write_text(d.name)
    return d


def restore_checkpoint(out: Path, policy: Any, critic: Any = None) -> RunState | None:
    """Load the latest checkpoint of ``out`` into ``policy`` (and ``critic``) and the RNGs;
    None when there is none. The ledger is cut back to the restored step."""
    latest = out / "checkpoints" / "latest"
    if not latest.exists():
        return None
    d = out / "checkpoints" / latest.read_text().strip()
    policy.load(d)
    if critic is not None:
        critic.load(d / "critic")
    state = RunState(**json.loads((d / "state.json").read_text()))
    rng = torch.load(d / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    _truncate_ledger(out / "groups.jsonl", state.step)
    return state


def append_ledger(
    out: Path,
    step: int,
    groups: Sequence[tuple[int, list[Any]]],
    trained_agents: Sequence[str] = (),
) -> None:
    """One ledger line per group consumed by ``step``: its number, episode count, the
    episodes' session ids and the ids of the completions trained on (so a run can be
    audited against what its agents recorded: nothing lost, nothing trained twice); with
    ``trained_agents`` (``agent.train``) the other agents' completions are listed apart,
    as ``masked``."""
    keep = set(trained_agents)
    with (out / "groups.jsonl").open("a") as f:
        for g, eps in groups:
            calls = [c for r in eps for c in r.episode.completions]
            row = {
                "step": step,
                "group": g,
                "episodes": len(eps),
                "sessions": [r.episode.session_id for r in eps],
                "completions": [c.id for c in calls if not keep or c.agent in keep],
                "rewards": [r.reward for r in eps],
            }
            if keep:
                row["masked"] = [c.id for c in calls if c.agent not in keep]
            f.write(json.dumps(row) + "\n")


def _truncate_ledger(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))
