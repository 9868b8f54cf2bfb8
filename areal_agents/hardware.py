"""Which weight dtype ``"auto"`` means on this machine.

bfloat16 halves the memory traffic of a forward pass and is the faster choice where the
hardware computes it natively: CUDA devices with bf16 support, x86 CPUs with AVX512-BF16
or AMX, Arm CPUs with the BF16 extension. On a CPU without them (AVX2 only, say) PyTorch
emulates bfloat16 matrix products and a forward pass runs tens to hundreds of times slower
than in float32, so ``"auto"`` picks float32 there, and an explicit ``bfloat16`` on such a
CPU gets a warning that names the fix.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

__all__ = ["cpu_flags", "default_device", "native_bf16", "resolve_dtype"]

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
