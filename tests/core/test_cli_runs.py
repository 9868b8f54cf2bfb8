"""``areal-agent runs / status / logs / stop`` and ``train --resume RUN``, on tiny real runs
(the narrow tiny model) and, for what needs no training, on runs a test process stands in
for."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_agents.run_state import (
    LOG_FILE,
    STOP_FILE,
    RunStateWriter,
    read_run_state,
    read_stop_request,
    run_log,
)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _train_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={model}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "sampling.max_new_tokens=8",
        "metrics.tensorboard=false",
        "train.save_every=0",  # a stopped run's checkpoint is the stop's own
        f"train.steps={steps}",
        f"train.output_dir={out}",
        *extra,
    ]


def _start(*args: str) -> subprocess.Popen[bytes]:
    """A background ``areal-agent`` whose terminal output goes nowhere: train.log has it."""
    return subprocess.Popen(
        [sys.executable, "-m", "areal_agents.cli.main", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_for_step(out: Path, proc: subprocess.Popen[bytes], step: int = 1) -> None:
    deadline = time.time() + 300
    while True:
        s = read_run_state(out)
        if s is not None and s.step >= step:
            return
        assert proc.poll() is None, (out / LOG_FILE).read_text()[-3000:]
        assert time.time() < deadline, f"{out} took too long to reach step {step}"
        time.sleep(0.2)


def _rows(runs: Path) -> dict[str, dict]:
    done = cli("runs", str(runs), "--json")
    assert done.returncode == 0, done.stderr
    return {r["run"]: r for r in json.loads(done.stdout)}


@pytest.mark.slow
def test_runs_status_logs_stop_and_resume_on_real_runs(narrow_model_dir, tmp_path):
    """A finished run (with held-out results), a running one, one killed with ``kill -9``
    and one stopped by ``areal-agent stop``, all listed by ``runs``; the stopped run ends at
    a step with a checkpoint and ``train --resume RUN`` continues it to its (new) target."""
    runs = tmp_path / "runs"
    done, live, killed = runs / "done", runs / "live", runs / "killed"
    live_proc = _start(*_train_args(narrow_model_dir, live, 1000))
    killed_proc = _start(*_train_args(narrow_model_dir, killed, 1000, "--quiet"))
    try:
        first = cli(
            *_train_args(narrow_model_dir, done, 2, "--quiet", "eval.episodes=2"), timeout=600
        )
        assert first.returncode == 0, first.stderr[-3000:]
        _wait_for_step(live, live_proc)
        _wait_for_step(killed, killed_proc)
        killed_proc.send_signal(signal.SIGKILL)
        killed_proc.wait()

        rows = _rows(runs)
        assert set(rows) == {"done", "live", "killed"}
        assert (rows["done"]["status"], rows["done"]["step"], rows["done"]["target_steps"]) == (
            "finished", 2, 2,
        )  # fmt: skip
        assert rows["done"]["held_out"]["label"] == "final"
        assert rows["live"]["status"] == "running" and rows["live"]["step"] >= 1
        assert rows["killed"]["status"] == "failed"
        assert rows["killed"]["reason"] == f"process {killed_proc.pid} is gone"
        table = cli("runs", str(runs)).stdout
        assert table.splitlines()[0].split() == [
            "RUN", "STATUS", "STEP", "HELD-OUT", "STARTED", "WALL", "DETAIL",
        ]  # fmt: skip
        line = {row.split()[0]: row for row in table.splitlines()[1:]}
        assert "finished  2/2" in line["done"] and "(final)" in line["done"]
        assert " running " in line["live"] and "/1000" in line["live"]
        assert "failed" in line["killed"] and f"process {killed_proc.pid} is gone" in line["killed"]

        status = cli("status", str(live))
        assert status.returncode == 0, status.stderr
        assert f"running (training), pid {live_proc.pid}" in status.stdout
        assert "env        areal/Calculator-v0" in status.stdout
        assert "reward_mean" in status.stdout and f"areal-agent view {live}" in status.stdout
        logs = cli("logs", str(live))
        assert logs.returncode == 0, logs.stderr
        assert f"pid {live_proc.pid}" in logs.stdout and "train:" in logs.stdout  # the bar

        # stop: the request, then the run ends after its step, with a checkpoint
        stop = cli("stop", str(live), "--wait", timeout=300)
        assert stop.returncode == 0, stop.stderr
        assert f"asked {live} to stop" in stop.stdout and "stopped (stopped)" in stop.stdout
        assert live_proc.wait(timeout=60) == 0
        st = read_run_state(live)
        assert st is not None and (st.status, st.reason) == ("stopped", "stopped")
        stopped_at = st.step
        assert (live / "checkpoints" / "latest").read_text() == f"step-{stopped_at:06d}"
        assert not (live / "final").exists()  # no final evaluation or export
        log = (live / LOG_FILE).read_text()
        assert f"stop requested: stopping after step {stopped_at}\n" in log
        assert f"stopped after step {stopped_at} (areal-agent stop)" in log
        rows = _rows(runs)
        assert {k: r["status"] for k, r in rows.items()} == {
            "done": "finished", "live": "stopped", "killed": "failed",
        }  # fmt: skip
        again = cli("stop", str(live))
        assert again.returncode == 0 and "is not running: stopped" in again.stdout

        # --resume RUN: the run's own config, plus the overrides given now
        resumed = cli(
            "train", "--resume", str(live), f"train.steps={stopped_at + 1}", "--quiet",
            timeout=600,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        st = read_run_state(live)
        assert st is not None and (st.status, st.reason, st.step) == (
            "finished", "steps_done", stopped_at + 1,
        )  # fmt: skip
        assert read_stop_request(live) is None
        steps = [json.loads(x)["step"] for x in (live / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, stopped_at + 2))
        assert (live / LOG_FILE).read_text().count("\n--- ") >= 1  # a second start's header
        assert f"resumed from step {stopped_at}" not in resumed.stdout  # --quiet
    finally:
        for p in (live_proc, killed_proc):
            if p.poll() is None:
                p.kill()
                p.wait()


def _stand_in(run: Path) -> subprocess.Popen[bytes]:
    """A process that writes a running run.json for ``run`` and waits (no training)."""
    code = (
        "import sys, time; from areal_agents.run_state import RunStateWriter; "
        "RunStateWriter(sys.argv[1], target_steps=5); print('up', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    return proc


def test_stop_asks_first_then_sends_sigterm_and_says_what_it_did(tmp_path):
    run = tmp_path / "run"
    proc = _stand_in(run)
    try:
        first = cli("stop", str(run))
        assert first.returncode == 0, first.stderr
        assert "stop after its current step" in first.stdout
        request = read_stop_request(run)
        assert request is not None and request["pid"] != proc.pid
        assert "stop requested" in cli("runs", str(tmp_path)).stdout
        second = cli("stop", str(run))
        assert second.returncode == 0 and f"sent SIGTERM to pid {proc.pid}" in second.stdout
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gone = cli("stop", str(run))
    assert gone.returncode == 0 and f"is not running: failed (process {proc.pid} is gone)" in (
        gone.stdout
    )


def test_run_commands_name_the_fix_for_what_is_no_run(tmp_path):
    missing = cli("status", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "`areal-agent runs [DIR]` lists the runs" in missing.stderr
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    stop = cli("stop", str(tmp_path / "old"))
    assert stop.returncode == 2 and "has no run.json" in stop.stderr
    logs = cli("logs", str(tmp_path / "old"))
    assert logs.returncode == 2 and "has no train.log" in logs.stderr
    listed = cli("runs", str(tmp_path))  # a run from before run.json: inferred as the view does
    assert listed.returncode == 0 and "old" in listed.stdout and "1" in listed.stdout
    assert cli("runs", str(tmp_path / "empty")).returncode == 2
    (tmp_path / "empty").mkdir()
    assert "no training runs" in cli("runs", str(tmp_path / "empty")).stdout


def test_version_prints_the_package_version():
    from areal_agents import __version__

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"areal-agent {__version__}"


def test_reading_runs_loads_no_web_framework_and_no_torch():
    """``runs`` / ``status`` read run directories through the view's run reader; importing it
    must not import the view's app (fastapi) or torch: each call would pay for them."""
    code = (
        "import sys, areal_agents.cli.runs, areal_agents.view.sources; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    from areal_agents.view import RunSet, create_app  # still importable from the package

    assert callable(create_app) and RunSet.__name__ == "RunSet"


def test_resume_run_reads_the_runs_config_and_refuses_a_running_run(tmp_path, capsys):
    """``--resume RUN``: RUN's own config.yaml plus the overrides given now, in RUN."""
    from areal_agents.cli.main import _build_parser
    from areal_agents.cli.train import train_command
    from areal_agents.errors import ConfigError
    from areal_agents.trainer.config_io import dump_yaml, load_config

    def train(*args: str) -> str:
        assert train_command(_build_parser().parse_args(["train", *args])) == 0
        return capsys.readouterr().out

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ["env.id=areal/Calculator-v0", "train.steps=7"])
    dump_yaml(cfg, run / "config.yaml")
    dry = train("--resume", str(run), "rollout.group_size=3", "--dry-run")
    assert "steps: 7" in dry and "group_size: 3" in dry and f"output_dir: {run}" in dry
    # `--config C --resume a=b`: the override argparse took for RUN is an override
    dry = train("--config", str(run / "config.yaml"), "--resume", "train.steps=9", "--dry-run")
    assert "steps: 9" in dry and "output_dir: runs/default" in dry
    with pytest.raises(ConfigError, match=r"drop the train\.output_dir override"):
        train("--resume", str(run), f"train.output_dir={tmp_path}/x", "--dry-run")
    (tmp_path / "bare").mkdir()
    with pytest.raises(ConfigError, match="--config FILE --resume RUN"):
        train("--resume", str(tmp_path / "bare"))
    RunStateWriter(run, target_steps=7)  # running, and this process is alive
    with pytest.raises(ConfigError, match=f"is running \\(pid {os.getpid()}.*areal-agent stop"):
        train("--resume", str(run))


