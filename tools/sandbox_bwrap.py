"""The bubblewrap sandbox: the ``bwrap`` command that isolates a child, and the check that
it can run here.

:func:`bwrap_launch` builds the command prefix: fresh namespaces, a read-only root holding
only the system and Python directories, private tmpfs for the working directory and
``/dev/shm`` (as root, mounted by the launcher with a file limit too), the seccomp filter of
:mod:`~areal_agents.tools.sandbox_seccomp`, a memory cgroup for the run where one can be made
(:mod:`~areal_agents.tools.sandbox_cgroup`), and, as root, privileges dropped by ``setpriv``
(with unreachable Python directories staged through a private mount namespace).
:func:`check_sandbox` starts one sandbox per process to see that this works, and raises
:class:`SandboxUnavailableError` naming the fix when it does not. Where the machine allows
less (no memory cgroup, no file limit, no seccomp filter for its architecture) a warning
says once what is not bounded. See :mod:`areal_agents.tools.sandbox` for what each limit
relies on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from areal_agents.tools.sandbox_cgroup import (
    MemoryCgroup,
    create_memory_cgroup,
    memory_cgroup_parent,
)
from areal_agents.tools.sandbox_limits import (
    ISOLATION_ENV,
    SandboxLimits,
    SandboxUnavailableError,
    default_isolation,
)
from areal_agents.tools.sandbox_seccomp import seccomp_program

__all__ = [
    "BWRAP_WORK_DIR",
    "SANDBOX_PATH",
    "SANDBOX_UID",
    "SETUP_MARKER",
    "BwrapLaunch",
    "bwrap_launch",
    "check_sandbox",
    "sandbox_verified",
    "setup_error",
    "setup_failure",
    "tmpfs_file_limit",
]

log = logging.getLogger(__name__)

SANDBOX_UID = 65534
"""The host uid (and gid) the code runs as when the caller is root (``nobody``)."""
BWRAP_WORK_DIR = "/sandbox"
"""The private working directory inside the bubblewrap sandbox."""
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
"""``PATH`` inside the bubblewrap sandbox."""
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # nothing secret, bound where present
_INSTALL = "apt-get install -y bubblewrap"
_FIX_HINT = {
    "bwrap": f"Install it with `{_INSTALL}` (Debian/Ubuntu; `dnf install bubblewrap` on "
    "Fedora), or opt into the weaker in-process sandbox with isolation='process' "
    f"({ISOLATION_ENV}=process).",
    "setpriv": "It is part of util-linux: `apt-get install -y util-linux`.",
    "unshare": "It is part of util-linux: `apt-get install -y util-linux`.",
}
SETUP_MARKER = "areal-sandbox-setup"
"""How the launcher's setup script starts its error line (then ``[token]:``; exit status
125). The token is the launch's own, so the code cannot print a setup failure."""
# Run by /bin/sh as the launcher (as root: in its private mount namespace): join the memory
# cgroup (if any), mount each tmpfs with its size and file limit, bind each unreachable
# Python directory onto its empty mount point, then exec the rest (setpriv ... bwrap ...).
# Arguments: token, cgroup.procs file or "", N, N (options, mount point) pairs, M, M
# (source, mount point) pairs, the command.
_SETUP_SCRIPT = (
    f'token=$1; shift; fail() {{ echo "{SETUP_MARKER}[$token]: $*" >&2; exit 125; }}; '
    'cg=$1; shift; if [ -n "$cg" ]; then '
    'echo $$ > "$cg" || fail "cannot join the memory cgroup ($cg)"; fi; '
    'n=$1; shift; while [ "$n" -gt 0 ]; do mount -n -t tmpfs -o "$1" tmpfs "$2" || '
    'fail "cannot mount a tmpfs on $2"; shift 2; n=$((n - 1)); done; '
    'n=$1; shift; while [ "$n" -gt 0 ]; do mount -n --bind -- "$1" "$2" || '
    'fail "cannot bind $1 onto $2"; shift 2; n=$((n - 1)); done; exec "$@"'
)


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
class BwrapLaunch:
    """How to start one bwrap sandbox: the command prefix, the descriptors it needs (the
    seccomp filter), its memory cgroup, and what to clean up after."""

    prefix: list[str]
    stage_root: str | None = None
    pass_fds: tuple[int, ...] = ()
    cgroup: MemoryCgroup | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(8))

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the kernel killed for memory (0 without a
        cgroup)."""
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def close_fds(self) -> None:
        """Close the launcher's copies of the descriptors (once the sandbox has started)."""
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pass_fds = ()

    def _remove_stage(self) -> None:
        if self.stage_root is None:
            return
        # Only empty mount points: the mounts on them live in the launcher's private mount
        # namespace, never in ours. rmdir (not rmtree) keeps it that way even if one leaked.
        for name in sorted(os.listdir(self.stage_root), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.stage_root, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.stage_root)
        self.stage_root = None

    def cleanup(self) -> None:
        """Close the descriptors, remove the memory cgroup (killing what is left in it) and
        the staging directory."""
        self.close_fds()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        self._remove_stage()

    async def acleanup(self) -> None:
        """:meth:`cleanup` without blocking the event loop."""
        self.close_fds()
        if self.cgroup is not None:
            await self.cgroup.aremove()
            self.cgroup = None
        self._remove_stage()


