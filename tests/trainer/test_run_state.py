"""``RUN_DIR/run.json``: the run's own state, written by ``train`` and read by the view and
the run tools (areal_agents.run_state)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_agents.errors import ConfigError
from areal_agents.run_state import (
    RunStateWriter,
    pid_alive,
    read_run_state,
    update_file,
)
from areal_agents.trainer import loop
from areal_agents.trainer.config_io import load_config


def test_the_writer_starts_running_and_only_the_first_end_counts(tmp_path):
    w = RunStateWriter(tmp_path, target_steps=10)
    s = read_run_state(tmp_path)
    assert s is not None and (s.status, s.phase, s.step, s.target_steps) == (
        "running",
        "starting",
        0,
        10,
    )
    assert s.ended_at is None and s.effective() == s  # this process is alive
    update_file(tmp_path, phase="training", step=3)  # the training process's progress
    w.end("stopped", "stopped")
    w.end("failed", "failed: RuntimeError: cleanup")  # a failure while stopping: ignored
    s = read_run_state(tmp_path)
    assert s is not None
    assert (s.status, s.reason, s.step, s.phase) == ("stopped", "stopped", 3, None)
    assert s.ended_at is not None and s.ended_at >= s.started_at
    update_file(tmp_path, step=9)  # an ended run is not changed
    assert read_run_state(tmp_path).step == 3  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="finished"):
        w.end("running", "no")


def test_unreadable_or_missing_files_read_as_none(tmp_path):
    assert read_run_state(tmp_path) is None
    update_file(tmp_path, step=1)  # no file: nothing is written either
    assert not (tmp_path / "run.json").exists()
    for text in (
        "{",
        "[]",
        '{"status": "sleeping", "pid": 1, "host": "h"}',
        '{"status": "running"}',
    ):
        (tmp_path / "run.json").write_text(text)
        assert read_run_state(tmp_path) is None, text


def test_a_kill_9_leaves_running_which_readers_show_as_failed(tmp_path):
    code = (
        "import sys, time; from areal_agents.run_state import RunStateWriter; "
        "RunStateWriter(sys.argv[1], target_steps=5); print('up', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    assert read_run_state(tmp_path).effective_status == "running"  # type: ignore[union-attr]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not pid_alive(proc.pid)
    s = read_run_state(tmp_path)
    assert s is not None and s.status == "running"  # what the file says
    seen = s.effective()
    assert (seen.status, seen.reason) == ("failed", f"process {proc.pid} is gone")
    other = json.loads((tmp_path / "run.json").read_text()) | {"host": "another-machine"}
    (tmp_path / "run.json").write_text(json.dumps(other))
    assert read_run_state(tmp_path).effective_status == "running"  # type: ignore[union-attr]


def _cfg(tmp_path: Path, model: Path, *extra: str):
    return load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={model}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "sampling.max_new_tokens=4",
            "metrics.tensorboard=false",
            f"train.output_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_train_writes_finished_with_its_reason(tiny_model_dir, tmp_path):
    """Steps done, then a run whose time limit was spent before its first step (loading the
    model took longer than the budget)."""
    loop.train(_cfg(tmp_path, tiny_model_dir, "train.steps=2"), quiet=True)
    s = read_run_state(tmp_path / "run")
    assert s is not None
    assert (s.status, s.reason, s.step, s.target_steps) == ("finished", "steps_done", 2, 2)
    cfg = _cfg(tmp_path / "t", tiny_model_dir, "train.steps=50", "train.time_limit_min=0.0001")
    summary = loop.train(cfg, quiet=True)
    s = read_run_state(tmp_path / "t" / "run")
    assert summary["stopped_by_time_limit"]
    assert s is not None and (s.status, s.reason, s.step) == ("finished", "time_limit", 0)


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (KeyboardInterrupt(), "stopped", "stopped"),
        (RuntimeError("the env's server is gone"), "failed", "failed: RuntimeError: the env"),
    ],
)
def test_train_writes_how_a_run_ended_early(
    tiny_model_dir, tmp_path, monkeypatch, error, status, reason
):
    async def start(self):
        raise error

    monkeypatch.setattr(loop.Trainer, "_start", start)
    with pytest.raises(type(error)):
        loop.train(_cfg(tmp_path, tiny_model_dir, "train.steps=2"), quiet=True)
    s = read_run_state(tmp_path / "run")
    assert s is not None and s.status == status and (s.reason or "").startswith(reason)
    assert s.phase is None and s.ended_at is not None


def test_a_refused_directory_keeps_its_run_json(tmp_path):
    """``train`` on a directory that holds a run, without --resume, is refused before it
    writes anything: the earlier run's state stays as it was."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    RunStateWriter(run, target_steps=4).end("finished", "steps_done")
    before = (run / "run.json").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        loop.train(_cfg(tmp_path, Path("unused"), "train.steps=2"), quiet=True)
    assert (run / "run.json").read_text() == before


@pytest.mark.slow
def test_sigterm_stops_a_cli_run_as_stopped(narrow_model_dir, tmp_path):
    """``kill`` (SIGTERM) of ``areal-agent train``: the run's cleanup runs and its state
    says stopped, at the step it reached."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "train", "--quiet"]
    overrides = [f"{k}={v}" for k, v in (
        ("env.id", "areal/Calculator-v0"), ("model.path", narrow_model_dir),
        ("model.dtype", "float32"), ("rollout.group_size", 2), ("rollout.batch_size", 1),
        ("sampling.max_new_tokens", 8), ("train.steps", 1000), ("metrics.tensorboard", "false"),
        ("train.output_dir", out),
    )]  # fmt: skip
    proc = subprocess.Popen([*cmd, *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while True:
        s = read_run_state(out)
        if s is not None and s.step >= 1:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert time.time() < deadline
        time.sleep(0.2)
    assert s.status == "running" and s.phase == "training" and s.pid == proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    s = read_run_state(out)
    assert s is not None and (s.status, s.reason) == ("stopped", "stopped")
    assert 1 <= s.step < 1000 and s.ended_at is not None
