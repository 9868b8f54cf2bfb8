"""The bubblewrap sandbox: the ``bwrap`` command that isolates a child, and the check that
it can run here.

:func:`bwrap_launch` builds the command prefix: fresh namespaces, a read-only root holding
only the system and Python directories, private tmpfs for the working directory and
``/dev/shm``, and, as root, privileges dropped by ``setpriv`` (with unreachable Python
directories staged through a private mount namespace). :func:`check_sandbox` starts one
sandbox per process to see that this works, and raises :class:`SandboxUnavailableError`
naming the fix when it does not. See :mod:`areal_agents.tools.sandbox` for what each limit
relies on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from areal_agents.tools.sandbox_limits import (
    ISOLATION_ENV,
    SandboxLimits,
    SandboxUnavailableError,
    default_isolation,
)

__all__ = [
    "BWRAP_WORK_DIR",
    "SANDBOX_PATH",
    "SANDBOX_UID",
    "BwrapLaunch",
    "bwrap_launch",
    "check_sandbox",
    "sandbox_verified",
]

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
# Run by /bin/sh in the launcher's private mount namespace: bind each unreachable Python
# directory onto its empty mount point, then exec the rest (setpriv ... bwrap ...).
_STAGE_SCRIPT = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind -- "$1" "$2" || exit 125; '
    'shift 2; n=$((n - 1)); done; exec "$@"'
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


def bwrap_launch(limits: SandboxLimits) -> BwrapLaunch:
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
            return BwrapLaunch(args)
        drop = [_which("setpriv"), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                "--clear-groups", "--inh-caps=-all", "--no-new-privs", "--"]  # fmt: skip
        if not stage:
            return BwrapLaunch([*drop, *args])
        launcher = [_which("unshare"), "--mount", "--propagation", "private", "--",
                    "/bin/sh", "-c", _STAGE_SCRIPT, "sh", str(len(stage) // 2), *stage]  # fmt: skip
        return BwrapLaunch([*launcher, *drop, *args], stage_root)
    except BaseException:
        BwrapLaunch([], stage_root).cleanup()
        raise


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
    try:
        done = subprocess.run(
            [*launch.prefix, sys.executable, "-I", "-S", "-c", "import os; print(os.getuid())"],
            capture_output=True,
            timeout=60,
            env={"PATH": SANDBOX_PATH, "LC_ALL": "C.UTF-8"},
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
