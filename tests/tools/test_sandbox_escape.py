"""Escape attempts against the Python sandbox, each run in both isolations.

Every attempt is first shown to succeed with ``isolation="process"`` (the in-process audit
hook, which plain Python switches off), which proves the test can see the escape, and then
shown to be contained with ``isolation="bwrap"``. Process-mode escapes only touch what the
test owns (its ``tmp_path``, its own listeners and helper processes). Where a bound needs
something of the machine (a memory cgroup; root, for the tmpfs file limit; x86_64 or aarch64,
for the seccomp filter), the bubblewrap case is skipped, with the reason, where it lacks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_agents.tools.sandbox import SANDBOX_UID, SandboxLimits, SandboxResult, run_python
from areal_agents.tools.sandbox_bwrap import tmpfs_file_limit
from areal_agents.tools.sandbox_cgroup import memory_cgroup_parent
from areal_agents.tools.sandbox_seccomp import seccomp_program

MODES = ["process", "bwrap"]
ROOT = os.geteuid() == 0
PROJECT_FILE = Path(__file__).resolve().parents[2] / "pyproject.toml"

# Switches off the audit hook's checks by rebinding the globals it reads (its module is
# the child program's ``__main__``).
DISARM = """
import sys
class _EqualsAll:
    def __ne__(self, other):
        return False
_m = sys.modules['__main__']
_m.check_write = lambda path: None
_m.take_token = lambda: None
_m.program_events = set()
_m.net_events = set()
_m.AF_UNIX = _EqualsAll()  # the hook refuses sockets whose family != AF_UNIX
"""


async def run(code: str, mode: str, **limits: Any) -> SandboxResult:
    options: dict[str, Any] = {"timeout_s": 15.0, "memory_mb": 256, **limits}
    return await run_python(code, isolation=mode, **options)


def last_json(result: SandboxResult) -> Any:
    lines = result.stdout.strip().splitlines()
    assert lines, result.to_text()
    return json.loads(lines[-1])


def expected_uid(mode: str) -> int:
    """The uid the code runs as: the caller's in process mode, else 65534 when root."""
    if mode == "process":
        return os.getuid()
    return SANDBOX_UID if ROOT else os.getuid()


def status_uids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        line = next(line for line in f if line.startswith("Uid:"))
    return [int(x) for x in line.split()[1:]]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]


def pids_named(comm: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{name}/comm").read_text().strip() == comm:
                    found.append(int(name))
    return found


# ---------------------------------------------------------------------------- who runs it


@pytest.mark.parametrize("mode", MODES)
async def test_the_code_runs_as_an_unprivileged_host_user(mode: str) -> None:
    """Find the sandboxed interpreter (and bwrap) under the test process from the host side
    and read their Uid line in the host's /proc/PID/status."""
    task = asyncio.ensure_future(run("import time\ntime.sleep(3)\nprint('done')", mode))
    pythons: dict[int, list[int]] = {}
    bwraps: dict[int, list[int]] = {}
    deadline = time.monotonic() + 10
    while not task.done() and time.monotonic() < deadline:
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError, StopIteration):
                argv = cmdline(pid)
                if argv and os.path.basename(argv[0]) == "bwrap":
                    bwraps[pid] = status_uids(pid)
                elif argv[:2] == [sys.executable, "-I"] and "-c" in argv:
                    pythons[pid] = status_uids(pid)
        if pythons and (bwraps or mode == "process"):
            break
        await asyncio.sleep(0.05)
    result = await task
    assert result.ok, result.to_text()
    assert pythons, "found no sandboxed interpreter under the test process"
    expected = [expected_uid(mode)] * 4  # real, effective, saved, filesystem
    assert all(uids == expected for uids in (*pythons.values(), *bwraps.values()))
    if mode == "bwrap":
        assert bwraps
        if ROOT:
            assert expected[0] == SANDBOX_UID != 0
    elif ROOT:
        assert expected[0] == 0  # in process mode the code runs as root: the test can see it


# ---------------------------------------------------------------------------- files


