"""Run untrusted Python code in a separate, limited process.

``run_python`` runs ``sys.executable -I`` inside a bubblewrap (``bwrap``) sandbox, feeds it
the code on stdin and returns a :class:`SandboxResult`. Every failure mode ends with a
specific message a model can read:

=================  =====================================================================
kind               message
=================  =====================================================================
``timeout``        ``Error: timed out after 2.0 s``
``memory``         ``Error: memory limit of 256 MB exceeded``
``network``        ``Error: network access is disabled in the sandbox``
``write``          ``Error: writing outside the sandbox directory is not allowed: /etc/x``
``process``        ``Error: process limit reached (at most 4 processes)``
``program``        ``Error: running other programs is disabled in the sandbox``
``file_size``      ``Error: file size limit of 64 MB exceeded``
``disk``           ``Error: disk quota of 128 MB exceeded`` (or ``of 8192 files``)
``exception``      ``Error: ZeroDivisionError: division by zero`` (traceback in stderr)
``exit``           ``Error: the code exited with status 3``
``signal``         ``Error: the process was killed by signal SIGSEGV``
=================  =====================================================================

Isolation ``"bwrap"`` (the default) is the security boundary. The code runs as an
unprivileged user on the host: as uid 65534 (``nobody``) when the caller is root, with
privileges dropped by ``setpriv`` before bwrap starts, else as the calling user. bwrap gives
it fresh user, mount, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all
--unshare-user --disable-userns --new-session --die-with-parent``); the code cannot create
further user namespaces. How each limit is enforced:

- **files**: the root is an empty read-only tmpfs holding only read-only binds of ``/usr``
  (with the host's ``/bin``, ``/lib*`` links), ``/etc/ld.so.cache``, ``/etc/localtime`` and
  the Python installation (``sys.base_prefix`` and the virtualenv, if any); no home
  directory, no project files, no ``/etc/passwd`` or ``/etc/shadow``. ``/proc`` belongs to
  the new PID namespace, so no other process is visible. Python directories the sandbox user
  cannot reach (``/root/.pyenv``) are bound from mount points in a private mount namespace
  of the launcher, never in the caller's.
- **disk**: the working directory ``/sandbox`` (also ``HOME`` and ``TMPDIR``) and
  ``/dev/shm`` are tmpfs of ``disk_mb`` each, gone with the sandbox; ``RLIMIT_FSIZE`` bounds
  any one file. As root, the launcher mounts them itself (``size=``, ``nr_inodes=``) in its
  private mount namespace, so each also holds at most 64 files per MB (at least 256): an
  empty file costs a kernel inode. Otherwise bwrap's tmpfs (bytes only) are used.
- **network**: an empty network namespace (only its own loopback); no host socket, Unix
  sockets included, is reachable, since nothing of the host's ``/run`` or ``/tmp`` is bound.
- **time**: the parent waits ``timeout_s`` and kills bwrap, which takes the whole PID
  namespace with it; ``RLIMIT_CPU`` backs it up. A daemon (``setsid``, double fork) dies
  with the sandbox too.
- **memory**: ``RLIMIT_AS`` in each process; Python raises ``MemoryError``. Where this
  process can create a memory cgroup (root with the cgroup v1 memory controller mounted
  read-write, or a cgroup v2 subtree with the memory controller), each run gets its own,
  joined by the launcher before bwrap starts and removed after the run: it bounds the
  sandbox as a whole, all processes, shared memory, tmpfs files and kernel memory together,
  at ``memory_mb + 2 * disk_mb + 32`` MB (the tmpfs and bwrap's own processes); a process
  the kernel kills there is reported as ``memory``. The seccomp filter (below) refuses
  ``memfd_create``, ``memfd_secret`` and SysV ``shmget``: memory no process maps, which
  ``RLIMIT_AS`` does not count. Without a cgroup (a warning is logged once) memory is
  bounded per process only: the sum over ``max_processes`` forks and kernel buffers (pipes,
  sockets) are not bounded.
- **other processes**: a seccomp filter (``bwrap --seccomp``, built in
  :mod:`areal_agents.tools.sandbox_seccomp`) refuses ``ptrace``, ``process_vm_readv``,
  ``process_vm_writev`` and ``pidfd_getfd``, so no process of the sandbox can read or take
  over another, bwrap's pid 1 included; and every system call of another ABI.
- **status**: the child is two processes. Its monitor holds the pipe the status record
  travels on, runs none of the code, and is not dumpable (no other process may open its
  ``/proc/PID/fd`` or ``mem``); the runner, its fork, closes that pipe before the code runs
  and tells the monitor how the code ended over a pipe of its own. The monitor believes that
  report only where it matches the runner's exit status (a run that exits 0 succeeded) and
  writes one record, of a known kind, with at most 500 characters of detail.
- **processes**: ``RLIMIT_NPROC`` (counted per user namespace, so per sandbox) caps the
  tasks alive at once at ``max_processes`` plus a few (bwrap itself, the monitor, threads).
- **output**: stdout and stderr are read as they come and cut at ``max_output_chars``
  with a marker; the rest is drained and dropped.

An audit hook (``sys.addaudithook``) in the child also refuses sockets, writes outside the
working directory, running programs and forks beyond ``max_processes`` in all, to give the
precise messages above; code can switch it off (it is plain Python), and no guarantee rests
on it. The child gets a minimal environment: no variable of the parent (API keys included)
reaches it.

Isolation ``"process"`` (``isolation="process"`` or ``AREAL_SANDBOX_ISOLATION=process``)
is the weaker fallback where bubblewrap cannot run: the same child, as the calling user,
on the host filesystem, in a host temporary directory, in a new process group and, where
``unshare`` allows it, in fresh network and PID namespaces. Only the resource limits and
those namespaces are enforced by the kernel; the audit hook is all that stands between the
code and the caller's files, programs and sockets, and it is bypassed by changing the
hook's globals, ``os.open(..., dir_fd=...)``, ``_posixsubprocess``, ``ctypes`` or ``setns``.
It does not protect: reading any file the caller can read (other processes'
``/proc/*/environ``, ``/etc/shadow`` as root), writing anywhere the caller can, running
programs (as root, if the caller is), host Unix sockets, the process limit (root ignores
``RLIMIT_NPROC``), a disk quota, memory as a whole (no cgroup, no seccomp filter: memfds,
SysV segments, many forks), ``ptrace`` of the code's own processes, the monitor's status
pipe as root, and, without namespaces, daemons that outlive the call.

Without bubblewrap (or where it cannot create user namespaces) ``"bwrap"`` refuses to start
with :class:`SandboxUnavailableError`; install it with ``apt-get install -y bubblewrap``.

This module starts the child and supervises it, and makes the ``python`` tool. The limits,
the result and its messages are in :mod:`areal_agents.tools.sandbox_limits`, the bubblewrap
command and :func:`check_sandbox` in :mod:`areal_agents.tools.sandbox_bwrap` (the memory
cgroup in :mod:`areal_agents.tools.sandbox_cgroup`, the seccomp filter in
:mod:`areal_agents.tools.sandbox_seccomp`), and the program the child runs (monitor, limits,
audit hook, the code) in :mod:`areal_agents.tools.sandbox_child`.

Example::

    >>> result = run_python_sync("print(6 * 7)")
    >>> result.ok, result.stdout
    (True, '42\\n')
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from areal_agents.tools.sandbox_bwrap import (
    BWRAP_WORK_DIR,
    SANDBOX_PATH,
    SANDBOX_UID,
    BwrapLaunch,
    bwrap_launch,
    check_sandbox,
    sandbox_verified,
    setup_error,
    setup_failure,
)
from areal_agents.tools.sandbox_child import CHILD_SOURCE
from areal_agents.tools.sandbox_limits import (
    DETAIL_CHARS,
    ERROR_KINDS,
    ISOLATION_ENV,
    ISOLATIONS,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    default_isolation,
)
from areal_agents.tools.tool import Tool, ToolResult, function_tool

__all__ = [
    "ISOLATIONS",
    "ISOLATION_ENV",
    "SANDBOX_UID",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "check_sandbox",
    "default_isolation",
    "make_python_tool",
    "python_tool",
    "run_python",
    "run_python_sync",
]

_STATUS_CAP = 65536  # bytes of status records kept
_KILL_GRACE_S = 2.0  # how long to wait for pipes to close once the process group is dead


class _CappedReader:
    """Reads a stream to its end, keeping at most ``cap_bytes`` and counting the rest."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.data = bytearray()
        self.total = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            room = self.cap_bytes - len(self.data)
            if room > 0:
                self.data += chunk[:room]

    def text(self, max_chars: int) -> tuple[str, bool]:
        text = self.data.decode("utf-8", errors="replace")
        if len(text) <= max_chars and self.total <= len(self.data):
            return text, False
        return text[:max_chars] + f"\n[output truncated after {max_chars} characters]", True


