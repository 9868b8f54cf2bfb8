"""``RUN_DIR/run.json``: a training run's own account of its state.

The trainer writes it when the run starts, after every step and when the run ends; readers
(``areal-agent view``, the run tools of the command line) take a run's status from it and
from nothing else: never from a file's modification time, which any reader that opens the
run's store may change. Each write replaces the whole file atomically (a temporary file
renamed over it), so a reader sees the previous state or the next, never half of one.

Fields (docs/data-contract.md):

* ``pid``, ``host``: the trainer's process and the machine it runs on;
* ``status``: ``running`` | ``finished`` | ``failed`` | ``stopped``;
* ``reason``: why a run ended: ``steps_done`` (``train.steps`` reached), ``time_limit``
  (``train.time_limit_min``), ``stopped`` (Ctrl-C or SIGTERM), or ``failed: <error>``;
  ``null`` while running;
* ``phase``: what a running run does now: ``starting``, ``warm_start``, ``evaluating``,
  ``training``, ``exporting``;
* ``step``, ``target_steps``: steps done and ``train.steps``;
* ``started_at``, ``updated_at``, ``ended_at``: Unix times (``ended_at`` null while running).

A trainer killed with ``kill -9`` cannot say so: its file still says ``running``. Readers on
the same host check the pid (:meth:`RunState.effective_status`) and show such a run as
``failed`` with the reason ``process <pid> is gone``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "FILE",
    "REASONS",
    "STATUSES",
    "RunState",
    "RunStateWriter",
    "pid_alive",
    "read_run_state",
    "update_file",
]

FILE = "run.json"
STATUSES = ("running", "finished", "failed", "stopped")
REASONS = ("steps_done", "time_limit", "stopped", "failed")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:  # a zombie is a process that has ended and not been reaped
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class RunState:
    """One reading of ``run.json``."""

    pid: int
    host: str
    status: str
    reason: str | None = None
    phase: str | None = None
    step: int = 0
    target_steps: int | None = None
    started_at: float = 0.0
    updated_at: float = 0.0
    ended_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def effective(self) -> RunState:
        """This state as a reader should show it: a ``running`` run whose process is gone
        (on this host) is ``failed`` with the reason ``process <pid> is gone``."""
        mine = self.host == socket.gethostname()
        if self.status == "running" and mine and not pid_alive(self.pid):
            return replace(self, status="failed", reason=f"process {self.pid} is gone")
        return self

    @property
    def effective_status(self) -> str:
        return self.effective().status

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def read_run_state(run_dir: str | Path) -> RunState | None:
    """``run_dir/run.json`` as a :class:`RunState`, or None when the run has none (a run
    from before the file existed, or not a training run). A file that cannot be read as
    one is None too: readers fall back to what else the directory holds."""
    try:
        raw = json.loads((Path(run_dir) / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("status") not in STATUSES:
        return None
    pid, host = raw.get("pid"), raw.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return None

    def number(key: str) -> float | None:
        v = raw.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        return None

    def words(key: str) -> str | None:
        v = raw.get(key)
        return None if v is None else str(v)

    known = {f for f in RunState.__dataclass_fields__ if f != "extra"}
    return RunState(
        pid=int(pid),
        host=host,
        status=raw["status"],
        reason=words("reason"),
        phase=words("phase"),
        step=raw["step"] if _whole(raw.get("step")) else 0,
        target_steps=raw["target_steps"] if _whole(raw.get("target_steps")) else None,
        started_at=number("started_at") or 0.0,
        updated_at=number("updated_at") or 0.0,
        ended_at=number("ended_at"),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RunStateWriter:
    """Writes ``run.json`` for the run in ``run_dir`` (see the module docstring)."""

    def __init__(self, run_dir: str | Path, *, target_steps: int | None, step: int = 0) -> None:
        self.path = Path(run_dir) / FILE
        now = time.time()
        self.state = RunState(
            pid=os.getpid(),
            host=socket.gethostname(),
            status="running",
            phase="starting",
            step=step,
            target_steps=target_steps,
            started_at=now,
            updated_at=now,
        )
        _write(self.path, self.state)

    def update(self, **changes: Any) -> None:
        """Change fields of a running run (``phase``, ``step``) and write the file."""
        update_file(self.path.parent, **changes)

    def end(self, status: str, reason: str) -> None:
        """The run ended: ``status`` (finished / failed / stopped) and why. Only the first
        end counts (a failure while cleaning up after a stop does not overwrite it). What
        the training process wrote meanwhile (step, phase) is kept."""
        if status not in STATUSES or status == "running":
            raise ValueError(f"run status must be one of {STATUSES[1:]}, not {status!r}")
        current = read_run_state(self.path.parent) or self.state
        if current.status != "running":
            return
        now = time.time()
        self.state = replace(
            current, status=status, reason=reason, phase=None, updated_at=now, ended_at=now
        )
        _write(self.path, self.state)


def update_file(run_dir: str | Path, **changes: Any) -> None:
    """Change fields (``phase``, ``step``) of a running run's ``run.json`` in place. Used by
    the process that trains (rank 0 of a sharded run, which is not the process that started
    the file); nothing happens when the file is missing (a trainer built by a test or a
    program of its own, not through :func:`areal_agents.trainer.loop.train`) or the run has
    ended."""
    state = read_run_state(run_dir)
    if state is None or state.status != "running":
        return
    state = replace(state, **changes, updated_at=time.time())
    _write(Path(run_dir) / FILE, state)


def _write(path: Path, state: RunState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
