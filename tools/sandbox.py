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
``disk``           ``Error: disk quota of 128 MB exceeded``
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
  any one file.
- **network**: an empty network namespace (only its own loopback); no host socket, Unix
  sockets included, is reachable, since nothing of the host's ``/run`` or ``/tmp`` is bound.
- **time**: the parent waits ``timeout_s`` and kills bwrap, which takes the whole PID
  namespace with it; ``RLIMIT_CPU`` backs it up. A daemon (``setsid``, double fork) dies
  with the sandbox too.
- **memory**: ``RLIMIT_AS`` in each process; Python raises ``MemoryError``.
- **processes**: ``RLIMIT_NPROC`` (counted per user namespace, so per sandbox) caps the
  tasks alive at once at ``max_processes`` plus a few (bwrap itself, threads).
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
``RLIMIT_NPROC``), a disk quota, and, without namespaces, daemons that outlive the call.

Without bubblewrap (or where it cannot create user namespaces) ``"bwrap"`` refuses to start
with :class:`SandboxUnavailableError`; install it with ``apt-get install -y bubblewrap``.

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
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from areal_agents.errors import UserError
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

ISOLATIONS = ("bwrap", "process")
"""``"bwrap"``: the bubblewrap sandbox (default); ``"process"``: the weaker in-process checks."""
ISOLATION_ENV = "AREAL_SANDBOX_ISOLATION"
"""The environment variable that sets the default isolation."""
SANDBOX_UID = 65534
"""The host uid (and gid) the code runs as when the caller is root (``nobody``)."""
BWRAP_WORK_DIR = "/sandbox"
"""The private working directory inside the bubblewrap sandbox."""

_BWRAP_BASE_TASKS = 2  # tasks of the sandbox's user namespace before the code forks
_THREAD_ALLOWANCE = 8  # RLIMIT_NPROC counts threads too
_STATUS_CAP = 65536  # bytes of status records kept
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # nothing secret, bound where present
_INSTALL = "apt-get install -y bubblewrap"
_FIX_HINT = {
    "bwrap": f"Install it with `{_INSTALL}` (Debian/Ubuntu; `dnf install bubblewrap` on "
    "Fedora), or opt into the weaker in-process sandbox with isolation='process' "
    f"({ISOLATION_ENV}=process).",
    "setpriv": "It is part of util-linux: `apt-get install -y util-linux`.",
    "unshare": "It is part of util-linux: `apt-get install -y util-linux`.",
}
# Run by /bin/sh in the launcher's private mount namespace: bind each unreachable Python
# directory onto its empty mount point, then exec the rest (setpriv ... bwrap ...).
_STAGE_SCRIPT = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind -- "$1" "$2" || exit 125; '
    'shift 2; n=$((n - 1)); done; exec "$@"'
)

_KILL_GRACE_S = 2.0  # how long to wait for pipes to close once the process group is dead

# The program the child runs (``python -I -u -B -c _CHILD_SOURCE work status_fd config``). It
# reads the code from stdin, applies the limits, installs the audit hook and runs the code.
# Stdlib only; every record it writes to the status pipe is one JSON line.
_CHILD_SOURCE = r"""
import builtins, errno, json, linecache, os, resource, signal, sys, traceback
from _socket import AF_UNIX

work, status_fd, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
code = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)
os.chdir(work)
os.set_inheritable(status_fd, False)
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
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
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
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        record("disk")
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


def default_isolation() -> str:
    """The isolation used when none is given: ``$AREAL_SANDBOX_ISOLATION``, else ``"bwrap"``."""
    return os.environ.get(ISOLATION_ENV, "").strip() or "bwrap"


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run (see :func:`run_python` for each field)."""

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
    def cpu_s(self) -> int:
        """The CPU-time limit of each process (``RLIMIT_CPU``), a backstop to the wall time."""
        return math.ceil(self.timeout_s) + 1

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
            "disk": f"Error: disk quota of {self.disk_mb} MB exceeded",
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


# ---------------------------------------------------------------------------- bubblewrap