# ---------------------------------------------------------------------------- running


@functools.cache
def _namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that gives the child no network and its own PID namespace.

    Tried once per process: as root plain namespaces work; without privileges a user
    namespace is needed. Returns ``()`` where neither works (the audit hook still applies).
    """
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    base = ["--net", "--pid", "--fork", "--kill-child"]
    for prefix in ([exe, *base], [exe, "--user", "--map-root-user", *base]):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return tuple(prefix)
    return ()


def _child_env(work: str, path: str) -> dict[str, str]:
    """A minimal environment: nothing of the parent's (secrets) leaks into the child."""
    env = {"HOME": work, "TMPDIR": work, "TMP": work, "TEMP": work, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}  # fmt: skip
    env["PATH"] = path
    return env


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _parse_status(data: bytes) -> dict[str, Any] | None:
    """The child's status record (its monitor writes exactly one), checked and bounded."""
    for line in data.decode("utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if not isinstance(rec, dict):
                continue
            kind, detail, returncode = rec.get("kind"), rec.get("detail"), rec.get("returncode")
            if (
                (kind is None or kind in ERROR_KINDS)
                and isinstance(detail, str)
                and (type(returncode) is int)
            ):
                return {"kind": kind, "detail": detail[:DETAIL_CHARS], "returncode": returncode}
    return None


async def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_output_chars: int = 8000,
    max_processes: int = 8,
    max_file_mb: int = 64,
    allow_subprocess: bool = False,
    disk_mb: int = 128,
    isolation: str | None = None,
    use_namespaces: bool | None = None,
) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed Python process and capture what it printed.

    Args:
        code: Python source, run as ``__main__`` in a private temporary directory.
        timeout_s: wall-time limit; the sandbox is killed after it.
        memory_mb: address-space limit of each process (``RLIMIT_AS``) and, where a
            memory cgroup can be made (``"bwrap"`` only), of the whole sandbox (plus twice
            ``disk_mb`` for its tmpfs and 32 MB for bwrap and the monitor).
        max_output_chars: stdout and stderr are each cut after this many characters.
        max_processes: how many processes the code may start in all (forks included).
        max_file_mb: the largest file the code may write.
        allow_subprocess: allow starting other programs (they escape the audit hook;
            only the sandbox and the kernel-level limits apply to them).
        disk_mb: the size of the private directory (and of ``/dev/shm``), ``"bwrap"`` only;
            as root each also holds at most 64 files per MB (at least 256).
        isolation: ``"bwrap"`` (bubblewrap, unprivileged user, the security boundary) or
            ``"process"`` (the weaker in-process checks, see the module docstring);
            ``None`` reads ``$AREAL_SANDBOX_ISOLATION``, defaulting to ``"bwrap"``.
        use_namespaces: ``"process"`` only: run in fresh network and PID namespaces through
            ``unshare``; ``None`` uses them when the system allows it.

    Returns:
        A :class:`SandboxResult`; failures of the code are reported in it, never raised.

    Raises:
        TypeError, ValueError: a limit or ``code`` has the wrong type or value.
        SandboxUnavailableError: ``"bwrap"`` cannot run here (the message names the fix).
    """
    if not isinstance(code, str):
        raise TypeError(f"code: expected str, got {type(code).__name__}")
    limits = SandboxLimits(
        timeout_s, memory_mb, max_output_chars, max_processes, max_file_mb, allow_subprocess,
        disk_mb, isolation or default_isolation(),
    )  # fmt: skip
    root: str | None = None
    launch: BwrapLaunch | None = None
    if limits.isolation == "bwrap":
        if use_namespaces is not None:
            raise ValueError(
                "use_namespaces applies to isolation='process' only (bwrap always runs the "
                "code in fresh namespaces)"
            )
        if not sandbox_verified():
            await asyncio.to_thread(check_sandbox, "bwrap")
        launch = bwrap_launch(limits)
        prefix, work, path = launch.prefix, BWRAP_WORK_DIR, SANDBOX_PATH
        pass_fds = launch.pass_fds
    else:
        prefix = list(_namespace_prefix()) if use_namespaces in (None, True) else []
        if use_namespaces and not prefix:
            raise ValueError("use_namespaces=True but `unshare` cannot create namespaces here")
        root = tempfile.mkdtemp(prefix="areal-sandbox-")
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        path = os.environ.get("PATH", SANDBOX_PATH)
        pass_fds = ()
    try:
        status_r, status_w = os.pipe()
    except BaseException:
        if launch is not None:
            await launch.acleanup()
        raise
    start = time.monotonic()
    proc: asyncio.subprocess.Process | None = None
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                *prefix,
                sys.executable,
                "-I",
                "-u",
                "-B",
                "-c",
                CHILD_SOURCE,
                work,
                str(status_w),
                json.dumps(limits.child_config()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_child_env(work, path),
                cwd=work if root is not None else "/",
                start_new_session=True,
                pass_fds=(status_w, *pass_fds),
            )
        finally:
            os.close(status_w)
            if launch is not None:
                launch.close_fds()
        return await _supervise(proc, code, start, status_r, limits, launch)
    finally:  # also on cancellation: nothing outlives the call
        if proc is not None:
            _kill_group(proc.pid)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        with contextlib.suppress(OSError):
            os.close(status_r)  # already closed (by its transport) once supervised
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        if launch is not None:
            await launch.acleanup()


async def _exit_status(proc: asyncio.subprocess.Process) -> int:
    """The exit status of ``proc`` as soon as it exits.

    ``proc.wait()`` also waits for the stdout/stderr pipes to close, which a leftover fork
    can hold open; the return code is set as soon as the process is reaped.
    """
    delay = 0.002
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
    return proc.returncode


async def _pipe_stream(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """An asyncio stream reading the pipe ``fd`` (which the transport then owns)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader, transport


