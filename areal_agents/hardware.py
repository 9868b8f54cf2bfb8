"""Which weight dtype ``"auto"`` means on this machine, and pinning a process to CPU cores.

bfloat16 halves the memory traffic of a forward pass and is the faster choice where the
hardware computes it natively: CUDA devices with bf16 support, x86 CPUs with AVX512-BF16
or AMX, Arm CPUs with the BF16 extension. On a CPU without them (AVX2 only, say) PyTorch
emulates bfloat16 matrix products and a forward pass runs tens to hundreds of times slower
than in float32, so ``"auto"`` picks float32 there, and an explicit ``bfloat16`` on such a
CPU gets a warning that names the fix.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from areal_agents.errors import ConfigError

__all__ = ["cpu_flags", "default_device", "native_bf16", "pin_to_cpus", "resolve_dtype"]

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# /proc/cpuinfo flags of CPUs with bfloat16 arithmetic: x86 (AVX512-BF16, AMX) and Arm (BF16)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def default_device(device: str | None = None) -> str:
    """``device`` itself, or ``"cuda"`` when a CUDA device is available, else ``"cpu"``."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); empty
    where that file does not exist (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: str) -> bool:
    """True when ``device`` (``cpu``, ``cuda``, ``cuda:N``) computes bfloat16 natively."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.startswith("cpu"):
        return bool(cpu_flags() & _BF16_FLAGS)
    return False


def resolve_dtype(dtype: str, device: str, *, low_precision_ok: bool = True) -> str:
    """The dtype to load weights in: ``dtype`` itself unless it is ``"auto"``, which is
    ``"bfloat16"`` where :func:`native_bf16` holds and ``low_precision_ok`` (weights that
    are only read, or frozen under a LoRA adapter), else ``"float32"``.

    An explicit ``"bfloat16"`` on a CPU without native support is kept, with a warning."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if low_precision_ok and native_bf16(device) else "float32"
    if dtype == "bfloat16" and device.startswith("cpu") and not native_bf16(device):
        _warn_slow_bf16()
    return dtype


@functools.cache
def _warn_slow_bf16() -> None:
    log.warning(
        "dtype bfloat16 on a CPU without native bfloat16 (no avx512_bf16, amx_bf16 or bf16 "
        "flag in /proc/cpuinfo): PyTorch emulates it and runs far slower than float32; set "
        "the dtype to auto or float32"
    )


def pin_to_cpus(cpus: Sequence[int], what: str) -> list[int]:
    """Run this whole process on the CPU cores ``cpus`` and use that many torch threads.

    Linux's ``sched_setaffinity`` applies to one thread, so every thread the process has
    now (``/proc/self/task``) is moved; threads and child processes started later inherit
    the mask of the thread that starts them. ``what`` names the config key in the error
    when a core does not exist or this process may not run there. Returns the sorted cores.
    """
    wanted = sorted({int(c) for c in cpus})
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{what}: pinning to CPU cores needs Linux; remove {what}")
    count = os.cpu_count() or 1
    try:
        if not wanted or wanted[-1] >= count:
            raise OSError("no such core")
        os.sched_setaffinity(0, wanted)  # the calling thread first: the error, if any, is here
    except OSError:
        raise ConfigError(
            f"{what}: cores {wanted} are not all usable here (this machine has cores 0-"
            f"{count - 1}, this process may run on {sorted(os.sched_getaffinity(0))}); "
            "name cores from that list"
        ) from None
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, wanted)
    torch.set_num_threads(len(wanted))
    return wanted


def lowest_priority(what: str) -> None:
    """Run this whole process at the lowest CPU priority Linux has (``SCHED_IDLE``): it
    gets a core only when nothing else there wants it, and gives it up at once when
    something does. Every thread it has now is moved; threads started later inherit it.
    ``what`` names the config key in the error where the OS does not allow it."""
    if not hasattr(os, "SCHED_IDLE"):
        raise ConfigError(f"{what}: the idle CPU priority (SCHED_IDLE) needs Linux; remove {what}")
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        raise ConfigError(
            f"{what}: this process may not take the idle CPU priority ({exc}); remove {what}"
        ) from None
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _threads() -> list[int]:
    """This process's thread ids now (``/proc/self/task``; none where there is no /proc)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
