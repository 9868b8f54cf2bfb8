"""``train.if_exists``: a directory that holds a run is refused (naming the ways on), or with
``new`` the run goes to the first free ``DIR-2``, ``DIR-3``, ...; ``--dry-run`` shows which."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_agents.errors import ConfigError
from areal_agents.run_state import claim_run_dir

ROOT = Path(__file__).resolve().parents[2]


def test_claim_refuses_or_takes_the_next_free_directory(tmp_path: Path) -> None:
    run = tmp_path / "quick"
    assert claim_run_dir(run, resume=False) == run  # nothing there yet
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"pass --resume .* train.if_exists=new"):
        claim_run_dir(run, resume=False)
    assert claim_run_dir(run, resume=True) == run  # a resume continues it
    assert claim_run_dir(run, resume=False, if_exists="new") == tmp_path / "quick-2"
    (tmp_path / "quick-2").mkdir()
    (tmp_path / "quick-2" / "run.json").write_text("{}")  # killed before its first checkpoint
    (tmp_path / "quick-3").mkdir()  # an empty directory holds no run
    assert claim_run_dir(run, resume=False, if_exists="new") == tmp_path / "quick-3"


def test_the_quickstart_config_runs_again_in_a_new_directory(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    (out / "checkpoints").mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "areal_agents.cli.main",
        "train",
        "--config",
        str(ROOT / "examples" / "agents" / "quickstart.yaml"),
        "--dry-run",
        f"train.output_dir={json.dumps(str(out))}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert f"output_dir: {out}-2" in done.stdout, done.stdout
    refused = subprocess.run(
        [*cmd, "train.if_exists=refuse"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "already holds a run" in refused.stderr, refused.stderr
