"""examples/agents/algorithms/: one documented config per algorithm, each one a valid run,
and variants named ``<algorithm>_<variant>.yaml`` (an advantage estimator other than the
algorithm's own: ``grpo_step_groups``, ``ppo_turn_gae``).

A new algorithm in ``areal_agents.trainer.algorithms`` without a config here fails
``test_one_config_per_algorithm``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_agents.trainer.algorithms import ALGORITHMS
from areal_agents.trainer.config_io import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "agents" / "algorithms"
VARIANTS = {"grpo_step_groups": "grpo", "ppo_turn_gae": "ppo"}
"""Config name -> its algorithm, for the configs that are not an algorithm's own."""


def test_one_config_per_algorithm():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(ALGORITHMS) | set(VARIANTS)
    assert not [p.name for p in CONFIGS.iterdir() if p.suffix != ".yaml"]


_DRY_RUNS = """
import contextlib, io, json, sys, traceback
from areal_agents.cli.main import main
runs = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--config", path, "--dry-run"])
        except SystemExit as exc:  # argparse's errors
            code = exc.code
        except Exception:  # what python -m would print before exiting 1
            traceback.print_exc()
            code = 1
    runs[path] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, dict]:
    """``areal-agent train --config <path> --dry-run`` for every config, one after another in
    one fresh process (the command line's ``main``, as ``python -m areal_agents.cli.main``
    runs it): its exit status, stdout and stderr by config path."""
    import json

    paths = sorted(str(p) for p in CONFIGS.glob("*.yaml"))
    proc = subprocess.run(
        [sys.executable, "-c", _DRY_RUNS, *paths],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", sorted(ALGORITHMS) + sorted(VARIANTS))
def test_config_is_a_short_lora_calculator_run_and_passes_dry_run(name, dry_runs):
    path = CONFIGS / f"{name}.yaml"
    cfg = load_config(path)
    algorithm = VARIANTS.get(name, name)
    assert cfg.algorithm == algorithm
    assert (cfg.advantage.estimator is not None) == (name in VARIANTS)
    assert cfg.env.id == "areal/Calculator-v0"
    assert cfg.model.path is None and cfg.model.lora.enabled  # the default model, LoRA
    assert cfg.train.steps <= 20 and cfg.train.output_dir == f"runs/{name}"
    text = path.read_text()
    assert text.startswith("# ") and f"--config examples/agents/algorithms/{name}.yaml" in text
    out = dry_runs[str(path)]
    assert out["returncode"] == 0, out["stderr"]
    assert f"algorithm: {algorithm}\n" in out["stdout"]
