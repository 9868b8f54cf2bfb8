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


PIN_SCRIPT = """
import os, sys, threading, time
import torch
from areal_agents.errors import ConfigError
from areal_agents.hardware import pin_to_cpus

core = int(sys.argv[1])
stop = threading.Event()
before = threading.Thread(target=stop.wait)  # a thread that exists before the pinning
before.start()
try:
    pin_to_cpus([os.cpu_count() + 3], "train.cpus")
except ConfigError as exc:
    print("refused:", exc)
assert pin_to_cpus([core], "train.cpus") == [core]
for tid in os.listdir("/proc/self/task"):
    assert os.sched_getaffinity(int(tid)) == {core}, tid
child = threading.Thread(target=lambda: print("child", sorted(os.sched_getaffinity(0))))
child.start(); child.join(); stop.set(); before.join()
print("threads", torch.get_num_threads())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="core pinning is Linux-only")
def test_pin_to_cpus_moves_every_thread_and_sets_torch_threads():
    """In a process of its own: threads that existed before and threads started after run on
    the named core, torch uses one thread, and a core that does not exist is refused with
    the config key and the usable cores named."""
    import subprocess
    import sys

    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", PIN_SCRIPT, str(core)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"child [{core}]" in out.stdout and "threads 1" in out.stdout
    assert (
        "refused: train.cpus: cores [" in out.stdout and "name cores from that list" in out.stdout
    )


IDLE_SCRIPT = """
import os, threading
from areal_agents.hardware import lowest_priority

stop = threading.Event()
before = threading.Thread(target=stop.wait)  # a thread that exists before the change
before.start()
lowest_priority("rollout.idle_engine_cpus")
for tid in os.listdir("/proc/self/task"):
    assert os.sched_getscheduler(int(tid)) == os.SCHED_IDLE, tid
def report():
    print("child idle", os.sched_getscheduler(0) == os.SCHED_IDLE)
child = threading.Thread(target=report)
child.start(); child.join(); stop.set(); before.join()
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_lowest_priority_moves_every_thread_to_sched_idle():
    """In a process of its own (this one keeps its priority): threads that existed before
    and threads started after run at SCHED_IDLE."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "child idle True" in out.stdout