@pytest.mark.parametrize("mode", MODES)
async def test_rebinding_the_checker_does_not_allow_writing_outside(
    mode: str, tmp_path: Path
) -> None:
    target = tmp_path / "escaped.txt"
    code = f"""
import json
try:
    open({str(target)!r}, 'w').write('escaped')
    out = 'written'
except OSError as e:
    out = type(e).__name__
print(json.dumps(out))
"""
    refused = await run(code, mode)
    assert last_json(refused) == "SandboxViolation"  # the hook, before disarming
    assert not target.exists()
    result = await run(DISARM + code, mode)
    if mode == "process":
        assert last_json(result) == "written" and target.read_text() == "escaped"
    else:
        assert last_json(result) == "FileNotFoundError"  # the host /tmp is not there
        assert not target.exists()


@pytest.mark.parametrize("mode", MODES)
async def test_dir_fd_writes_do_not_escape(mode: str, tmp_path: Path) -> None:
    name = f"areal-escape-{uuid.uuid4().hex}.txt"
    # Process mode only tries the test's own directory; bwrap also the read-only binds.
    dirs = [str(tmp_path)] + (["/", "/usr", "/dev"] if mode == "bwrap" else [])
    code = f"""
import json, os
out = {{}}
for d in {dirs!r}:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        w = os.open({name!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(w, b'escaped')
        os.close(w)
        out[d] = 'written'
    except OSError as e:
        out[d] = type(e).__name__ + ': ' + str(e.strerror)
print(json.dumps(out))
"""
    try:
        out = last_json(await run(code, mode))
        if mode == "process":
            assert out[str(tmp_path)] == "written"  # the hook sees only a relative name
            assert (tmp_path / name).read_text() == "escaped"
            return
        assert out[str(tmp_path)].startswith("FileNotFoundError")
        for d in ("/", "/usr", "/dev"):
            assert "Read-only file system" in out[d], out
        for d in dirs:
            assert not os.path.exists(os.path.join(d, name))
    finally:
        for d in dirs[1:]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(d, name))


@pytest.mark.parametrize("mode", MODES)
async def test_host_files_are_not_readable(mode: str, tmp_path: Path) -> None:
    helper_secret = uuid.uuid4().hex
    helper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={"AREAL_ESCAPE_SECRET": helper_secret, "PATH": os.environ.get("PATH", "")},
    )
    files = {
        "environ": f"/proc/{helper.pid}/environ",
        "test_environ": f"/proc/{os.getpid()}/environ",
        "shadow": "/etc/shadow",
        "passwd": "/etc/passwd",
        "project": str(PROJECT_FILE),
    }
    code = f"""
import json
out = {{}}
for key, path in {files!r}.items():
    try:
        with open(path, 'rb') as f:
            data = f.read()
        out[key] = 'secret' if {helper_secret.encode()!r} in data else 'read'
    except OSError as e:
        out[key] = type(e).__name__
print(json.dumps(out))
"""
    try:
        out = last_json(await run(code, mode))
    finally:
        helper.kill()
        helper.wait()
    if mode == "bwrap":
        # No other process in the PID namespace; none of these paths is bound.
        assert out == dict.fromkeys(files, "FileNotFoundError"), out
        return
    assert out["environ"] == "secret"  # another process's environment, API keys included
    assert out["test_environ"] == "read"
    assert out["passwd"] == "read" and out["project"] == "read"
    if ROOT:
        assert out["shadow"] == "read"
    else:  # as a normal user the kernel already refuses it, even in process mode
        assert out["shadow"] == "PermissionError"


# ---------------------------------------------------------------------------- programs


def program_code(how: str, target: Path) -> str:
    command = f"id -u; echo escaped > {target}"
    if how == "subprocess":
        run_it = f"import subprocess\nsubprocess.run(['/bin/sh', '-c', {command!r}])\n"
    elif how == "fork_exec":
        run_it = f"""
import os, _posixsubprocess
r, w = os.pipe()
pid = _posixsubprocess.fork_exec(
    [b'/bin/sh', b'-c', {command.encode()!r}], [b'/bin/sh'], True, (w,), None, None,
    -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
os.close(w)
os.waitpid(pid, 0)
"""
    else:
        run_it = f"import ctypes\nctypes.CDLL(None).system({command.encode()!r})\n"
    return run_it


