"""examples/agents/train_camel_worker.py: ``areal-agent train`` with external workers, two
CAMEL worker processes in CAMEL's own venv, at least 3 training steps.

Runs from the main venv (the trainer) and starts the workers with the CAMEL venv named by
``AREAL_CAMEL_VENV``. Without it, it skips, or fails when ``AREAL_REQUIRE_INTEGRATIONS=1``
(CI sets both, so a skip cannot hide a break).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "agents" / "train_camel_worker"


def _camel_venv() -> Path:
    venv = os.environ.get("AREAL_CAMEL_VENV")
    ok = bool(venv) and (Path(venv or "") / "bin" / "areal-agent").exists()
    if not ok:
        why = "AREAL_CAMEL_VENV is unset (build it: requirements/make_venv.sh camel DIR)"
        if os.environ.get("AREAL_REQUIRE_INTEGRATIONS") == "1":
            pytest.fail(f"AREAL_REQUIRE_INTEGRATIONS=1 but {why}", pytrace=False)
        pytest.skip(why)
    return Path(venv or "")


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited with {proc.returncode} before serving")
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"no {path} within {timeout_s} s")


@pytest.mark.slow
def test_camel_workers_train_the_calculator_for_three_steps(tmp_path):
    venv = _camel_venv()
    out, log = tmp_path / "run", tmp_path / "workers.jsonl"
    train_log = (tmp_path / "train.log").open("wb")
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_agents.cli.main",
            "train",
            "--config",
            f"{EXAMPLE}.yaml",
            f"train.output_dir={out}",
            "train.save_every=0",
        ],
        cwd=REPO,
        stdout=train_log,
        stderr=subprocess.STDOUT,
    )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = _wait_for(out / "workers.json", trainer, 600)
        url = f"http://{endpoint['host']}:{endpoint['port']}"
        for i in range(2):
            workers.append(
                subprocess.Popen(
                    [
                        str(venv / "bin" / "areal-agent"),
                        "worker",
                        "--connect",
                        url,
                        "--concurrency",
                        "4",
                        "--agent",
                        f"{EXAMPLE}.py:make_agent",
                        "--agent-kwargs",
                        json.dumps({"log": str(log)}),
                    ],
                    cwd=REPO,
                    env={**os.environ, "AREAL_WORKER_TOKEN": endpoint["token"]},
                    stdout=(tmp_path / f"worker-{i}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        rc = trainer.wait(timeout=1200)
        assert rc == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        for p in [trainer, *workers]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [trainer, *workers]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert any(m["grad_norm"] > 0 for m in metrics), "no step had a gradient"
    ledger = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert any(len(set(row["rewards"])) > 1 for row in ledger), "every group was uniform"
    recorded = [json.loads(x) for x in log.read_text().splitlines()]
    sessions = [r["session"] for r in recorded]
    assert len(sessions) == len(set(sessions)), "a task was recorded twice"
    by_session = {r["session"]: set(r["completions"]) for r in recorded}
    trained = [s for row in ledger for s in row["sessions"]]
    assert len(trained) == len(set(trained)), "an episode was trained on twice"
    assert set(trained) <= set(by_session), "a trained episode did not come from a worker"
    trained_ids = {c for row in ledger for c in row["completions"]}
    assert trained_ids and trained_ids <= set().union(*by_session.values())
