"""Run untrusted Python code in a separate, limited process.

``run_python`` starts ``sys.executable -I`` in a new process group (and, where the system
allows it, in fresh network and PID namespaces through ``unshare``), feeds it the code on
stdin and returns a :class:`SandboxResult`. Every failure mode ends with a specific
message a model can read:

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
``exception``      ``Error: ZeroDivisionError: division by zero`` (traceback in stderr)
``exit``           ``Error: the code exited with status 3``
``signal``         ``Error: the process was killed by signal SIGSEGV``
=================  =====================================================================

How each limit is enforced, in layers:

- **time**: the parent waits ``timeout_s`` and then kills the whole process group (and,
  with namespaces, the PID namespace, which takes every descendant with it).
- **memory**: ``RLIMIT_AS`` in the child; Python raises ``MemoryError``.
- **processes**: an audit hook (``sys.addaudithook``) in the child spends one token of a
  pipe shared by the child and its forks for every ``os.fork``; when none is left the
  fork fails. Starting other programs (``subprocess``, ``os.system``, ``os.exec*``) is
  refused unless ``allow_subprocess=True``; then ``RLIMIT_NPROC`` also applies (the
  kernel ignores it for root, so keep ``allow_subprocess`` off there).
- **network**: the audit hook refuses every non-Unix socket, connect, bind and name
  lookup; with namespaces the child also runs in an empty network namespace (not even
  loopback is up), which holds for programs it starts too.
- **files**: the child runs in a private temporary directory, removed afterwards; the
  audit hook refuses opening for writing, creating, removing, renaming, linking or
  changing files outside it. ``RLIMIT_FSIZE`` bounds the size of any one file.
- **output**: stdout and stderr are read as they come and cut at ``max_output_chars``
  with a marker; the rest is drained and dropped.

The audit hook is a first line of defence with precise messages, not a security boundary
on its own (code that loads C functions through ``ctypes`` can bypass it); the process,
resource limits and namespaces are the hard layer. The child gets a minimal environment:
no variable of the parent (API keys included) reaches it.

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
from dataclasses import dataclass
from typing import Any

from tools.tool import Tool, ToolResult, function_tool

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "make_python_tool",
    "python_tool",
    "run_python",
    "run_python_sync",
]

_KILL_GRACE_S = 2.0  # how long to wait for pipes to close once the process group is dead

# The program the child runs (``python -I -u -B -c _CHILD_SOURCE work status config``). It
# reads the code from stdin, applies the limits, installs the audit hook and runs the code.
# Stdlib only; every record it writes to the status file is one JSON line.
_CHILD_SOURCE = r"""
import builtins, errno, json, linecache, os, resource, signal, sys, traceback
from _socket import AF_UNIX

work, status_path, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
code = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)
os.chdir(work)
status_fd = os.open(status_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
main_pid = os.getpid()


def record(kind, detail=""):
    line = json.dumps({"kind": kind, "detail": detail, "main": os.getpid() == main_pid})
    try:
        os.write(status_fd, (line + "\n").encode())
    except OSError:
        pass


mem = cfg["memory_bytes"]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"], cfg["file_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
if cfg["nproc"] is not None:
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
tokens_r, tokens_w = os.pipe()
os.write(tokens_w, b"x" * cfg["max_processes"])
os.close(tokens_w)
os.set_blocking(tokens_r, False)
for name in ("setsid", "setpgid", "setpgrp"):
    for module in (os, sys.modules["posix"]):
        if hasattr(module, name):
            delattr(module, name)


class SandboxViolation(PermissionError):
    texts = {
        "write": "writing outside the sandbox directory is not allowed: ",
        "network": "network access is disabled in the sandbox",
        "process": "process limit reached",
        "program": "running other programs is disabled in the sandbox: ",
    }

    def __init__(self, kind, detail):
        text = self.texts[kind] + (detail if self.texts[kind].endswith(": ") else "")
        super().__init__(errno.EPERM, text)
        self.kind, self.detail = kind, detail


work_real = os.path.realpath(work)
write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
path_events = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1),
    "os.link": (0, 1), "os.symlink": (1,), "os.mkfifo": (0,), "os.mknod": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,),
    "shutil.chown": (0,), "os.chflags": (0,), "os.lchflags": (0,),
}
net_events = {
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
    "socket.gethostbyaddr", "socket.getnameinfo",
}
program_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"}
new_process_events = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "subprocess.Popen"}