def _which(program: str) -> str:
    path = shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/bin:/bin:/usr/sbin")
    if path is None:
        raise SandboxUnavailableError(
            f"the Python sandbox needs `{program}`, which is not installed. {_FIX_HINT[program]}"
        )
    return path


def _readable_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (small enough for the pipe buffer), then EOF."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


_warned = False


def _warn_weaker(seccomp: bool, cgroup: bool, file_limit: bool) -> None:
    """Log once what this machine's sandbox does not bound (see docs/envs.md, "The Python
    sandbox")."""
    global _warned
    gaps = []
    if not cgroup:
        why = memory_cgroup_parent()[1]
        denied = (
            "the seccomp filter refuses memfd_create and SysV shmget, and the tmpfs are "
            "bounded by disk_mb, but"
            if seccomp
            else "and"
        )
        gaps.append(
            f"no memory cgroup ({why}): memory is bounded per process (RLIMIT_AS), not as a "
            f"whole; {denied} other kernel memory (pipe buffers, sockets) and the sum over "
            "the sandbox's processes are not bounded. Run as root on a machine that mounts "
            "the cgroup memory controller read-write, or delegate a cgroup v2 subtree with "
            "the memory controller to this user"
        )
    if not seccomp:
        gaps.append(
            "no seccomp filter for this architecture (x86_64 and aarch64 only): ptrace, "
            "memfd_create and SysV shared memory are allowed in the sandbox"
        )
    if not file_limit:
        gaps.append(
            "the tmpfs are limited in bytes, not in files (the launcher mounts them with a "
            "file limit only as root, with CAP_SYS_ADMIN for a private mount namespace)"
        )
    if gaps and not _warned:
        _warned = True
        log.warning("The Python sandbox has weaker guarantees here: %s.", "; ".join(gaps))


