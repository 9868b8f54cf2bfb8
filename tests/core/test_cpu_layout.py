"""CPU settings the CLI makes for a run: ``OMP_WAIT_POLICY=passive`` unless the user set it,
passed on to Ray's workers, and core lists written as positions among the cores the
process may use (``allowed[...]``, trainer/config_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_agents.errors import ConfigError
from areal_agents.trainer.config_checks import SHARED_LAYOUT, allowed_cores
from areal_agents.trainer.config_io import format_config, load_config

CALCULATOR = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator.yaml"
PRINT_AFTER_MAIN = (
    "import os; from areal_agents.cli.main import main; code = main(['envs']); "
    "print('OMP_WAIT_POLICY=' + os.environ.get('OMP_WAIT_POLICY', '<unset>'), code)"
)


def _main_in_a_subprocess(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(
        [sys.executable, "-c", PRINT_AFTER_MAIN],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        check=True,
    )
    return proc.stdout.splitlines()[-1]


def test_main_sets_a_passive_omp_wait_policy_unless_the_user_set_one():
    assert _main_in_a_subprocess() == "OMP_WAIT_POLICY=passive 0"
    assert _main_in_a_subprocess(OMP_WAIT_POLICY="active") == "OMP_WAIT_POLICY=active 0"


def test_ray_workers_of_the_job_get_the_omp_wait_policy(monkeypatch):
    cluster = pytest.importorskip("areal_agents.rollout.cluster")
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert cluster.connect("auto")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert cluster.connect("auto")
    assert calls == [
        {"address": "auto", "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "passive"}}},
        {"address": "auto", "runtime_env": None},
    ]


@pytest.fixture
def cores(monkeypatch):
    """Let this process seem to run on the given cores (``os.sched_getaffinity``)."""

    def set_cores(*allowed: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed), raising=False)

    return set_cores


def test_allowed_positions_pick_among_the_cores_the_process_may_use(cores):
    cores(9, 2, 5, 7)  # sorted: 2, 5, 7, 9
    assert allowed_cores("allowed[0]", "k") == (2,)
    assert allowed_cores("allowed[1]", "k") == (5,)
    assert allowed_cores("allowed[-1]", "k") == (9,)
    assert allowed_cores("allowed[1:3]", "k") == (5, 7)
    assert allowed_cores("allowed[2:]", "k") == (7, 9)
    assert allowed_cores(" allowed ", "k") == (2, 5, 7, 9)
    for bad in ("allowed[]", "allowed[a]", "first", "0", "allowed[0][1]"):
        with pytest.raises(ConfigError, match="expected a list of core numbers, or allowed"):
            allowed_cores(bad, "train.cpus")
    with pytest.raises(ConfigError, match=r"'allowed\[4\]' names no core: .* 4 cores"):
        allowed_cores("allowed[4]", "train.cpus")


def test_the_calculator_recipe_takes_the_first_two_allowed_cores(cores):
    cores(4, 6)  # a container or taskset that leaves cores 4 and 6, not 0 and 1
    cfg = load_config(CALCULATOR)
    assert cfg.rollout.engine_cpus == (4,)
    assert cfg.rollout.idle_engine_cpus == cfg.train.cpus == (6,)
    assert "allowed" not in format_config(cfg)  # the run directory records core numbers
    cfg = load_config(CALCULATOR, ["rollout.engine_cpus=allowed[:1]", "train.cpus=[6]"])
    assert (cfg.rollout.engine_cpus, cfg.train.cpus) == ((4,), (6,))


def test_one_core_names_the_shared_layout_which_then_loads(cores):
    cores(3)
    with pytest.raises(ConfigError) as err:
        load_config(CALCULATOR)
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == ["rollout.idle_engine_cpus", "train.cpus"]
    assert all("one core only (core 3)" in p and SHARED_LAYOUT in p for p in problems)
    cfg = load_config(CALCULATOR, SHARED_LAYOUT.split())
    assert cfg.scheduler == "local" and cfg.train.cpus is None
