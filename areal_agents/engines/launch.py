"""Starting and stopping an inference server in a child process (vLLM, SGLang).

:class:`ServerProcess` runs a command in its own process group with its output captured to
a log file, waits until ``GET <url>/health`` answers 200, and stops the whole group on
:meth:`~ServerProcess.stop` (SIGTERM, then SIGKILL after a grace period) or at interpreter
exit. When the server exits or misses its start deadline, the error carries the tail of its
log, so the reason (a bad flag, an out-of-memory kill, a missing package) is on screen.

Example::

    server = ServerProcess.start(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", "8001"],
        url="http://127.0.0.1:8001", log_path="vllm.log", timeout_s=600,
    )
    ...
    server.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from areal_agents.errors import BackendError, UserError

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class Server(Protocol):
    """What a server engine needs of its server's process: :class:`ServerProcess` here, or
    ``areal_agents.rollout.ray_servers.RayServer`` on a Ray node."""

    log_path: Any

    @property
    def running(self) -> bool: ...

    @property
    def exit_code(self) -> int | None: ...

    def restart(self, timeout_s: float = 600.0) -> None: ...

    def tail(self, lines: int = 40) -> str: ...

    def stop(self, grace_s: float = 20.0) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    """A server subprocess in its own process group, with its log in a file."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        url: str,
        log_path: Path,
        name: str,
        argv: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
    ):
        self.popen = popen
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})
        self.cpus = list(cpus) if cpus else None
        self.starts = 1
        """How many times the process was started (1 + restarts)."""
        _LIVE.add(self)

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        url: str,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        name: str = "server",
        cpus: Sequence[int] | None = None,
    ) -> ServerProcess:
        """Run ``argv`` and wait until ``url``/health answers 200.

        ``env`` entries are added to this process's environment; ``cpus`` restricts the
        process (and every process it starts) to those cores. Raises :class:`BackendError`
        (with the log tail) when the process exits or does not become healthy within
        ``timeout_s``; the process group is stopped in both cases.
        """
        if log_path is None:
            fd, raw = tempfile.mkstemp(prefix=f"areal-{name}-", suffix=".log")
            os.close(fd)
            log_path = raw
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        popen = _spawn(argv, path, env, cpus, name, append=False)
        server = cls(popen, url, path, name, argv, env, cpus)
        try:
            server._wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def restart(self, timeout_s: float = 600.0) -> None:
        """Stop the process group (whatever is left of it) and start the same command again,
        appending to the same log; returns once it is healthy (:class:`BackendError` with
        the log tail otherwise)."""
        self.stop(grace_s=5.0)
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- restarted by areal-agents (start {self.starts + 1}) ---\n".encode())
        self.popen = _spawn(self.argv, self.log_path, self.env, self.cpus, self.name, append=True)
        self.starts += 1
        _LIVE.add(self)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.popen.poll()
                if code is not None:
                    raise BackendError(
                        f"the {self.name} exited with code {code} before it became healthy; "
                        f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise BackendError(
                        f"the {self.name} did not answer {self.url}/health within "
                        f"{timeout_s:.0f} s (raise the start timeout if it is still compiling); "
                        f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The process's exit status (None while it runs; negative: killed by that signal)."""
        return self.popen.poll()

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server and every process it started (SIGTERM, then SIGKILL)."""
        _LIVE.discard(self)
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=grace_s)
        # Children outlive a leader that was killed (vLLM's engine process holds the port
        # and the log): the whole group goes, whatever the leader's state.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def _spawn(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None,
    cpus: Sequence[int] | None,
    name: str,
    *,
    append: bool,
) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, **(env or {})}
    cores = set(cpus) if cpus else None

    def place() -> None:  # in the child, before exec: its children inherit the cores
        if cores is not None:
            os.sched_setaffinity(0, cores)

    if not append:
        log_path.write_bytes(b"")
    try:
        # append mode for every writer: a child of an earlier start that is still shutting
        # down must not write over what the new one logs
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,  # its own process group: stop() ends its children
                preexec_fn=place if cores is not None else None,
            )
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"cannot start the {name} ({argv[0]}): {exc}") from None


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


def local_url(host: str, port: int) -> str:
    """``http://host:port``, choosing a free port when ``port`` is 0."""
    if not port:
        port = free_port(host)
    return f"http://{host}:{port}"


def find_server_python(
    explicit: str | None, *, module: str, env_var: str, venv: str, how: str
) -> str:
    """The Python interpreter of a server's own environment.

    In order: ``explicit``, ``$env_var``, ``<venv>/bin/python`` in the working directory or
    beside this package, this interpreter if it can import ``module``. A given interpreter
    that cannot import ``module`` is an error; so is finding none (``how`` says how to
    build one).
    """
    for given in (explicit, os.environ.get(env_var)):
        if given:
            if not _can_import(given, module):
                raise UserError(f"{given} is not a Python that can import {module}; {how}")
            return given
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / venv / "bin" / "python"
        if candidate.exists() and _can_import(str(candidate), module):
            return str(candidate)
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    raise UserError(
        f"no Python with {module} found: {how}; then pass --engine-python {venv}/bin/python "
        f"or set {env_var}"
    )


def _can_import(python: str, module: str) -> bool:
    if not (Path(python).exists() or shutil.which(python)):
        return False
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([python, "-c", check], timeout=60, capture_output=True)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
