"""The limits of a sandboxed run, what it produced, and the error when it cannot run.

:class:`SandboxLimits` checks each limit and turns them into the child's configuration
(:meth:`~SandboxLimits.child_config`) and the child's status record into an error kind and its
``"Error: ..."`` message (:meth:`~SandboxLimits.describe`); :class:`SandboxResult` is what
:func:`areal_agents.tools.sandbox.run_python` returns. The isolation used when none is given
comes from ``$AREAL_SANDBOX_ISOLATION`` (:func:`default_isolation`).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from areal_agents.errors import UserError

__all__ = [
    "DETAIL_CHARS",
    "ERROR_KINDS",
    "ISOLATIONS",
    "ISOLATION_ENV",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "default_isolation",
]

ISOLATIONS = ("bwrap", "process")
"""``"bwrap"``: the bubblewrap sandbox (default); ``"process"``: the weaker in-process checks."""
ISOLATION_ENV = "AREAL_SANDBOX_ISOLATION"
"""The environment variable that sets the default isolation."""

_BWRAP_BASE_TASKS = 3  # bwrap's pid 1, the monitor and the runner, before the code forks
_THREAD_ALLOWANCE = 8  # RLIMIT_NPROC counts threads too
_SANDBOX_OVERHEAD_MB = 32  # bwrap and the child's monitor, in the memory cgroup
_FILES_PER_MB = 64  # files (inodes) allowed per MB of each tmpfs, at least _MIN_FILES
_MIN_FILES = 256
DETAIL_CHARS = 500
"""The most characters of a status record's detail (an exception's text, a path) kept."""
ERROR_KINDS = ("memory", "network", "write", "process", "program", "file_size", "disk",
               "exception", "exit")  # fmt: skip
"""The error kinds a status record may carry (``timeout`` and ``signal`` come from the
launcher)."""


def default_isolation() -> str:
    """The isolation used when none is given: ``$AREAL_SANDBOX_ISOLATION``, else ``"bwrap"``."""
    return os.environ.get(ISOLATION_ENV, "").strip() or "bwrap"


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run (see :func:`~areal_agents.tools.sandbox.run_python` for each
    field)."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_chars: int = 8000
    max_processes: int = 8
    max_file_mb: int = 64
    allow_subprocess: bool = False
    disk_mb: int = 128
    isolation: str = field(default_factory=default_isolation)

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number, got {self.timeout_s!r}")
        for name, low in (("memory_mb", 32), ("max_output_chars", 1), ("max_processes", 0),
                          ("max_file_mb", 1), ("disk_mb", 1)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"isolation: expected one of {', '.join(map(repr, ISOLATIONS))}, got "
                f"{self.isolation!r} (the default comes from ${ISOLATION_ENV})"
            )

    def child_config(self) -> dict[str, Any]:
        """What the child program needs to apply these limits."""
        nproc = None
        if self.isolation == "bwrap":
            # Counted per user namespace: only this sandbox's tasks (threads included).
            nproc = self.max_processes + _BWRAP_BASE_TASKS + _THREAD_ALLOWANCE
        elif self.allow_subprocess and os.getuid() != 0:  # root ignores RLIMIT_NPROC
            nproc = _count_user_processes() + self.max_processes + 8
        return {
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_bytes": self.max_file_mb * 1024 * 1024,
            "cpu_s": self.cpu_s,
            "max_processes": self.max_processes,
            "allow_subprocess": self.allow_subprocess,
            "nproc": nproc,
        }

    @property
    def cgroup_bytes(self) -> int:
        """The memory cgroup's limit: the whole sandbox, all processes together.

        ``memory_mb`` for the code, ``disk_mb`` for each of its two tmpfs (their files are
        memory too) and a fixed allowance for bubblewrap and the child's monitor.
        """
        return (self.memory_mb + 2 * self.disk_mb + _SANDBOX_OVERHEAD_MB) * 1024 * 1024

    @property
    def max_files(self) -> int:
        """How many files (inodes) each tmpfs holds: 64 per MB of ``disk_mb``, at least 256."""
        return max(_MIN_FILES, self.disk_mb * _FILES_PER_MB)

    @property
    def cpu_s(self) -> int:
        """The CPU-time limit of each process (``RLIMIT_CPU``), a backstop to the wall time."""
        return math.ceil(self.timeout_s) + 1

    def describe(
        self, rec: dict[str, Any] | None, returncode: int | None
    ) -> tuple[str | None, str]:
        """Map the child's status record and exit status to (error kind, message)."""
        kind = rec.get("kind") if rec else None
        detail = str(rec.get("detail", ""))[:DETAIL_CHARS] if rec else ""
        messages = {
            "memory": f"Error: memory limit of {self.memory_mb} MB exceeded",
            "network": "Error: network access is disabled in the sandbox",
            "write": f"Error: writing outside the sandbox directory is not allowed: {detail}",
            "process": f"Error: process limit reached (at most {self.max_processes} processes)",
            "program": "Error: running other programs is disabled in the sandbox "
            "(subprocess, os.system, os.exec*)",
            "file_size": f"Error: file size limit of {self.max_file_mb} MB exceeded",
            "disk": f"Error: disk quota of {self.max_files} files exceeded"
            if detail == "files"
            else f"Error: disk quota of {self.disk_mb} MB exceeded",
            "exception": f"Error: {detail}",
            "exit": f"Error: the code exited with status {detail}",
        }
        if kind in messages:
            return kind, messages[kind]
        if returncode is not None and returncode < 0:
            if -returncode == signal.SIGXCPU:
                return "timeout", f"Error: CPU time limit of {self.cpu_s} s exceeded"
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = str(-returncode)
            return "signal", f"Error: the process was killed by signal {name}"
        if returncode:
            return "exit", f"Error: the code exited with status {returncode}"
        return None, ""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced.

    Attributes:
        stdout: captured standard output (cut at ``max_output_chars``, with a marker).
        stderr: captured standard error, tracebacks included (cut the same way).
        exit_code: the process's exit status; ``None`` when it was killed.
        error: ``None`` on success, else the failure kind (``"timeout"``, ``"memory"``,
            ``"network"``, ``"write"``, ``"process"``, ``"program"``, ``"file_size"``,
            ``"disk"``, ``"exception"``, ``"exit"``, ``"signal"``).
        message: the one-line ``"Error: ..."`` message for ``error``; ``""`` on success.
        duration_s: wall time of the run.
        truncated: whether stdout or stderr was cut.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    message: str
    duration_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit status 0."""
        return self.error is None

    def to_text(self) -> str:
        """The text a model reads: the error message (if any) followed by the output."""
        output = self.stdout
        if self.stderr:
            output += ("\n" if output and not output.endswith("\n") else "") + self.stderr
        if self.ok:
            return output if output else "(no output)"
        return self.message + ("\n" + output if output else "")


class SandboxUnavailableError(UserError):
    """The requested isolation cannot run on this machine; the message names the fix."""


def _count_user_processes() -> int:
    """How many processes this user runs (``RLIMIT_NPROC`` counts them all)."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/status", encoding="utf-8") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
            count += int(uid_line.split()[1]) == uid
    return count
