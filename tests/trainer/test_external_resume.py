"""``rollout.agents: external`` across a crash: the trainer is killed with SIGKILL while a
worker process is connected, ``--resume`` serves the same port and token, the same worker
goes on, and no episode is lost or trained twice (the ledger's sessions and groups); with
one trainer process and with 2 FSDP2 ranks (the launcher killed: its ranks die with it)."""

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
WORKER = REPO / "examples" / "agents" / "openai_worker.py"


def _train(out: Path, model: Path, log: Path, resume: bool, nproc: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "areal_agents.cli.main",
        "train",
        "env.id=areal/Tasks-v0",
        f"model.path={model}",
        "model.dtype=float32",
        "rollout.agents=external",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "rollout.max_head_offpolicyness=1",
        "rollout.max_turns=2",
        "sampling.max_new_tokens=8",
        "workers.heartbeat_timeout_s=10",
        "train.steps=4",
        "train.save_every=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
        f"train.nproc={nproc}",
    ]
    if resume:
        cmd.insert(4, "--resume")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _wait(what: str, ok, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _latest(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    return int(latest.read_text().split("-")[1]) if latest.exists() else -1


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_kill_9_with_a_worker_connected_then_resume_loses_and_repeats_nothing(
    narrow_model_dir, tmp_path, nproc
):
    """On the narrow tiny model (hidden 32): the bookkeeping is the point, not the model."""
    out, log = tmp_path / "run", tmp_path / "train.log"
    first = _train(out, narrow_model_dir, log, resume=False, nproc=nproc)
    worker = None
    try:
        _wait("workers.json", (out / "workers.json").exists, first, log, 300)
        endpoint = json.loads((out / "workers.json").read_text())
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_agents.cli.main",
                "worker",
                "--connect",
                f"http://127.0.0.1:{endpoint['port']}",
                "--agent",
                f"{WORKER}:make_agent",
                "--concurrency",
                "4",
                "--wait",
                "2",
            ],
            cwd=REPO,
            env={**os.environ, "AREAL_WORKER_TOKEN": endpoint["token"]},
            stdout=(tmp_path / "worker.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        _wait("step 2", lambda: _latest(out) >= 2, first, log, 300)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = _latest(out)
        second = _train(out, narrow_model_dir, log, resume=True, nproc=nproc)
        assert second.wait(timeout=600) == 0, log.read_text()[-3000:]
        assert json.loads((out / "workers.json").read_text()) == endpoint, "port/token kept"
        assert worker.poll() is None, "the worker went on across the restart"
    finally:
        for p in (first, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=20)
    assert killed_at < 4
    ledger = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4]
    groups = [r["group"] for r in ledger]
    sessions = [s for r in ledger for s in r["sessions"]]
    assert len(set(groups)) == 4 and len(set(sessions)) == len(sessions) == 8
    state = json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["consumed_groups"] == groups and state["episodes_consumed"] == 8
    unconsumed = set(range(state["next_group"])) - set(groups) - set(state["skipped_groups"])
    assert all(g > max(groups) for g in unconsumed), "an earlier group was lost"
    assert "resumed from step" in log.read_text()
