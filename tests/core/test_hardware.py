"""dtype "auto": bfloat16 only where the hardware computes it natively."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from areal_agents import hardware


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags that hardware sees."""

    def set_flags(*names: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(names))

    return set_flags


@pytest.mark.parametrize(
    ("names", "native"),
    [
        (("fpu", "avx2", "fma"), False),  # AVX2 only: bfloat16 is emulated
        (("avx2", "avx512f", "avx512_bf16"), True),
        (("avx2", "amx_bf16", "amx_tile"), True),
        (("fp", "asimd", "bf16"), True),  # Arm Features
        ((), False),  # no /proc/cpuinfo
    ],
)
def test_native_bf16_on_cpu_follows_the_flags(flags, names, native):
    flags(*names)
    assert hardware.native_bf16("cpu") is native
    assert hardware.resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")


def test_auto_keeps_float32_for_trained_weights(flags):
    flags("amx_bf16")
    assert hardware.resolve_dtype("auto", "cpu", low_precision_ok=False) == "float32"
    assert hardware.resolve_dtype("auto", "cpu", low_precision_ok=True) == "bfloat16"


def test_explicit_dtype_is_kept_and_slow_bfloat16_warns(flags, caplog):
    flags("avx2")
    hardware._warn_slow_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="areal_agents.hardware"):
        assert hardware.resolve_dtype("float32", "cpu") == "float32"
        assert not caplog.records
        assert hardware.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert "set the dtype to auto or float32" in caplog.text
    with pytest.raises(ValueError, match="dtype must be one of"):
        hardware.resolve_dtype("bf16", "cpu")


def test_cpu_flags_reads_this_machine():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo on this system")
    hardware.cpu_flags.cache_clear()
    found = hardware.cpu_flags()
    assert isinstance(found, frozenset)
    # every Linux x86 or Arm machine lists some flag; elsewhere the set is empty
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert bool(found) == ("flags" in text or "Features" in text)


def test_default_device_keeps_a_given_one():
    assert hardware.default_device("cpu") == "cpu"
    assert hardware.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