@functools.cache
def _root_can_mount() -> bool:
    """Whether the launcher (root) can mount a tmpfs in a private mount namespace."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if unshare is None:
        return False
    point = tempfile.mkdtemp(prefix="areal-sandbox-probe-", dir="/tmp")
    try:
        done = subprocess.run(
            [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
             'mount -n -t tmpfs -o size=65536,nr_inodes=16 tmpfs "$1"', "sh", point],
            capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(point)


def tmpfs_file_limit() -> bool:
    """Whether the sandbox's tmpfs are limited in files as well as bytes here (the launcher
    mounts them itself: root, allowed a private mount namespace)."""
    return os.geteuid() == 0 and _root_can_mount()


def _stage_dir() -> str:
    stage_root = tempfile.mkdtemp(prefix="areal-sandbox-stage-", dir="/tmp")
    os.chmod(stage_root, 0o755)
    return stage_root


def bwrap_launch(limits: SandboxLimits) -> BwrapLaunch:
    """The command that runs a program under bubblewrap, as an unprivileged user.

    bwrap loads the seccomp filter of :mod:`~areal_agents.tools.sandbox_seccomp`. Where a
    memory cgroup can be made (:mod:`~areal_agents.tools.sandbox_cgroup`) the launcher joins
    it first (``/bin/sh``), so the whole sandbox is in it. As root, the launcher runs in a
    private mount namespace (``unshare``) where it mounts the two tmpfs (size and file limit)
    and binds Python installation directories the sandbox user cannot reach
    (``/root/.pyenv``) onto empty, world-readable mount points; bwrap binds them from there,
    and no mount is made in the caller's namespace. Then privileges are dropped to
    :data:`SANDBOX_UID` (bwrap run by root would map the sandbox user to host root).
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(
            "the bubblewrap sandbox needs Linux; on this system only "
            f"isolation='process' (or {ISOLATION_ENV}=process) is available"
        )
    bwrap = _which("bwrap")
    disk = str(limits.disk_mb * 1024 * 1024)
    root = os.geteuid() == 0
    args = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--hostname", "sandbox", *_system_binds(),
        "--proc", "/proc", "--dev", "/dev",
    ]  # fmt: skip
    launch = BwrapLaunch([])
    try:
        program = seccomp_program()
        if program is not None:
            launch.pass_fds = (_readable_fd(program),)
            args += ["--seccomp", str(launch.pass_fds[0])]  # every bwrap version has it
        try:
            launch.cgroup = create_memory_cgroup(limits.cgroup_bytes)
        except OSError as exc:
            raise SandboxUnavailableError(
                f"could not create the sandbox's memory cgroup: {exc}. It worked when this "
                "process started; check what removed or filled the cgroup hierarchy "
                "(`cat /proc/self/cgroup`), or opt into the weaker in-process sandbox with "
                f"isolation='process' ({ISOLATION_ENV}=process)."
            ) from exc
        file_limit = tmpfs_file_limit()
        _warn_weaker(program is not None, launch.cgroup is not None, file_limit)
        tmpfs: list[str] = []  # (options, mount point) pairs, mounted by the launcher
        binds: list[str] = []  # (source, mount point) pairs, bound by the launcher
        if file_limit:
            launch.stage_root = _stage_dir()
            for name, dest, mode in (("shm", "/dev/shm", "1777"), ("work", BWRAP_WORK_DIR, "700")):
                point = os.path.join(launch.stage_root, name)
                os.mkdir(point, 0o755)
                tmpfs += [f"size={disk},nr_inodes={limits.max_files},mode={mode},"
                          f"uid={SANDBOX_UID},gid={SANDBOX_UID},nosuid,nodev", point]  # fmt: skip
                args += ["--bind", point, dest]
        else:
            args += ["--size", disk, "--tmpfs", "/dev/shm", "--size", disk, "--tmpfs",
                     BWRAP_WORK_DIR]  # fmt: skip
        args += ["--chdir", BWRAP_WORK_DIR]
        for path in _python_paths():
            source = path
            if root and not _reachable_by(path, SANDBOX_UID, SANDBOX_UID):
                if launch.stage_root is None:
                    launch.stage_root = _stage_dir()
                source = os.path.join(launch.stage_root, str(len(binds) // 2))
                os.mkdir(source, 0o755)
                binds += [path, source]
            args += ["--ro-bind", source, path]
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--"]
        if root:
            drop = [_which("setpriv"), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                    "--clear-groups", "--inh-caps=-all", "--no-new-privs", "--"]  # fmt: skip
            args = [*drop, *args]
        if tmpfs or binds or launch.cgroup is not None:
            procs = launch.cgroup.procs_file if launch.cgroup is not None else ""
            setup = ["/bin/sh", "-c", _SETUP_SCRIPT, "sh", launch.token, procs,
                     str(len(tmpfs) // 2), *tmpfs, str(len(binds) // 2), *binds]  # fmt: skip
            if tmpfs or binds:
                setup = [_which("unshare"), "--mount", "--propagation", "private", "--", *setup]
            args = [*setup, *args]
        launch.prefix = args
        return launch
    except BaseException:
        launch.cleanup()
        raise


def setup_error(failure: str) -> str:
    """The message of :class:`SandboxUnavailableError` for a failed launcher setup."""
    return (
        f"the sandbox's launcher could not set it up: {failure}. Check that this process "
        "may write to its memory cgroup and mount in a private mount namespace (root with "
        f"CAP_SYS_ADMIN), or opt into the weaker in-process sandbox with isolation='process' "
        f"({ISOLATION_ENV}=process)."
    )


def setup_failure(stderr: str, token: str) -> str | None:
    """The launcher's own failure (joining the cgroup, mounting), if ``stderr`` reports one
    with the launch's ``token``."""
    marker = f"{SETUP_MARKER}[{token}]:"
    for line in stderr.splitlines():
        if line.startswith(marker):
            return line[len(marker) :].strip()
    return None


_verified: set[tuple[int, str]] = set()  # (euid, interpreter) pairs that passed the check


def sandbox_verified() -> bool:
    """Whether :func:`check_sandbox` has passed in this process (for this user and Python)."""
    return (os.geteuid(), sys.executable) in _verified


def check_sandbox(isolation: str | None = None) -> None:
    """Check that ``isolation`` (default: :func:`default_isolation`) can run here.

    For ``"bwrap"`` this starts one sandbox (once per process; about 40 ms) and raises
    :class:`SandboxUnavailableError`, naming the fix, when bubblewrap is missing or cannot
    create its namespaces. ``"process"`` always passes.
    """
    mode = SandboxLimits(isolation=isolation or default_isolation()).isolation
    if mode != "bwrap" or sandbox_verified():
        return
    launch = bwrap_launch(SandboxLimits(isolation="bwrap"))
    probe = f"import os; open({BWRAP_WORK_DIR + '/probe'!r}, 'w').close(); print(os.getuid())"
    try:
        done = subprocess.run(
            [*launch.prefix, sys.executable, "-I", "-S", "-c", probe],
            capture_output=True,
            timeout=60,
            env={"PATH": SANDBOX_PATH, "LC_ALL": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            pass_fds=launch.pass_fds,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailableError(f"bubblewrap could not be started: {exc}") from exc
    finally:
        launch.cleanup()
    uid = done.stdout.decode(errors="replace").strip()
    failure = setup_failure(done.stderr.decode(errors="replace"), launch.token)
    if failure is not None:
        raise SandboxUnavailableError(setup_error(failure))
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
