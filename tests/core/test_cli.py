"""The areal-agent command line, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_envs_lists_the_builtin_ids():
    out = cli("envs")
    assert out.returncode == 0, out.stderr
    for env_id in (
        "areal/Math-v0",
        "areal/Calculator-v0",
        "areal/Search-v0",
        "areal/Tau2Retail-v0",
        "areal/Tau2Airline-v0",
    ):
        assert env_id in out.stdout


def test_train_dry_run_prints_resolved_config_and_bad_keys_name_the_fix():
    out = cli(
        "train", "--config", "examples/agents/quickstart.yaml", "--dry-run", "rollout.group_size=6"
    )
    assert out.returncode == 0, out.stderr
    assert "group_size: 6" in out.stdout and "areal/Calculator-v0" in out.stdout
    # the memory estimate per rank, from the model's config alone
    assert "# estimated training memory per rank:" in out.stdout
    assert "per rank: params" in out.stdout and "total" in out.stdout.splitlines()[-1]
    # Overrides on both sides of a flag all apply; a stray word is still refused.
    split = cli(
        "train", "--config", "examples/agents/quickstart.yaml", "rollout.group_size=6",
        "--dry-run", "train.steps=3",
    )  # fmt: skip
    assert split.returncode == 0, split.stderr
    assert "group_size: 6" in split.stdout and "steps: 3" in split.stdout
    stray = cli("train", "--config", "examples/agents/quickstart.yaml", "--dry-run", "oops")
    assert stray.returncode == 2 and "override 'oops': expected key=value" in stray.stderr
    bad = cli("train", "env.id=areal/Calculator-v0", "rollout.group_sise=4", "optim.lr=-1")
    assert bad.returncode == 2
    assert "did you mean 'rollout.group_size'" in bad.stderr
    assert "optim.lr" in bad.stderr


def test_eval_unknown_env_suggests_nearest_before_loading_a_model():
    out = cli("eval", "--env", "areal/Calculater-v0")
    assert out.returncode == 2
    assert "areal/Calculator-v0" in out.stderr


def test_eval_bad_truncation_names_the_valid_range_before_loading_a_model():
    out = cli("eval", "--env", "areal/Calculator-v0", "--top-p", "1.5")
    assert out.returncode == 2
    assert "--top-p must be in (0, 1]" in out.stderr
    out = cli("eval", "--env", "areal/Calculator-v0", "--top-k", "-1")
    assert out.returncode == 2
    assert "--top-k >= 0" in out.stderr


@pytest.mark.slow
def test_serve_smoke_answers_and_records_with_the_default_model():
    """The README's main-job path: the offline default model behind the proxy."""
    out = cli("serve", "--smoke", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"decodes_to_reply": true' in out.stdout


@pytest.mark.slow
def test_quickstart_shows_learning_and_writes_logs_checkpoints_and_final_model(quickstart_run):
    """The README's first command, on the default model (about 4 minutes on 2 cores): it
    ends with the held-out success of the base model, after the warm start and after RL,
    and with where to look next. The warm start teaches the tool call (the base model never
    makes one), so it must gain at least 30 points on the 64 greedy held-out problems."""
    import re

    out, run = quickstart_run.proc, quickstart_run.out
    assert out.returncode == 0, out.stderr[-3000:]
    line = re.search(
        r"held-out success: base (\d+)% -> warm start (\d+)% -> RL (\d+)% \(64 tasks, greedy, "
        r"test split\)",
        out.stdout,
    )
    assert line, out.stdout
    base, warm, _ = (int(x) for x in line.groups())
    assert warm >= base + 30, line.group(0)
    assert out.stdout.rstrip().endswith(f"(see it in the browser: areal-agent view {run})")
    evals = json.loads((run / "eval.json").read_text())
    assert [e["label"] for e in evals] == ["base", "warm_start", "final"], evals
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "held_out" not in r] == [1, 2, 3, 4]
    assert [r["held_out"] for r in rows if "held_out" in r] == ["base", "warm_start", "final"]
    state = json.loads((run / "run.json").read_text())
    assert (state["status"], state["reason"], state["step"]) == ("finished", "steps_done", 4)
    assert any((run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "latest").read_text() == "step-000004"
    assert (run / "final" / "config.json").exists()
    assert (run / "config.yaml").exists()
    assert (run / "episodes.db").exists()


@pytest.mark.slow
def test_short_run_of_the_quickstart_config_writes_its_steps(short_run):
    """The quickstart config cut to 2 steps without warm start and evaluations (the view's
    test data): one metrics row and one checkpoint per step."""
    out, run = short_run.proc, short_run.out
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out success" not in out.stdout
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    assert (run / "checkpoints" / "latest").read_text() == "step-000002"


@pytest.mark.slow
def test_eval_on_the_default_model_writes_episodes_and_report(eval_run):
    """`areal-agent eval --env <math id> --episodes 16 --k 4` on CPU with the default model."""
    import json

    out, tmp_path = eval_run.proc, eval_run.out
    assert out.returncode == 0, out.stderr[-3000:]
    for words in (
        "success rate",
        "pass@4",
        "pass^4",
        "mean reward",
        "mean turns",
        "mean output tokens",
        "ended:",
    ):
        assert words in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["episodes"] == 16 and report["tasks"] == 4 and report["k"] == 4
    assert sum(report["end_reasons"].values()) == 16
    rows = (tmp_path / "episodes.jsonl").read_text().splitlines()
    assert len(rows) == 16
    first = json.loads(rows[0])
    assert first["completions"] and first["completions"][0]["output_ids"]
    assert first["group_id"].startswith("task-")
    assert (tmp_path / "episodes.db").exists()  # the same episodes in a store (areal-agent view)


def test_demos_writes_chat_jsonl_for_the_warm_start(tmp_path):
    import json

    out = cli(
        "demos",
        "--env",
        "areal/Calculator-v0",
        "--n",
        "3",
        "--kind",
        "word",
        "--out",
        str(tmp_path / "d.jsonl"),
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    roles = [m["role"] for m in rows[0]["messages"]]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    none = cli("demos", "--env", "areal/Math-v0", "--out", str(tmp_path / "x.jsonl"))
    assert none.returncode == 2 and "offers no demos()" in none.stderr


def test_demos_for_an_agent_look_like_its_prompts(tmp_path, tiny_model_dir):
    """`demos --agent`: the Agents SDK example agent's instructions come first and every
    row carries its tool list (its own tool, then the env's), which the warm start uses."""
    import json
    from pathlib import Path

    pytest.importorskip("agents")
    from areal_agents.trainer.sft import demo_tools, load_demos

    example = Path(__file__).resolve().parents[2] / "examples/agents/train_agents_sdk.py"
    path = tmp_path / "d.jsonl"
    out = cli(
        *("demos", "--env", "areal/Calculator-v0", "--n", "2", "--kind", "arithmetic"),
        *("--agent", f"{example}:make_agent", "--model", str(tiny_model_dir), "--out", str(path)),
    )
    assert out.returncode == 0, out.stderr
    assert "(2 tools)" in out.stdout
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0]["messages"][0]["content"].startswith("You solve arithmetic word problems.")
    assert [t["function"]["name"] for t in rows[0]["tools"]] == ["round_number", "calculator"]
    assert demo_tools(path) == rows[0]["tools"] and len(load_demos(path)) == 2
    rows[1]["tools"] = rows[1]["tools"][:1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from areal_agents.errors import ConfigError

    with pytest.raises(ConfigError, match="different tool lists"):
        demo_tools(path)