async def _supervise(
    proc: asyncio.subprocess.Process,
    code: str,
    start: float,
    status_fd: int,
    limits: SandboxLimits,
    launch: BwrapLaunch | None,
) -> SandboxResult:
    """Feed the code, wait up to the time limit, kill the group, collect the result."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stdin = proc.stdin
    cap = limits.max_output_chars * 4 + 4
    out, err, status = _CappedReader(cap), _CappedReader(cap), _CappedReader(_STATUS_CAP)
    status_stream, status_transport = await _pipe_stream(status_fd)
    readers = asyncio.gather(
        out.read(proc.stdout), err.read(proc.stderr), status.read(status_stream)
    )

    async def feed_and_wait() -> int:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(code.encode("utf-8", errors="surrogateescape"))
            await stdin.drain()
            stdin.close()
        return await _exit_status(proc)

    timed_out = False
    try:
        remaining = max(0.0, limits.timeout_s - (time.monotonic() - start))
        try:
            await asyncio.wait_for(feed_and_wait(), remaining)
        except TimeoutError:
            timed_out = True
        _kill_group(proc.pid)
        returncode = await _exit_status(proc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(readers), _KILL_GRACE_S)
    finally:
        readers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await readers
        status_transport.close()
    error: str | None
    record = _parse_status(bytes(status.data))
    if record is not None:
        returncode = record["returncode"]  # the code's own exit status, from the monitor
    elif launch is not None:
        failure = setup_failure(err.data.decode("utf-8", errors="replace"), launch.token)
        if failure is not None and returncode == 125:
            raise SandboxUnavailableError(setup_error(failure))
        if 128 < returncode < 128 + 65:
            returncode = 128 - returncode  # bwrap reports a signal N as exit status 128 + N
    if timed_out:
        error, message = "timeout", f"Error: timed out after {float(limits.timeout_s)} s"
    elif launch is not None and launch.oom_kills() > 0:
        # The kernel killed a process of the sandbox at the memory cgroup's limit.
        error, message = "memory", f"Error: memory limit of {limits.memory_mb} MB exceeded"
    else:
        error, message = limits.describe(record, returncode)
    stdout, cut_out = out.text(limits.max_output_chars)
    stderr, cut_err = err.text(limits.max_output_chars)
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=None if timed_out or returncode < 0 else returncode,
        error=error,
        message=message,
        duration_s=time.monotonic() - start,
        truncated=cut_out or cut_err,
    )


def run_python_sync(code: str, **limits: Any) -> SandboxResult:
    """Blocking variant of :func:`run_python` (same keyword arguments).

    Safe to call from a thread or from inside a running event loop (it then runs the
    sandbox on a helper thread with its own loop).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python(code, **limits))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-sync") as pool:
        return pool.submit(lambda: asyncio.run(run_python(code, **limits))).result()