def _is_under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _python_paths() -> list[str]:
    """The directories the interpreter needs: its installation and the virtualenv, if any.

    Each is given as written and, where symlinks are involved, also resolved, so that the
    interpreter's own symlinks (a venv's ``bin/python`` -> the base install) resolve inside.
    """
    exe_home = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    exe_real_home = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    found: list[str] = []
    for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, exe_home,
              exe_real_home):  # fmt: skip
        for candidate in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.isdir(candidate) and candidate not in found:
                found.append(candidate)
    found.sort(key=len)
    kept: list[str] = []
    for p in found:
        if p == "/":
            raise SandboxUnavailableError(
                f"the Python installation ({sys.executable}) lives at the filesystem root; "
                "the sandbox cannot bind it without exposing everything"
            )
        if not _is_under(p, ["/usr", *kept]):
            kept.append(p)
    return kept


def _reachable_by(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` (no other groups) may traverse to ``path`` and list it."""
    parts = os.path.realpath(path).split("/")
    for i in range(1, len(parts) + 1):
        current = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(current)
        except OSError:
            return False
        need = 0o5 if i == len(parts) else 0o1  # r-x on the target, --x on its ancestors
        if st.st_uid == uid:
            bits = st.st_mode >> 6
        elif st.st_gid == gid:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        if bits & need != need:
            return False
    return True


def _system_binds() -> list[str]:
    """bwrap arguments for the system paths (read-only), mirroring the host's ``/bin`` links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


@dataclass
class _Launch:
    """How to start one bwrap sandbox: the command prefix and what to clean up after."""

    prefix: list[str]
    stage_root: str | None = None

    def cleanup(self) -> None:
        if self.stage_root is None:
            return
        # Only empty mount points: the binds onto them live in the launcher's private mount
        # namespace, never in ours. rmdir (not rmtree) keeps it that way even if one leaked.
        for name in sorted(os.listdir(self.stage_root), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.stage_root, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.stage_root)


def _which(program: str) -> str:
    path = shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/bin:/bin:/usr/sbin")
    if path is None:
        raise SandboxUnavailableError(
            f"the Python sandbox needs `{program}`, which is not installed. {_FIX_HINT[program]}"
        )
    return path


def _bwrap_launch(limits: SandboxLimits) -> _Launch:
    """The command that runs a program under bubblewrap, as an unprivileged user.

    As root, privileges are dropped to :data:`SANDBOX_UID` before bwrap starts (bwrap run by
    root would map the sandbox user to host root). Python installation directories that
    user cannot reach (``/root/.pyenv``, a root-only venv) are first bound onto empty,
    world-readable mount points in a private mount namespace of the launcher (``unshare``),
    so that bwrap can bind them from there; no mount is made in the caller's namespace.
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(
            "the bubblewrap sandbox needs Linux; on this system only "
            f"isolation='process' (or {ISOLATION_ENV}=process) is available"
        )
    bwrap = _which("bwrap")
    disk = str(limits.disk_mb * 1024 * 1024)
    args = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--hostname", "sandbox", *_system_binds(),
        "--proc", "/proc", "--dev", "/dev", "--size", disk, "--tmpfs", "/dev/shm",
        "--size", disk, "--tmpfs", BWRAP_WORK_DIR, "--chdir", BWRAP_WORK_DIR,
    ]  # fmt: skip
    root = os.geteuid() == 0
    stage_root: str | None = None
    stage: list[str] = []
    try:
        for path in _python_paths():
            source = path
            if root and not _reachable_by(path, SANDBOX_UID, SANDBOX_UID):
                if stage_root is None:
                    stage_root = tempfile.mkdtemp(prefix="areal-sandbox-stage-", dir="/tmp")
                    os.chmod(stage_root, 0o755)
                source = os.path.join(stage_root, str(len(stage) // 2))
                os.mkdir(source, 0o755)
                stage += [path, source]
            args += ["--ro-bind", source, path]
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--"]
        if not root:
            return _Launch(args)
        drop = [_which("setpriv"), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                "--clear-groups", "--inh-caps=-all", "--no-new-privs", "--"]  # fmt: skip
        if not stage:
            return _Launch([*drop, *args])
        launcher = [_which("unshare"), "--mount", "--propagation", "private", "--",
                    "/bin/sh", "-c", _STAGE_SCRIPT, "sh", str(len(stage) // 2), *stage]  # fmt: skip
        return _Launch([*launcher, *drop, *args], stage_root)
    except BaseException:
        _Launch([], stage_root).cleanup()
        raise


_verified: set[tuple[int, str]] = set()


def check_sandbox(isolation: str | None = None) -> None:
    """Check that ``isolation`` (default: :func:`default_isolation`) can run here.

    For ``"bwrap"`` this starts one sandbox (once per process; about 40 ms) and raises
    :class:`SandboxUnavailableError`, naming the fix, when bubblewrap is missing or cannot
    create its namespaces. ``"process"`` always passes.
    """
    mode = SandboxLimits(isolation=isolation or default_isolation()).isolation
    if mode != "bwrap" or (os.geteuid(), sys.executable) in _verified:
        return
    launch = _bwrap_launch(SandboxLimits(isolation="bwrap"))
    try:
        done = subprocess.run(
            [*launch.prefix, sys.executable, "-I", "-S", "-c", "import os; print(os.getuid())"],
            capture_output=True,
            timeout=60,
            env={"PATH": _SANDBOX_PATH, "LC_ALL": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailableError(f"bubblewrap could not be started: {exc}") from exc
    finally:
        launch.cleanup()
    uid = done.stdout.decode(errors="replace").strip()
    if done.returncode != 0 or uid != str(_expected_sandbox_uid()):
        detail = done.stderr.decode(errors="replace").strip()[-600:] or f"uid {uid!r}"
        raise SandboxUnavailableError(
            f"bubblewrap cannot start a sandbox here ({detail}). It needs unprivileged user "
            "namespaces: `sysctl user.max_user_namespaces` must be > 0 and, where it exists, "
            "`sysctl kernel.unprivileged_userns_clone` = 1 (Ubuntu 24.04+: also "
            "`kernel.apparmor_restrict_unprivileged_userns=0`); in a container, allow user "
            "namespaces (e.g. Docker's default seccomp profile blocks them: "
            "`--security-opt seccomp=unconfined`). Or opt into the weaker in-process "
            f"sandbox with isolation='process' ({ISOLATION_ENV}=process)."
        )
    _verified.add((os.geteuid(), sys.executable))


def _expected_sandbox_uid() -> int:
    return SANDBOX_UID if os.geteuid() == 0 else os.getuid()


# ---------------------------------------------------------------------------- in-process


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
    """The record written by the main process, else the first one written by a fork."""
    records: list[dict[str, Any]] = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                records.append(rec)
    main = [rec for rec in records if rec.get("main")]
    return (main or records)[0] if records else None


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
        memory_mb: address-space limit of each process (``RLIMIT_AS``).
        max_output_chars: stdout and stderr are each cut after this many characters.
        max_processes: how many processes the code may start in all (forks included).
        max_file_mb: the largest file the code may write.
        allow_subprocess: allow starting other programs (they escape the audit hook;
            only the sandbox and the kernel-level limits apply to them).
        disk_mb: the size of the private directory (and of ``/dev/shm``), ``"bwrap"`` only.
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
    launch: _Launch | None = None
    if limits.isolation == "bwrap":
        if use_namespaces is not None:
            raise ValueError(
                "use_namespaces applies to isolation='process' only (bwrap always runs the "
                "code in fresh namespaces)"
            )
        if (os.geteuid(), sys.executable) not in _verified:
            await asyncio.to_thread(check_sandbox, "bwrap")
        launch = _bwrap_launch(limits)
        prefix, work, path = launch.prefix, BWRAP_WORK_DIR, _SANDBOX_PATH
    else:
        prefix = list(_namespace_prefix()) if use_namespaces in (None, True) else []
        if use_namespaces and not prefix:
            raise ValueError("use_namespaces=True but `unshare` cannot create namespaces here")
        root = tempfile.mkdtemp(prefix="areal-sandbox-")
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        path = os.environ.get("PATH", _SANDBOX_PATH)
    status_r, status_w = os.pipe()
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
                _CHILD_SOURCE,
                work,
                str(status_w),
                json.dumps(limits.child_config()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_child_env(work, path),
                cwd=work if root is not None else "/",
                start_new_session=True,
                pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
        return await _supervise(proc, code, start, status_r, limits)
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
            launch.cleanup()


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
    if limits.isolation == "bwrap" and record is None and 128 < returncode < 128 + 65:
        returncode = 128 - returncode  # bwrap reports a signal N as exit status 128 + N
    if timed_out:
        error, message = "timeout", f"Error: timed out after {float(limits.timeout_s)} s"
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