def check_write(path):
    if isinstance(path, int) or path is None:
        return
    path = os.fsdecode(path)
    real = os.path.realpath(path)
    if real == work_real or real.startswith(work_real + os.sep) or real == os.devnull:
        return
    raise SandboxViolation("write", os.path.abspath(path))


def take_token():
    try:
        if os.read(tokens_r, 1):
            return
    except OSError:
        pass
    raise SandboxViolation("process", "no process left")


def describe_command(cmd):
    if isinstance(cmd, (str, bytes, os.PathLike)):
        return os.fsdecode(cmd)[:200]
    try:
        return " ".join(os.fsdecode(part) for part in cmd)[:200]
    except TypeError:
        return ""


def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if (mode is not None and any(c in mode for c in "wax+")) or flags & write_flags:
            check_write(path)
    elif event in path_events:
        for i in path_events[event]:
            if i < len(args):
                check_write(args[i])
    elif event == "socket.__new__":
        if args[1] != AF_UNIX:
            raise SandboxViolation("network", "")
    elif event in net_events:
        raise SandboxViolation("network", "")
    elif event in program_events and not cfg["allow_subprocess"]:
        cmd = args[1] if event == "subprocess.Popen" else args[0]
        raise SandboxViolation("program", describe_command(cmd))
    if event in new_process_events:
        take_token()


def find_in_chain(exc, cls):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, cls):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def print_user_traceback(exc):
    # Drop the frames of this program (the exec call, the audit hook) from every exception.
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    todo = [te]
    while todo:
        t = todo.pop()
        t.stack[:] = [f for f in t.stack if f.filename != "<string>"]
        todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    sys.stderr.write("".join(te.format()))


sys.argv = ["<code>"]
linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
namespace = {"__name__": "__main__", "__builtins__": builtins}
exit_code = 0
sys.addaudithook(hook)
try:
    exec(compile(code, "<code>", "exec"), namespace)
except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
        exit_code = e.code or 0
    else:
        print(e.code, file=sys.stderr)
        exit_code = 1
    if exit_code:
        record("exit", str(exit_code))
except BaseException as e:
    exit_code = 1
    violation = find_in_chain(e, SandboxViolation)
    if violation is not None:
        record(violation.kind, violation.detail)
    elif find_in_chain(e, MemoryError) is not None:
        record("memory")
    elif isinstance(e, OSError) and e.errno == errno.EFBIG:
        record("file_size")
    else:
        record("exception", (type(e).__name__ + ": " + str(e))[:500])
    namespace.clear()
    if os.getpid() == main_pid or violation is None or violation.kind != "process":
        try:
            print_user_traceback(e)
        except BaseException:
            pass
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except BaseException:
        pass
os._exit(exit_code)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run (see :func:`run_python` for each field)."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_chars: int = 8000
    max_processes: int = 8
    max_file_mb: int = 64
    allow_subprocess: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number, got {self.timeout_s!r}")
        for name, low in (("memory_mb", 32), ("max_output_chars", 1), ("max_processes", 0),
                          ("max_file_mb", 1)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")

    def child_config(self) -> dict[str, Any]:
        """What the child program needs to apply these limits."""
        nproc = None
        if self.allow_subprocess and os.getuid() != 0:  # root ignores RLIMIT_NPROC
            nproc = _count_user_processes() + self.max_processes + 8
        return {
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_bytes": self.max_file_mb * 1024 * 1024,
            "max_processes": self.max_processes,
            "allow_subprocess": self.allow_subprocess,
            "nproc": nproc,
        }

    def describe(
        self, rec: dict[str, Any] | None, returncode: int | None
    ) -> tuple[str | None, str]:
        """Map the child's status record and exit status to (error kind, message)."""
        kind = rec.get("kind") if rec else None
        detail = str(rec.get("detail", "")) if rec else ""
        messages = {
            "memory": f"Error: memory limit of {self.memory_mb} MB exceeded",
            "network": "Error: network access is disabled in the sandbox",
            "write": f"Error: writing outside the sandbox directory is not allowed: {detail}",
            "process": f"Error: process limit reached (at most {self.max_processes} processes)",
            "program": "Error: running other programs is disabled in the sandbox "
            "(subprocess, os.system, os.exec*)",
            "file_size": f"Error: file size limit of {self.max_file_mb} MB exceeded",
            "exception": f"Error: {detail}",
            "exit": f"Error: the code exited with status {detail}",
        }
        if kind in messages:
            return kind, messages[kind]
        if returncode is not None and returncode < 0:
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
            ``"exception"``, ``"exit"``, ``"signal"``).
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


