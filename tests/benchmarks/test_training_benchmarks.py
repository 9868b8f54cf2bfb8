"""benchmarks/async_vs_sync.py and benchmarks/trl_grpo.py: their envs, arguments, a smoke run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from areal_agents import envs
from areal_agents.envs import check_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import rl_common  # noqa: E402


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(number: str) -> dict:
    args = f'{{"expression": "{number} + 1"}}'
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": args}}
        ],
    }


def test_bench_envs_are_registered_and_pass_check_env():
    ids = dict(envs.list_envs())
    assert rl_common.SLOW_ENV_ID in ids and rl_common.ARITHMETIC_ENV_ID in ids
    check_env(envs.make(rl_common.SLOW_ENV_ID, delay_min=0.0, delay_max=0.001), seed=0)
    check_env(envs.make(rl_common.ARITHMETIC_ENV_ID), seed=0)


def test_slow_env_delays_are_seeded_clipped_and_slept():
    env = envs.make(rl_common.SLOW_ENV_ID, delay_min=0.01, delay_max=0.05, delay_median=0.03)
    env.reset(seed=3)
    delays = [env.step_delay(_call(str(i))) for i in range(200)]
    assert all(0.01 <= d <= 0.05 for d in delays)
    assert len(set(delays)) > 50, "different messages wait different times"
    assert min(delays) == 0.01 and max(delays) == 0.05, "the log-normal tails are clipped"
    again = envs.make(rl_common.SLOW_ENV_ID, delay_min=0.01, delay_max=0.05, delay_median=0.03)
    again.reset(seed=3)
    assert again.step_delay(_call("7")) == env.step_delay(_call("7"))
    want = env.step_delay(_call("7"))
    start = time.perf_counter()
    obs, _, terminated, _, info = env.step(_call("7"))
    assert time.perf_counter() - start >= want * 0.9
    assert info["env_delay_s"] == want
    assert obs[0]["role"] == "tool" and not terminated


def test_arithmetic_env_is_single_turn_without_tools():
    env = envs.make(rl_common.ARITHMETIC_ENV_ID)
    messages, info = env.reset(seed=5)
    assert info["tools"] == [] and [m["role"] for m in messages] == ["system", "user"]
    _, reward, terminated, _, info = env.step(f"The answer is {env.task.answer}.")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    rows = rl_common.arithmetic_prompts(3, 5)
    assert rows[0] == {"prompt": messages, "answer": env.task.answer}
    assert len({r["answer"] + r["prompt"][1]["content"] for r in rows}) == 3


def test_scripts_parse_their_quick_settings():
    async_vs_sync, trl_grpo = _script("async_vs_sync"), _script("trl_grpo")
    args = async_vs_sync.parse_args(["--quick"])
    assert (args.steps, args.group_size, args.batch_size, args.eta) == (4, 2, 2, 4)
    assert args.concurrency == (4 + 1) * 2 * 2
    args = trl_grpo.parse_args(["--quick"])
    assert (args.prompts, args.generations, args.max_completion_length, args.steps) == (
        2,
        2,
        16,
        2,
    )
    with pytest.raises(SystemExit):
        async_vs_sync.parse_args(["--eta", "0"])


@pytest.mark.slow
def test_both_scripts_run_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--quiet", "--out", str(tmp_path)]
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "async_vs_sync.py"),
            *common,
            "--steps=2",
            "--group-size=2",
            "--batch-size=1",
            "--eta=1",
            "--max-new-tokens=4",
            "--eval-episodes=2",
            "--delay-min=0.01",
            "--delay-max=0.05",
            "--delay-median=0.02",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for setting in ("shared", "pinned"):  # pinned: the engine on Ray, on a core of its own
        assert f"{setting}: speed-up (sync wall / async wall) to 2 steps" in out.stdout
        assert f"| {setting} | sync (eta=0) |" in out.stdout
        assert f"| {setting} | async (eta=1) |" in out.stdout
    assert "x; bound " in out.stdout
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "trl_grpo.py"),
            *common,
            "--only=ours",
            "--prompts=1",
            "--generations=2",
            "--max-completion-length=4",
            "--steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| ours (eta=0) |" in out.stdout


def test_learning_curve_reuses_a_report_only_for_the_same_request(tmp_path, monkeypatch):
    curve = _script("learning_curve")
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000000"
    (ckpt / "model").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "env: {id: areal/Calculator-v0, kwargs: {word_fraction: 0.8}}\n"
        "model: {dtype: bfloat16}\nsampling: {max_new_tokens: 64}\nrollout: {max_turns: 3}\n"
    )
    calls: list[list[str]] = []

    def fake_eval(cmd, check, stdout):
        calls.append(cmd)
        kwargs = json.loads(cmd[cmd.index("--env-kwargs") + 1])
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        report = {"episodes": 8, "success_rate": kwargs["word_fraction"]}
        (out / "report.json").write_text(json.dumps(report))

    monkeypatch.setattr(curve.subprocess, "run", fake_eval)
    first = curve.evaluate(run, ckpt, 8, 0, 4, {"word_fraction": 0.5})
    assert first["success_rate"] == 0.5 and len(calls) == 1
    kwargs = json.loads(calls[0][calls[0].index("--env-kwargs") + 1])
    assert kwargs == {"word_fraction": 0.5, "split": "test"}
    assert calls[0][calls[0].index("--adapter") + 1] == str(ckpt / "model")
    assert calls[0][calls[0].index("--dtype") + 1] == "bfloat16"  # the run's explicit dtype
    # The same request is served from step-N/eval; another mix or seed is evaluated afresh.
    assert curve.evaluate(run, ckpt, 8, 0, 16, {"word_fraction": 0.5}) == first
    assert len(calls) == 1
    assert curve.evaluate(run, ckpt, 8, 0, 4, None)["success_rate"] == 0.8
    assert curve.evaluate(run, ckpt, 8, 1, 4, None)["success_rate"] == 0.8
    assert len(calls) == 3
    assert calls[2][calls[2].index("--out") + 1] == str(ckpt / "eval-seed1")
    # Each task seed keeps its own report: both are served again without an eval.
    curve.evaluate(run, ckpt, 8, 0, 4, None)
    curve.evaluate(run, ckpt, 8, 1, 4, None)
    assert len(calls) == 3
    # A report without the request that made it (an older cache) is not trusted.
    (ckpt / "eval" / "request.json").unlink()
    curve.evaluate(run, ckpt, 8, 0, 4, None)
    assert len(calls) == 4


def test_learning_curve_request_holds_the_resolved_dtype(tmp_path):
    import torch

    from areal_agents.hardware import resolve_dtype

    curve = _script("learning_curve")
    (tmp_path / "config.yaml").write_text(
        "env: {id: areal/Calculator-v0}\nmodel: {dtype: auto}\n"
        "sampling: {max_new_tokens: 64}\nrollout: {max_turns: 3}\n"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    request = curve.eval_request(tmp_path, 8, 0)
    assert request["dtype"] == resolve_dtype("auto", device) != "auto"


def test_learning_curve_reports_grounded_success_and_each_kind(tmp_path, monkeypatch, capsys):
    """The table's columns follow the reports: grounded success where the env reports it,
    then success per task kind (1-hop / 2-hop here); the last line gives each gain."""
    curve = _script("learning_curve")
    run = tmp_path / "search"
    reports = {
        0: {
            "success_rate": 0.25,
            "grounded_success_rate": 0.2,
            "by_kind": {"1-hop": 0.4, "2-hop": 0.1},
        },
        8: {
            "success_rate": 0.5,
            "grounded_success_rate": 0.45,
            "by_kind": {"1-hop": 0.6, "2-hop": 0.4},
        },
    }
    for step in reports:
        ckpt = run / "checkpoints" / f"step-{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": step, "elapsed_s": 60.0 * step}))
    monkeypatch.setattr(
        curve, "evaluate", lambda run, ckpt, *a: reports[int(ckpt.name.split("-")[1])]
    )
    assert curve.main([str(run), "--ends"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| run | step | minutes | success | grounded | 1-hop | 2-hop |"
    assert out[2] == "| search | 0 | 0.0 | 25.0% | 20.0% | 40.0% | 10.0% |"
    assert out[3] == "| search | 8 | 8.0 | 50.0% | 45.0% | 60.0% | 40.0% |"
    assert out[4] == (
        "search in 8.0 min: success 25.0% -> 50.0% (+25.0 points); "
        "grounded 20.0% -> 45.0% (+25.0 points); 1-hop 40.0% -> 60.0% (+20.0 points); "
        "2-hop 10.0% -> 40.0% (+30.0 points)"
    )