def test_run_log_copies_prints_and_records_to_train_log(tmp_path, capsys):
    terminal = sys.stderr
    with run_log(tmp_path):
        print("a progress line")
        print("to stderr", file=sys.stderr)
        logging.getLogger("areal_agents.somewhere").info("an info record")
        logging.getLogger("httpx").info("not this one")  # others: from WARNING
        with run_log(tmp_path):  # nested: nothing twice
            print("once")
    assert sys.stderr is terminal
    with pytest.raises(RuntimeError), run_log(tmp_path):
        raise RuntimeError("boom")
    text = (tmp_path / LOG_FILE).read_text()
    assert text.count("\n--- ") + text.startswith("--- ") == 2  # a header per start
    assert "a progress line\n" in text and "to stderr\n" in text
    assert "INFO areal_agents.somewhere: an info record" in text
    assert "not this one" not in text and text.count("once\n") == 1
    assert "RuntimeError: boom" in text
    shown = capsys.readouterr()
    assert "a progress line" in shown.out and "to stderr" in shown.err  # the terminal too


def test_a_stop_request_is_cleared_when_the_run_starts_again(tmp_path):
    """``train`` removes an old request before it writes run.json (a resume of a stopped run
    must not stop at once)."""
    from areal_agents.run_state import request_stop
    from areal_agents.trainer import loop
    from areal_agents.trainer.config_io import load_config

    out = tmp_path / "run"
    out.mkdir()
    request_stop(out)
    assert (out / STOP_FILE).exists()
    cfg = load_config(None, ["env.id=areal/Calculator-v0", f"train.output_dir={out}"])

    def fail(*a: object, **k: object) -> None:
        assert read_stop_request(out) is None
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "_train", fail)
        with pytest.raises(KeyboardInterrupt):
            loop.train(cfg, quiet=True)
    st = read_run_state(out)
    assert st is not None and (st.status, st.reason) == ("stopped", "stopped")
    assert st.pid == os.getpid()
