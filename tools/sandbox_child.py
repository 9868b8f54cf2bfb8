"""The program a sandboxed child runs: a monitor, then limits, the audit-hook guard and the
model's code in a fork of it.

The launcher (:mod:`areal_agents.tools.sandbox`) starts ``python -I -u -B -c CHILD_SOURCE work
status_fd config``, with the code on stdin. That process, the monitor, reads the code, makes
itself non-dumpable (no other process of the sandbox may open its ``/proc/PID/fd`` or
``mem``) and forks the runner, which closes the status pipe, applies the resource limits of
``config`` (:meth:`~areal_agents.tools.sandbox_limits.SandboxLimits.child_config`), installs an
audit hook (``sys.addaudithook``) that refuses sockets, writes outside ``work``, running
programs and forks beyond ``max_processes`` with precise messages, and runs the code as
``__main__``. The runner reports how the code ended (``kind``, ``detail``, its pid) on a
report pipe; the monitor runs no code of the model, reads that pipe as untrusted input
(bounded lines, known kinds, a report that does not match the runner's exit status is
dropped), waits for the runner, and writes the one status record the launcher reads:
``kind``, ``detail`` (at most 500 characters) and the runner's exit status. Stdlib only. The
hook is plain Python the code can switch off: no guarantee rests on it (the bubblewrap
sandbox, :mod:`areal_agents.tools.sandbox_bwrap`, is the boundary).
"""

from __future__ import annotations

__all__ = ["CHILD_SOURCE"]

CHILD_SOURCE = r"""
import builtins, ctypes, errno, json, linecache, os, resource, select, signal, sys, traceback
from _socket import AF_UNIX

KINDS = ("memory", "network", "write", "process", "program", "file_size", "disk",
         "exception", "exit")
LINE_CAP = 4096  # longer report lines are dropped
DETAIL_CAP = 500


def parse_report(line):
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    kind, detail, pid = rec.get("kind"), rec.get("detail", ""), rec.get("pid")
    if kind not in KINDS or not isinstance(detail, str) or type(pid) is not int:
        return None
    return {"kind": kind, "detail": detail[:DETAIL_CAP], "pid": pid}


def monitor(runner, report_r, status_fd):
    # Runs no code of the model. Waits for the runner, reads what it reported (the model's
    # code may have written there too, so it is checked and bounded), and writes the one
    # status record the launcher reads.
    os.set_blocking(report_r, False)
    try:
        pidfd = os.pidfd_open(runner)
    except (AttributeError, OSError):
        pidfd = -1
    found = {"own": None, "fork": None, "pending": b"", "skip": False}

    def drain():
        for _ in range(16):  # bounded: forks may keep writing
            try:
                chunk = os.read(report_r, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            lines = (found["pending"] + chunk).split(b"\n")
            found["pending"] = lines.pop()
            for line in lines:
                if found["skip"]:
                    found["skip"] = False
                    continue
                rec = parse_report(line)
                if rec is None:
                    continue
                if rec["pid"] == runner:
                    found["own"] = rec
                elif found["fork"] is None:
                    found["fork"] = rec
            if len(found["pending"]) > LINE_CAP:
                found["pending"], found["skip"] = b"", True
        return True

    reading, status = True, None
    while status is None:
        wait = ([pidfd] if pidfd >= 0 else []) + ([report_r] if reading else [])
        ready = select.select(wait, [], [], None if pidfd >= 0 else 0.02)[0]
        if report_r in ready:
            reading = drain()
        if pidfd < 0 or pidfd in ready:
            pid, waited = os.waitpid(runner, os.WNOHANG)
            if pid == runner:
                status = waited
    drain()
    returncode = os.waitstatus_to_exitcode(status)
    rec = found["own"] or found["fork"]
    kind, detail = None, ""
    # The runner exits 1 after an exception and N after sys.exit(N): a report that does not
    # match how it ended is not believed; a run that ended with status 0 succeeded.
    if rec is not None and returncode > 0:
        if (rec["detail"] == str(returncode)) if rec["kind"] == "exit" else returncode == 1:
            kind, detail = rec["kind"], rec["detail"]
    line = json.dumps({"kind": kind, "detail": detail, "returncode": returncode})
    os.write(status_fd, (line + "\n").encode())
    os._exit(returncode if returncode >= 0 else 128 - returncode)


def start():
    # The monitor: holds the status pipe, starts the runner, and never returns in itself.
    work, status_fd, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    code = sys.stdin.read()
    sys.stdin.close()
    os.chdir(work)
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
    if prctl is not None:
        prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: none may open its /proc/PID/fd or mem
    report_r, report_w = os.pipe()
    runner = os.fork()
    if runner == 0:
        os.close(report_r)
        os.close(status_fd)
        if prctl is not None:
            prctl(4, 1, 0, 0, 0)
        sys.stdin = open(os.devnull)
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # the runner and its forks are what the OOM killer takes
        except OSError:
            pass
        return code, cfg, work, report_w
    os.close(report_w)
    monitor(runner, report_r, status_fd)


code, cfg, work, report_fd = start()
del start, monitor
os.set_inheritable(report_fd, False)
main_pid = os.getpid()


def record(kind, detail=""):
    line = json.dumps({"kind": kind, "detail": detail[:DETAIL_CAP], "pid": os.getpid()})
    try:
        os.set_blocking(report_fd, False)
        os.write(report_fd, (line + "\n").encode())
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
        try:
            files_left = os.statvfs(work).f_favail
        except OSError:
            files_left = 1
        record("disk", "files" if files_left == 0 else "")
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
