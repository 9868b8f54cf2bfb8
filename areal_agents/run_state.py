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

Two more files of the run directory belong with it:

* ``RUN_DIR/stop``: a request to stop (``areal-agent stop``; :func:`request_stop`). The
  trainer looks for it before each step; when it is there, the run checkpoints and ends as
  ``stopped``. A new start of the run (``--resume``) removes it.
* ``RUN_DIR/train.log``: what the run printed on the terminal (its progress lines and its
  log records, :func:`run_log`), appended by each start of the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from areal_agents.errors import ArealError, ConfigError

__all__ = [
    "FILE",
    "LOG_FILE",
    "REASONS",
    "STATUSES",
    "STOP_FILE",
    "RunState",
    "RunStateWriter",
    "claim_run_dir",
    "clear_stop_request",
    "find_run_dir",
    "pid_alive",
    "read_run_state",
    "read_stop_request",
    "request_stop",
    "run_log",
    "update_file",
]

log = logging.getLogger(__name__)

FILE = "run.json"
STOP_FILE = "stop"
LOG_FILE = "train.log"
STATUSES = ("running", "finished", "failed", "stopped")
REASONS = ("steps_done", "time_limit", "stopped", "failed")


def claim_run_dir(path: str | Path, *, resume: bool, if_exists: str = "refuse") -> Path:
    """The directory a run of ``train.output_dir`` = ``path`` writes to. A resume, or a
    directory without checkpoints, is ``path`` itself. Otherwise ``if_exists="refuse"`` is a
    ``ConfigError`` naming the two ways on, and ``"new"`` the first of ``path-2``,
    ``path-3``, ... that holds no run (neither checkpoints nor a ``run.json``)."""
    out = Path(path)
    if resume or not (out / "checkpoints").exists():
        return out
    if if_exists == "new":
        n = 2
        while _holds_run(Path(f"{out}-{n}")):
            n += 1
        return Path(f"{out}-{n}")
    raise ConfigError(
        f"{out} already holds a run; pass --resume to continue it, set train.output_dir to a "
        "new directory, or train.if_exists=new to write to the next free one"
    )


def _holds_run(path: Path) -> bool:
    return (path / "checkpoints").exists() or (path / FILE).exists()


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
        log.info("run %s (%s) at step %d", status, reason, self.state.step)


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


# ---------------------------------------------------------------------------- finding a run
def find_run_dir(spec: str | Path, runs_dir: str | Path = "runs") -> Path:
    """The run directory ``spec`` names: a path, else a run of ``runs_dir`` by its name
    (``quickstart`` for ``runs/quickstart``). A ConfigError naming the fix when neither is
    a directory."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    named = Path(runs_dir) / str(spec)
    bare = len(path.parts) == 1  # a name, not a path
    if bare and named.is_dir():
        return named
    also = f" (nor {named})" if bare else ""
    raise ConfigError(
        f"no run directory {str(spec)!r}{also}; `areal-agent runs [DIR]` lists the runs"
    )


# ---------------------------------------------------------------------------- stop requests
def request_stop(run_dir: str | Path) -> None:
    """Ask the run in ``run_dir`` to stop before its next step: ``RUN_DIR/stop``, a JSON
    object ``{requested_at, pid, host}`` of the process that asked."""
    body = {"requested_at": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
    path = Path(run_dir) / STOP_FILE
    tmp = path.with_name(f".{STOP_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_stop_request(run_dir: str | Path) -> dict[str, Any] | None:
    """The stop request of the run in ``run_dir`` (see :func:`request_stop`; ``{}`` when
    its file cannot be read as one: it still counts), or None when there is none."""
    path = Path(run_dir) / STOP_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {} if path.exists() else None
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def clear_stop_request(run_dir: str | Path) -> None:
    """Remove the run's stop request (a new start of the run: it was for the one before)."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- the run's log
_LOGGING: set[Path] = set()  # the train.log files run_log writes now (it nests as a no-op)


class _LogFile:
    """``train.log``, written from several threads and streams. Progress bars, which
    redraw their line (a carriage return, a cursor-up escape), become one line per redraw
    here; a bar's erasing of itself (blanks) is left out. A failed write (a full disk) ends
    the copying, never the run."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()
        self._line_start = True

    def write(self, text: str) -> int:
        with self._lock:
            for i, part in enumerate(text.replace("\x1b[A", "").split("\r")):
                if i > 0 and not self._line_start:  # a redraw: the line so far is done
                    self._emit("\n")
                if i == 0 or part.strip():
                    self._emit(part)
        return len(text)

    def _emit(self, text: str) -> None:
        if not text or self._file.closed:
            return
        try:
            self._file.write(text)
        except (OSError, ValueError):
            self._file.close()
        self._line_start = text.endswith("\n")

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                with contextlib.suppress(OSError, ValueError):
                    self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Tee:
    """A text stream that writes to ``terminal`` and to the log; everything else (isatty,
    fileno, encoding) is the terminal's."""

    def __init__(self, terminal: TextIO, log: _LogFile) -> None:
        self._terminal, self._log = terminal, log

    def write(self, text: str) -> int:
        self._terminal.write(text)
        self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._terminal.flush()
        self._log.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._terminal, name)


@contextlib.contextmanager
def run_log(run_dir: str | Path) -> Iterator[None]:
    """Copy what this process prints (``sys.stdout``, ``sys.stderr``: the progress lines)
    and its log records (``areal_agents`` from INFO, everything else from WARNING) to
    ``RUN_DIR/train.log`` while the block runs, as well as to the terminal. Each start
    appends a header line; an error that ends the block is written with its traceback.
    Nested for the same directory, the inner one does nothing."""
    path = (Path(run_dir) / LOG_FILE).resolve()
    if path in _LOGGING:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    log_file = _LogFile(path)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    log_file.write(f"--- {started} pid {os.getpid()} on {socket.gethostname()}: ")
    log_file.write(f"{_command_line()}\n")
    out, err = sys.stdout, sys.stderr
    root, ours = logging.getLogger(), logging.getLogger("areal_agents")
    to_file = logging.StreamHandler(log_file)  # type: ignore[arg-type]
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [to_file]
    if not root.handlers:  # what logging's last resort did: warnings on the terminal
        terminal = logging.StreamHandler(err)
        terminal.setLevel(logging.WARNING)
        handlers.append(terminal)
    level = ours.level
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    for h in handlers:
        root.addHandler(h)
    tee_out, tee_err = _Tee(out, log_file), _Tee(err, log_file)
    sys.stdout, sys.stderr = tee_out, tee_err  # type: ignore[assignment]
    _LOGGING.add(path)
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        log_file.write(f"--- ended by {type(exc).__name__}\n")
        raise
    except ArealError as exc:  # the command line prints it, without a traceback
        log_file.write(f"error: {exc}\n")
        raise
    except BaseException:
        log_file.write(traceback.format_exc())
        raise
    finally:
        _LOGGING.discard(path)
        if sys.stdout is tee_out:
            sys.stdout = out
        if sys.stderr is tee_err:
            sys.stderr = err
        for h in handlers:
            root.removeHandler(h)
        ours.setLevel(level)
        log_file.close()


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("main.py", "__main__.py")):
        argv[0] = "areal-agent"
    return " ".join(argv)
