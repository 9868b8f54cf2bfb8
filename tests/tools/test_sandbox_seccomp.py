"""The sandbox's seccomp filter, loaded here into a helper process without bubblewrap: the
calls it refuses fail with EPERM, other ABIs are refused, everything else still works."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from areal_agents.tools.sandbox_seccomp import DENIED_SYSCALLS, seccomp_program

# Installs the filter given as hex on argv[1] (no_new_privs first, as bwrap does), then
# tries the calls the sandbox's code could use.
LOAD_AND_TRY = r"""
import ctypes, json, os, sys
program = bytes.fromhex(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)

class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

buffer = ctypes.create_string_buffer(program)
fprog = Fprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER

def errno_of(result):
    return 'ok' if result >= 0 else os.strerror(ctypes.get_errno())

out = {}
try:
    os.close(os.memfd_create('x'))
    out['memfd_create'] = 'ok'
except OSError as e:
    out['memfd_create'] = e.strerror
out['shmget'] = errno_of(libc.shmget(0, 4096, 0o1600))
out['ptrace'] = errno_of(libc.ptrace(0x4206, os.getppid(), None, None))  # PTRACE_SEIZE
if os.uname().machine == 'x86_64':  # the x32 ABI's memfd_create: the same call, bit 30 set
    out['x32_memfd_create'] = errno_of(libc.syscall(0x40000000 + 319, b'x', 0))
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
r, w = os.pipe()
os.write(w, b'x')
out['fork_and_pipe'] = 'ok' if os.read(r, 1) == b'x' else 'no'
print(json.dumps(out))
"""


def test_the_program_is_built_for_both_architectures() -> None:
    for machine in ("x86_64", "aarch64", "amd64", "arm64"):
        program = seccomp_program(machine)
        assert program is not None and len(program) % 8 == 0
        # load arch, check arch, load nr, one check per call (+ x32 on x86_64), allow, deny
        extra = 1 if machine in ("x86_64", "amd64") else 0
        assert len(program) // 8 == 3 + extra + len(DENIED_SYSCALLS) + 2
    assert seccomp_program("riscv64") is None


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or seccomp_program() is None,
    reason=f"the filter is built for Linux on x86_64 and aarch64, not {platform.machine()}",
)
def test_the_filter_refuses_the_listed_calls_and_allows_the_rest() -> None:
    program = seccomp_program()
    assert program is not None
    done = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_AND_TRY, program.hex()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    denied = "Operation not permitted"
    assert out.pop("memfd_create") == out.pop("shmget") == out.pop("ptrace") == denied
    if platform.machine() == "x86_64":
        assert out.pop("x32_memfd_create") == denied
    assert out == {"fork_and_pipe": "ok"}
