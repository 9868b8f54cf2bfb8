"""A memory cgroup per sandboxed run: all of the sandbox's memory, shared memory included.

Where this process may create child cgroups of its own memory cgroup (as root on a machine
that mounts the memory controller read-write; or a cgroup v2 subtree delegated to the user),
:func:`create_memory_cgroup` makes one for a run: ``memory.limit_in_bytes`` (cgroup v1, with
``memory.memsw.limit_in_bytes`` where swap is accounted) or ``memory.max`` (cgroup v2, with
``memory.swap.max = 0``). The launcher moves itself into it before it starts bubblewrap, so
every process of the sandbox is in it; the kernel charges their pages there, memfds, SysV
segments and tmpfs files included, and kills a process of the group (the OOM killer) when
the limit is reached. :meth:`MemoryCgroup.oom_kills` tells the launcher that this happened,
and :meth:`MemoryCgroup.remove` kills what is left and removes the cgroup after the run.

:func:`memory_cgroup_parent` finds the place once per process and says why there is none
(read-only mount, no memory controller, cgroup v2 without delegation) otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass

__all__ = ["CgroupParent", "MemoryCgroup", "create_memory_cgroup", "memory_cgroup_parent"]

_PREFIX = "areal-sandbox-"


@dataclass(frozen=True)
class CgroupParent:
    """Where run cgroups are created: a directory of the cgroup filesystem (this process's
    own memory cgroup) and the cgroup version (1 or 2)."""

    path: str
    version: int


@dataclass
class MemoryCgroup:
    """One run's memory cgroup (a directory of the cgroup filesystem)."""

    path: str
    version: int

    @property
    def procs_file(self) -> str:
        """The file a process writes its pid to in order to join the cgroup."""
        return os.path.join(self.path, "cgroup.procs")

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this cgroup."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        path = os.path.join(self.path, name)
        with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def _pids(self) -> list[int]:
        with contextlib.suppress(OSError, ValueError), open(self.procs_file, encoding="ascii") as f:
            return [int(line) for line in f if line.strip()]
        return []

    def _kill_all(self) -> None:
        kill_file = os.path.join(self.path, "cgroup.kill")  # cgroup v2, Linux 5.14+
        if self.version == 2 and os.path.exists(kill_file):
            with contextlib.suppress(OSError):
                _write(kill_file, "1")
            return
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _try_remove(self, attempt: int) -> bool:
        try:
            os.rmdir(self.path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if attempt >= 5:  # the sandbox dies with its launcher; kill what lingers
                self._kill_all()
            return False

    def remove(self, wait_s: float = 5.0) -> bool:
        """Remove the cgroup once its processes are gone (killing any left after a moment)."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while not self._try_remove(attempt):
            if time.monotonic() > deadline:
                return False
            attempt += 1
            time.sleep(0.01)
        return True

    async def aremove(self, wait_s: float = 5.0) -> bool:
        """:meth:`remove` without blocking the event loop."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while not self._try_remove(attempt):
            if time.monotonic() > deadline:
                return False
            attempt += 1
            await asyncio.sleep(0.01)
        return True


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _unescape(field: str) -> str:
    """A mountinfo path field (spaces and the like are written as octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _own_cgroups() -> tuple[str | None, str | None]:
    """This process's cgroup path in the v1 memory hierarchy and in the v2 one."""
    v1 = v2 = None
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                v2 = parts[2]
            elif "memory" in parts[1].split(","):
                v1 = parts[2]
    return v1, v2


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(fstype, mount root, mount point, super options) of each cgroup mount."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, sep, right = line.rstrip("\n").partition(" - ")
            fields, extra = left.split(), right.split()
            if not sep or len(fields) < 5 or len(extra) < 3:
                continue
            if extra[0] in ("cgroup", "cgroup2"):
                root, point = _unescape(fields[3]), _unescape(fields[4])
                found.append((extra[0], root, point, extra[2].split(",")))
    return found


def _directory(own: str, root: str, point: str) -> str | None:
    if root == "/":
        rel = own
    elif own == root or own.startswith(root.rstrip("/") + "/"):
        rel = own[len(root) :]
    else:
        return None
    path = os.path.normpath(point + "/" + rel.lstrip("/"))
    return path if os.path.isdir(path) else None


def _probe(parent: CgroupParent) -> str:
    """Create, limit and remove a child cgroup; ``""`` if that works, else why not."""
    probe = os.path.join(parent.path, f"{_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup in {parent.path}: {exc.strerror}"
    try:
        limit = "memory.limit_in_bytes" if parent.version == 1 else "memory.max"
        if not os.path.exists(os.path.join(probe, limit)):
            return f"the memory controller is not enabled for the children of {parent.path}"
        _write(os.path.join(probe, limit), str(64 << 20))
        return ""
    except OSError as exc:
        return f"cannot set a memory limit in {parent.path}: {exc.strerror}"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def _enable_v2_memory(path: str) -> None:
    """Enable the memory controller for the children of ``path`` (cgroup v2), if allowed."""
    with contextlib.suppress(OSError):
        with open(os.path.join(path, "cgroup.controllers"), encoding="ascii") as f:
            if "memory" not in f.read().split():
                return
        with open(os.path.join(path, "cgroup.subtree_control"), encoding="ascii") as f:
            if "memory" in f.read().split():
                return
        _write(os.path.join(path, "cgroup.subtree_control"), "+memory")


@functools.cache
def memory_cgroup_parent() -> tuple[CgroupParent | None, str]:
    """Where run cgroups are created (cgroup v1 memory controller first, else v2), and
    ``""``; or ``None`` and why no memory cgroup can be used here."""
    if not os.path.isdir("/sys/fs/cgroup"):
        return None, "this system has no cgroup filesystem"
    own_v1, own_v2 = _own_cgroups()
    reasons: list[str] = []
    candidates: list[CgroupParent] = []
    for fstype, root, point, options in _mounts():
        if fstype == "cgroup" and own_v1 is not None and "memory" in options:
            path = _directory(own_v1, root, point)
            if path is not None:
                candidates.append(CgroupParent(path, 1))
        elif fstype == "cgroup2" and own_v2 is not None:
            path = _directory(own_v2, root, point)
            if path is not None:
                _enable_v2_memory(path)
                candidates.append(CgroupParent(path, 2))
    for parent in candidates:
        why = _probe(parent)
        if not why:
            return parent, ""
        reasons.append(why)
    if not candidates:
        reasons.append("no memory cgroup of this process is mounted under /sys/fs/cgroup")
    return None, "; ".join(dict.fromkeys(reasons))


def create_memory_cgroup(limit_bytes: int) -> MemoryCgroup | None:
    """A new cgroup limited to ``limit_bytes`` of memory (swap none), or ``None`` where
    :func:`memory_cgroup_parent` found no place for it."""
    parent, _ = memory_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent.path, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    group = MemoryCgroup(path, parent.version)
    try:
        if parent.version == 1:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
            memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # swap accounted: memory + swap together, no swap
                _write(memsw, str(limit_bytes))
        else:
            _write(os.path.join(path, "memory.max"), str(limit_bytes))
            swap = os.path.join(path, "memory.swap.max")
            if os.path.exists(swap):
                _write(swap, "0")
    except BaseException:
        group.remove(wait_s=0)
        raise
    return group