def make_python_tool(
    *,
    name: str = "python",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_output_chars: int = 8000,
    max_processes: int = 8,
    disk_mb: int = 128,
    isolation: str | None = None,
) -> Tool:
    """A tool that runs the model's code with :func:`run_python` under these limits.

    The tool returns what the code printed (``"(no output)"`` when nothing). A failure
    becomes a :class:`ToolResult` with the specific ``"Error: ..."`` message followed by the
    output, and ``error="timeout"`` for a timeout, ``"tool_exception"`` otherwise.

    Raises:
        SandboxUnavailableError: the isolation (default ``"bwrap"``) cannot run here; the
            tool refuses to start rather than run the code less isolated.
    """
    limits = SandboxLimits(
        timeout_s, memory_mb, max_output_chars, max_processes, disk_mb=disk_mb,
        isolation=isolation or default_isolation(),
    )  # fmt: skip
    check_sandbox(limits.isolation)
    mode = limits.isolation

    async def python(code: str) -> ToolResult:
        """Run code in a fresh process and return its printed output.

        Args:
            code: The Python source to run, as a script (use print to show values).
        """
        result = await run_python(
            code,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
            max_processes=max_processes,
            disk_mb=disk_mb,
            isolation=mode,
        )
        if result.ok:
            return ToolResult(result.to_text())
        kind = "timeout" if result.error == "timeout" else "tool_exception"
        return ToolResult(result.to_text(), error=kind)

    description = (
        "Run Python 3 code in a sandbox and return what it prints (stdout, then stderr). "
        "Every call starts a fresh process: variables do not persist, so print the values "
        f"you need. Limits: {float(timeout_s)} s, {memory_mb} MB of memory, no network, "
        "files may only be written in the current directory, no other programs."
    )
    return function_tool(python, name=name, description=description)  # type: ignore[no-any-return]


python_tool: Tool
"""The default ``python`` tool (10 s, 512 MB, 8000 characters of output per stream), built on
first use: where bubblewrap cannot run, using it raises :class:`SandboxUnavailableError`."""


def __getattr__(name: str) -> Any:
    if name == "python_tool":
        tool = make_python_tool()
        globals()["python_tool"] = tool
        return tool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