@pytest.mark.parametrize("how", ["subprocess", "fork_exec", "ctypes"])
@pytest.mark.parametrize("mode", MODES)
async def test_programs_run_unprivileged_and_see_no_host_files(
    mode: str, how: str, tmp_path: Path
) -> None:
    """``_posixsubprocess.fork_exec`` and ctypes ``system()`` raise no audit event the hook
    refuses, and ``subprocess`` runs once the hook's globals are rebound."""
    target = tmp_path / "program.txt"
    code = program_code(how, target)
    if how == "subprocess":
        refused = await run(code, mode)
        assert refused.error == "program"  # the hook, before disarming
        code = DISARM + code
    result = await run(code, mode)
    uid = result.stdout.split()[0] if result.stdout.split() else ""
    assert uid == str(expected_uid(mode)), result.to_text()
    if mode == "process":
        assert target.read_text() == "escaped\n"  # as root, when the caller is root
    else:
        assert not target.exists()
        assert "nonexistent" in result.stderr or "No such file" in result.stderr


@pytest.mark.parametrize("mode", MODES)
async def test_rebinding_the_checker_does_not_lift_the_process_limit(mode: str) -> None:
    code = (
        DISARM
        + """
import json, os
r, w = os.pipe()
started, error = 0, None
for _ in range(30):
    try:
        pid = os.fork()
    except OSError as e:
        error = type(e).__name__ + ': ' + e.strerror
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # wait for the parent to close the pipe
        os._exit(0)
    started += 1
os.close(w)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print(json.dumps([started, error]))
"""
    )
    started, error = last_json(await run(code, mode, max_processes=2))
    if mode == "process" and ROOT:
        assert (started, error) == (30, None)  # root ignores RLIMIT_NPROC
        return
    if mode == "process":
        pytest.skip("not root: RLIMIT_NPROC is not set in process mode without subprocesses")
    assert 2 <= started <= 2 + 8 and error == "BlockingIOError: Resource temporarily unavailable"


# ---------------------------------------------------------------------------- network


@contextlib.contextmanager
def listening(family: int, address: Any) -> Iterator[socket.socket]:
    server = socket.socket(family, socket.SOCK_STREAM)
    try:
        server.bind(address)
        server.listen(8)
        server.setblocking(False)
        yield server
    finally:
        server.close()