def _count_user_processes() -> int:
    """How many processes this user runs (``RLIMIT_NPROC`` counts them all)."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/status", encoding="utf-8") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
            count += int(uid_line.split()[1]) == uid
    return count


def _child_env(work: str) -> dict[str, str]:
    """A minimal environment: nothing of the parent's (secrets) leaks into the child."""
    env = {"HOME": work, "TMPDIR": work, "TMP": work, "TEMP": work, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}  # fmt: skip
    env["PATH"] = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_status(path: str) -> dict[str, Any] | None:
    """The record written by the main process, else the first one written by a fork."""
    records = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    main = [rec for rec in records if rec.get("main")]
    return (main or records or [None])[0]


async def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_output_chars: int = 8000,
    max_processes: int = 8,
    max_file_mb: int = 64,
    allow_subprocess: bool = False,
    use_namespaces: bool | None = None,
) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed Python process and capture what it printed.

    Args:
        code: Python source, run as ``__main__`` in a private temporary directory.
        timeout_s: wall-time limit; the process group is killed after it.
        memory_mb: address-space limit of each process (``RLIMIT_AS``).
        max_output_chars: stdout and stderr are each cut after this many characters.
        max_processes: how many processes the code may start in all (forks included).
        max_file_mb: the largest file the code may write.
        allow_subprocess: allow starting other programs (they escape the audit hook;
            only the kernel-level limits apply to them).
        use_namespaces: run in fresh network and PID namespaces through ``unshare``;
            ``None`` uses them when the system allows it.

    Returns:
        A :class:`SandboxResult`; failures are reported in it, never raised.

    Raises:
        TypeError, ValueError: a limit or ``code`` has the wrong type or value.
    """
    if not isinstance(code, str):
        raise TypeError(f"code: expected str, got {type(code).__name__}")
    limits = SandboxLimits(
        timeout_s, memory_mb, max_output_chars, max_processes, max_file_mb, allow_subprocess
    )
    prefix = _namespace_prefix() if use_namespaces in (None, True) else ()
    if use_namespaces and not prefix:
        raise ValueError("use_namespaces=True but `unshare` cannot create namespaces here")
    root = tempfile.mkdtemp(prefix="areal-sandbox-")
    work, status_path = os.path.join(root, "work"), os.path.join(root, "status.jsonl")
    os.mkdir(work, 0o700)
    argv = [sys.executable, "-I", "-u", "-B", "-c", _CHILD_SOURCE, work, status_path]
    start = time.monotonic()
    proc: asyncio.subprocess.Process | None = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix,
            *argv,
            json.dumps(limits.child_config()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_child_env(work),
            cwd=work,
            start_new_session=True,
        )
        return await _supervise(proc, code, start, status_path, limits)
    finally:  # also on cancellation: nothing outlives the call
        if proc is not None:
            _kill_group(proc.pid)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        shutil.rmtree(root, ignore_errors=True)


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


async def _supervise(
    proc: asyncio.subprocess.Process,
    code: str,
    start: float,
    status_path: str,
    limits: SandboxLimits,
) -> SandboxResult:
    """Feed the code, wait up to the time limit, kill the group, collect the result."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stdin = proc.stdin
    cap = limits.max_output_chars * 4 + 4
    out, err = _CappedReader(cap), _CappedReader(cap)
    readers = asyncio.gather(out.read(proc.stdout), err.read(proc.stderr))

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
    error: str | None
    if timed_out:
        error, message = "timeout", f"Error: timed out after {float(limits.timeout_s)} s"
    else:
        error, message = limits.describe(_read_status(status_path), returncode)
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
) -> Tool:
    """A tool that runs the model's code with :func:`run_python` under these limits.

    The tool returns what the code printed (``"(no output)"`` when nothing). A failure
    becomes a :class:`ToolResult` with the specific ``"Error: ..."`` message followed by the
    output, and ``error="timeout"`` for a timeout, ``"tool_exception"`` otherwise.
    """
    SandboxLimits(timeout_s, memory_mb, max_output_chars, max_processes)  # validate now

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


python_tool: Tool = make_python_tool()
"""The default ``python`` tool (10 s, 512 MB, 8000 characters of output per stream)."""
