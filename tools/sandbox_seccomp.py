"""The seccomp filter of the bubblewrap sandbox, assembled as classic BPF.

bubblewrap loads it (``--seccomp FD``) into the sandboxed program before it starts; every
process of the sandbox inherits it and none can remove it. It refuses, with ``EPERM``:

- ``ptrace``, ``process_vm_readv``, ``process_vm_writev`` and ``pidfd_getfd``: no process of
  the sandbox can read, write or take over another one (the sandbox's own monitor and its
  pid 1 included), nor copy its descriptors;
- ``memfd_create``, ``memfd_secret`` and ``shmget``: memory that no process maps (a memfd
  written with ``write()``, a SysV segment detached again) escapes ``RLIMIT_AS``; without
  these calls the code can hold shared memory only in its tmpfs, which the disk quota bounds;
- every system call of another ABI (32-bit ``int 0x80`` on x86_64, the x32 ABI, AArch32),
  whose numbers differ and would bypass the list.

The filter is built for x86_64 and AArch64 (:func:`seccomp_program` returns ``None`` on
other machines); the numbers are those of the kernel's syscall tables.
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["DENIED_SYSCALLS", "seccomp_program"]

DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "memfd_create",
    "memfd_secret",
    "shmget",
)
"""The system calls the filter refuses with ``EPERM``."""

_X86_64 = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    "memfd_create": 319,
    "memfd_secret": 447,
    "shmget": 29,
}
_AARCH64 = {
    "ptrace": 117,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "pidfd_getfd": 438,
    "memfd_create": 279,
    "memfd_secret": 447,
    "shmget": 194,
}
_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_AARCH64 = 0xC00000B7
# machine -> (AUDIT_ARCH_* value, syscall numbers)
_ARCHES = {"x86_64": (_AUDIT_ARCH_X86_64, _X86_64), "aarch64": (_AUDIT_ARCH_AARCH64, _AARCH64)}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
_X32_SYSCALL_BIT = 0x40000000  # x86_64: x32-ABI calls carry this bit in their number

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = the 32-bit word at offset k of seccomp_data
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_OFFSET_NR = 0  # struct seccomp_data: int nr; __u32 arch; ...
_OFFSET_ARCH = 4
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    """One ``struct sock_filter`` (u16 code, u8 jt, u8 jf, u32 k), in native byte order."""
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The filter as bubblewrap reads it (an array of ``struct sock_filter``).

    Args:
        machine: the architecture (``platform.machine()`` when ``None``).

    Returns:
        The program, or ``None`` where the machine is neither x86_64 nor AArch64.
    """
    name = (machine or platform.machine()).lower()
    arch = _ARCHES.get(_ALIASES.get(name, name))
    if arch is None:
        return None
    audit_arch, numbers = arch
    # Each check jumps forward to the final "deny" instruction; `deny_at` is its index.
    checks: list[tuple[int, int]] = []  # (opcode, k) of the jumps that deny on a match
    if audit_arch == _AUDIT_ARCH_X86_64:
        checks.append((_JGE_K, _X32_SYSCALL_BIT))
    checks += [(_JEQ_K, numbers[name]) for name in DENIED_SYSCALLS]
    deny_at = 3 + len(checks) + 1  # ld arch, jeq arch, ld nr, the checks, allow, deny
    program = [
        _insn(_LD_W_ABS, 0, 0, _OFFSET_ARCH),
        _insn(_JEQ_K, 0, deny_at - 2, audit_arch),  # another ABI: deny
        _insn(_LD_W_ABS, 0, 0, _OFFSET_NR),
    ]
    for i, (opcode, k) in enumerate(checks):
        program.append(_insn(opcode, deny_at - (3 + i) - 1, 0, k))
    program.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    program.append(_insn(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    return b"".join(program)