def was_connected(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("mode", MODES)
async def test_setns_into_the_callers_network_namespace_is_contained(mode: str) -> None:
    with listening(socket.AF_INET, ("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            DISARM
            + f"""
import ctypes, json, os, socket
def connect():
    try:
        socket.create_connection(('127.0.0.1', {port}), timeout=2).close()
        return 'connected'
    except OSError as e:
        return type(e).__name__
out = {{'before': connect()}}
try:
    fd = os.open('/proc/{os.getpid()}/ns/net', os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    out['setns'] = 'ok'
except OSError as e:
    out['setns'] = type(e).__name__
out['after'] = connect()
print(json.dumps(out))
"""
        )
        result = await run(code, mode)
        out = last_json(result)
        connected = was_connected(server)
    if mode == "process":
        if not ROOT:
            pytest.skip("setns into the caller's namespace needs CAP_SYS_ADMIN (root)")
        assert out["before"] != "connected"  # the unshare'd network namespace is empty
        assert out == {"before": out["before"], "setns": "ok", "after": "connected"}
        assert connected
        return
    assert out["setns"] == "FileNotFoundError"  # the caller is not in the PID namespace
    assert out["after"] != "connected" and not connected, out


@pytest.mark.parametrize("mode", MODES)
async def test_host_unix_sockets_are_unreachable(mode: str, tmp_path: Path) -> None:
    path = str(tmp_path / "host.sock")
    abstract = "\0areal-escape-" + uuid.uuid4().hex
    with listening(socket.AF_UNIX, path) as server, listening(socket.AF_UNIX, abstract) as ab:
        code = (
            DISARM
            + f"""
import json, socket
out = {{}}
for key, address in (('path', {path!r}), ('abstract', {abstract!r})):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        out[key] = 'connected'
    except OSError as e:
        out[key] = type(e).__name__
    finally:
        s.close()
print(json.dumps(out))
"""
        )
        # Process mode without namespaces: abstract sockets belong to the network namespace.
        options = {"use_namespaces": False} if mode == "process" else {}
        out = last_json(await run(code, mode, **options))
        reached = (was_connected(server), was_connected(ab))
    if mode == "process":
        assert out == {"path": "connected", "abstract": "connected"} and reached == (True, True)
        return
    assert out == {"path": "FileNotFoundError", "abstract": "ConnectionRefusedError"}, out
    assert reached == (False, False)


# ---------------------------------------------------------------------------- lifetime


@pytest.mark.parametrize("mode", MODES)
async def test_a_setsid_daemon_does_not_outlive_the_call(mode: str, tmp_path: Path) -> None:
    marker = tmp_path / "daemon-alive"
    comm = "arealdmn" + uuid.uuid4().hex[:6]
    code = (
        DISARM
        + f"""
import ctypes, os, time
libc = ctypes.CDLL(None)
if os.fork() == 0:
    libc.setsid()  # os.setsid is removed by the hook; the C function is not
    if os.fork() == 0:
        os.closerange(0, 1024)  # hold none of the sandbox's pipes
        libc.prctl(15, {comm.encode()!r}, 0, 0, 0)  # PR_SET_NAME
        time.sleep(1.0)
        try:
            open({str(marker)!r}, 'w').write('alive')
        except OSError:
            pass
        time.sleep(30)
    os._exit(0)
time.sleep(0.3)
print('returned')
"""
    )
    # Process mode without namespaces: a PID namespace would take the daemon with it.
    options = {"use_namespaces": False} if mode == "process" else {}
    result = await run(code, mode, max_processes=2, **options)
    assert result.stdout == "returned\n", result.to_text()
    alive: list[int] = []
    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline and not (alive and marker.exists()):
            alive = pids_named(comm)
            time.sleep(0.1)
        if mode == "process":
            assert alive and marker.read_text() == "alive"
        else:
            assert alive == [] and not marker.exists()
    finally:
        for pid in pids_named(comm):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- disk


@pytest.mark.parametrize("mode", MODES)
async def test_filling_the_disk_stops_at_the_quota(mode: str) -> None:
    # 24 MB in 4 MB files, against an 8 MB quota; in process mode it lands in the host's
    # temporary directory (bounded here, and removed after the run).
    code = """
chunk = b'x' * (4 * 1024 * 1024)
for i in range(6):
    with open(f'f{i}', 'wb') as f:
        f.write(chunk)
print('wrote 24 MB')
"""
    result = await run(code, mode, disk_mb=8, max_file_mb=4)
    if mode == "process":
        assert result.ok and result.stdout == "wrote 24 MB\n"  # no quota
        return
    assert result.error == "disk"
    assert result.message == "Error: disk quota of 8 MB exceeded"
    shm = await run(DISARM + code.replace("f'f{i}'", "f'/dev/shm/f{i}'"), mode, disk_mb=8)
    assert shm.error == "disk"  # /dev/shm has the same quota


# ---------------------------------------------------------------------------- memory

# A sandbox that holds memory no process maps: memfds filled with write() (each under the
# file-size limit) and SysV segments attached, filled and detached again. The segments are
# removed before the script exits: a SysV segment outlives its creator, and without a
# sandbox (mode "process") each run would leave 256 MB of the host's memory held for good.
SHARED_MEMORY = """
import ctypes, json, os
out = {}
fds, held = [], 0
try:
    for _ in range(8):
        fds.append(os.memfd_create('hold'))
        os.write(fds[-1], b'x' * (32 << 20))
        held += 32
except OSError as e:
    out['memfd_error'] = type(e).__name__
out['memfd_mb'] = held
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, segments = 0, []
try:
    for _ in range(4):
        segment = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if segment < 0:
            out['shmget_error'] = os.strerror(ctypes.get_errno())
            break
        segments.append(segment)
        address = libc.shmat(segment, None, 0)
        ctypes.memset(address, 1, 64 << 20)
        libc.shmdt(ctypes.c_void_p(address))
        held += 64
    out['shm_mb'] = held
finally:
    for segment in segments:
        libc.shmctl(segment, 0, None)  # IPC_RMID
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", MODES)
async def test_memfd_and_sysv_shared_memory_are_refused(mode: str) -> None:
    """256 MB in memfds and 256 MB in SysV segments against a 128 MB limit: RLIMIT_AS only
    counts mapped memory, so both escape it; the seccomp filter refuses the calls."""
    if mode == "bwrap" and seccomp_program() is None:
        pytest.skip("the seccomp filter is built for x86_64 and aarch64 only")
    result = await run(SHARED_MEMORY, mode, memory_mb=128, disk_mb=4)
    out = last_json(result)
    if mode == "process":
        assert out == {"memfd_mb": 256, "shm_mb": 256}, out
        return
    assert out == {
        "memfd_error": "PermissionError",
        "memfd_mb": 0,
        "shmget_error": "Operation not permitted",
        "shm_mb": 0,
    }, out


# Six forks each hold 64 MB at once (each under its own 128 MB RLIMIT_AS): 384 MB in all.
# Six children each touch 64 MB, report on their own pipe, then hold it until every child
# has reported or died; only then are they released. Children that exit cleanly held their
# 64 MB at the same moment: ``held_mb`` is memory held at once, not memory ever touched (the
# OOM killer may pick a child that had already reported, and another then fits in its place).
FORKS_HOLD_MEMORY = """
import json, os
release_r, release_w = os.pipe()
reports = []
for _ in range(6):
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.close(release_w)
        block = bytearray(64 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(w, b'x')
        os.read(release_r, 1)  # EOF once the parent closes its end
        os._exit(0)
    os.close(w)
    reports.append(r)
os.close(release_r)
reported = sum(os.read(r, 1) == b'x' for r in reports)
os.close(release_w)
status = [os.wait()[1] for _ in range(6)]
clean = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in status)
killed = sum(os.WIFSIGNALED(s) for s in status)
print(json.dumps({'held_mb': 64 * clean, 'reported_mb': 64 * reported, 'killed': killed}))
"""


@pytest.mark.parametrize("mode", MODES)
async def test_memory_is_bounded_for_the_sandbox_as_a_whole(mode: str) -> None:
    limits: dict[str, Any] = {"memory_mb": 128, "disk_mb": 4, "max_processes": 6}
    if mode == "bwrap" and memory_cgroup_parent()[0] is None:
        pytest.skip(f"no memory cgroup here ({memory_cgroup_parent()[1]})")
    result = await run(FORKS_HOLD_MEMORY, mode, **limits)
    out = last_json(result)
    if mode == "process":
        assert out == {"held_mb": 384, "reported_mb": 384, "killed": 0} and result.ok, out
        return
    assert out["held_mb"] < 384 and out["killed"] > 0, out
    cgroup_mb = SandboxLimits(**limits, isolation="bwrap").cgroup_bytes >> 20  # 168
    assert out["held_mb"] < cgroup_mb and out["killed"] >= 6 - cgroup_mb // 64, out
    assert result.error == "memory", result.to_text()
    assert result.message == "Error: memory limit of 128 MB exceeded"


# ---------------------------------------------------------------------------- status channel

FORGED = json.dumps(
    {"kind": "exception", "detail": "FORGED " * 8500, "main": True, "returncode": 1}
)
# Writes a forged status record wherever the status pipe could be: under its name in the
# child program's __main__, every writable pipe among the code's own descriptors, and the
# descriptors of its parent when that is the sandbox's child program.
FORGE_STATUS = (
    DISARM
    + f"""
import fcntl, json, os, stat, sys
line = ({FORGED!r} + '\\n').encode()
out = {{'by_name': None, 'own_pipes': 0, 'parent': None}}
fd = getattr(sys.modules['__main__'], 'status_fd', None)
if fd is not None:
    os.write(fd, line)
    out['by_name'] = fd
for name in os.listdir('/proc/self/fd'):
    fd = int(name)
    try:
        writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        if fd > 2 and writable and stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, line)
            out['own_pipes'] += 1
    except OSError:
        pass
parent = os.getppid()
with open(f'/proc/{{parent}}/cmdline', 'rb') as f:
    argv = f.read().split(b'\\0')
if b'-c' in argv and b'-I' in argv:  # the sandbox's own child program, nothing else
    try:
        written = 0
        for name in os.listdir(f'/proc/{{parent}}/fd'):
            path = f'/proc/{{parent}}/fd/{{name}}'
            if name not in ('0', '1', '2') and stat.S_ISFIFO(os.stat(path).st_mode):
                w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                os.write(w, line)
                os.close(w)
                written += 1
        out['parent'] = written
    except OSError as e:
        out['parent'] = type(e).__name__
print(json.dumps(out))
print('done')
"""
)


@pytest.mark.parametrize("mode", MODES)
async def test_a_forged_status_record_is_impossible(mode: str) -> None:
    """The status pipe is held only by the child's monitor, which runs no code of the model
    and which no process of the sandbox may open; every record is bounded."""
    # Process mode without namespaces: the host's /proc then names the parent by its pid.
    options = {"use_namespaces": False} if mode == "process" else {}
    result = await run(FORGE_STATUS, mode, max_output_chars=8000, **options)
    assert len(result.to_text()) < 8000 + 1000, len(result.to_text())  # the output cap holds
    out = json.loads(result.stdout.splitlines()[0])
    assert out["by_name"] is None  # no name in __main__ leads to it
    if mode == "process":
        if not ROOT:
            pytest.skip("in process mode only root (CAP_SYS_PTRACE) opens the monitor's fds")
        assert out["parent"] >= 1  # root reaches the monitor's descriptors
        assert result.error == "exception" and "FORGED" in result.message
        return
    assert out["parent"] == "PermissionError", out  # the monitor is not dumpable
    assert result.ok and result.message == "" and result.stdout.endswith("done\n"), result


# ---------------------------------------------------------------------------- ptrace

PTRACE = """
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
targets = {'child': child, 'pid1': 1} if TRY_PID1 else {'child': child}
out = {}
for key, pid in targets.items():
    if libc.ptrace(0x4206, pid, None, None) == 0:  # PTRACE_SEIZE: attach without stopping
        out[key] = 'attached'
    else:
        out[key] = os.strerror(ctypes.get_errno())
os.kill(child, 9)
os.wait()
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", MODES)
async def test_ptrace_is_refused(mode: str) -> None:
    """ptrace would let a process of the sandbox take over another (its pid 1 included)."""
    # Process mode only traces its own fork; the host's pid 1 is none of the test's business.
    if mode == "bwrap" and seccomp_program() is None:
        pytest.skip("the seccomp filter is built for x86_64 and aarch64 only")
    code = PTRACE.replace("TRY_PID1", str(mode == "bwrap"))
    out = last_json(await run(code, mode, max_processes=2, timeout_s=10.0))
    if mode == "process":
        assert out == {"child": "attached"}
        return
    assert out == {"child": "Operation not permitted", "pid1": "Operation not permitted"}


# ---------------------------------------------------------------------------- files


@pytest.mark.parametrize("mode", MODES)
async def test_the_tmpfs_is_limited_in_files(mode: str) -> None:
    """Empty files cost no bytes but a kernel inode each (about 1 KB)."""
    if mode == "bwrap" and not tmpfs_file_limit():
        pytest.skip("the launcher mounts the tmpfs with a file limit only as root")
    code = """
import json, os
out = {}
for where in ('.', '/dev/shm'):
    made = 0
    try:
        for i in range(20000):
            os.close(os.open(f'{where}/f{i}', os.O_CREAT | os.O_WRONLY, 0o600))
            made += 1
    except OSError as e:
        out[where + ' error'] = e.strerror
    out[where] = made
    for i in range(made):
        os.remove(f'{where}/f{i}')
print(json.dumps(out))
"""
    if mode == "process":
        # In the host's temporary directory (removed after the run); /dev/shm is the host's.
        out = last_json(await run(code.replace("'/dev/shm'", ""), mode, disk_mb=4))
        assert out == {".": 20000}, out
        return
    out = last_json(await run(DISARM + code, mode, disk_mb=4))
    assert out["."] < 20000 and out["/dev/shm"] < 20000, out
    files = SandboxLimits(disk_mb=4).max_files  # 256, the root directory included
    assert out == {
        ".": files - 1,
        ". error": "No space left on device",
        "/dev/shm": files - 1,
        "/dev/shm error": "No space left on device",
    }, out
    result = await run("for i in range(1000):\n    open(f'f{i}', 'w').close()", mode, disk_mb=4)
    assert (result.error, result.message) == (
        "disk",
        f"Error: disk quota of {files} files exceeded",
    )
