"""Held-out evaluation inside a training run (``eval``; trainer/heldout.py)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from areal_agents import envs
from areal_agents.envs.base import AgentEnv
from areal_agents.errors import ConfigError
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.heldout import HeldOut
from areal_agents.trainer.loop import Trainer


class SplitTask(AgentEnv):
    """One turn on a pool of 8 tasks; succeeds on the test split when the task is even,
    never on the train split (so an evaluation's result is known whatever the model
    says)."""

    def __init__(self, split: str = "train", **kwargs):
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}")
        super().__init__(**kwargs)
        self.split = split

    def num_tasks(self):
        return 8

    def _start(self, options):
        if "task_index" in options:
            self.task = int(options["task_index"])
        else:
            self.task = int(self.np_random.integers(8))
        return [{"role": "user", "content": f"task {self.task}"}], {
            "task_id": str(self.task),
            "kind": "even-odd",
        }

    def tools(self):
        return []

    def _respond(self, message):
        won = self.split == "test" and self.task % 2 == 0
        return [], float(won), True, {"success": won, "kind": "even-odd"}


@pytest.fixture(autouse=True)
def register_split_env() -> None:
    envs.register("test/SplitTask-v0", SplitTask, description="held-out test", override=True)


def _cfg(tmp_path: Path, model: Path, *extra: str):
    demos = tmp_path / "demos.jsonl"
    row = [{"role": "user", "content": "task 1"}, {"role": "assistant", "content": "ok"}]
    demos.write_text(json.dumps({"messages": row}) + "\n")
    return load_config(
        None,
        [
            "env.id=test/SplitTask-v0",
            f"model.path={model}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "sampling.max_new_tokens=4",
            "sft.enabled=true",
            f"sft.demos={demos}",
            "eval.episodes=8",
            "metrics.tensorboard=false",
            f"train.output_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_the_run_evaluates_base_warm_start_steps_and_the_end(tiny_model_dir, tmp_path):
    """Base (before the warm start), after it, every step and at the end, on the test
    split, greedy, as proxy groups of their own that the run never trains on; the last
    step's result is the final one (not evaluated twice)."""
    cfg = _cfg(tmp_path, tiny_model_dir, "train.steps=2", "eval.every=1")
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    run = tmp_path / "run"
    results = json.loads((run / "eval.json").read_text())
    assert [r["label"] for r in results] == ["base", "warm_start", "step-1", "step-2", "final"]
    assert [r["step"] for r in results] == [0, 0, 1, 2, 2]
    # seeds 0..7 of the test split: the even half succeeds, whatever the model answers
    assert all(r["success_rate"] == 0.5 and r["episodes"] == 8 for r in results)
    assert results[-1]["by_kind"] == {"even-odd": 0.5}
    assert summary["held_out"] == (
        "held-out success: base 50% -> warm start 50% -> RL 50% (8 tasks, greedy, test split)"
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "held_out" not in r]
    assert [r["eval/success_rate"] for r in steps] == [0.5, 0.5]
    assert steps[0]["eval/success_even-odd"] == 0.5
    # every stage is also a row of its own, at its step (what the dashboard charts)
    held_out = [(r["held_out"], r["step"], r["eval/success_rate"]) for r in rows if "held_out" in r]
    assert held_out == [
        ("base", 0, 0.5),
        ("warm_start", 0, 0.5),
        ("step-1", 1, 0.5),
        ("step-2", 2, 0.5),
        ("final", 2, 0.5),
    ]
    db = sqlite3.connect(run / "episodes.db")
    groups = Counter(
        g.rsplit("-", 1)[0]
        for (g,) in db.execute("select group_id from sessions where group_id like 'eval-%'")
    )
    assert groups == {"eval-base": 8, "eval-warm_start": 8, "eval-step-1": 8, "eval-step-2": 8}
    sampling = {
        json.loads(s)["temperature"]
        for (s,) in db.execute(
            "select c.sampling from completions c join sessions s on s.id = c.session_id "
            "where s.group_id like 'eval-%'"
        )
    }
    assert sampling == {0.0}
    trained = {
        g
        for (g,) in db.execute(
            "select group_id from train_tokens t join sessions s on s.id = t.session_id"
        )
    }
    assert trained and not any(g.startswith("eval-") for g in trained)


def test_the_line_names_each_stage_and_a_run_without_a_warm_start():
    held = HeldOut.__new__(HeldOut)
    held.cfg = load_config(None, ["env.id=x", "eval.episodes=4", "eval.temperature=0.7"])
    held.make_env, held.split, held.results = None, None, []
    assert held.line() is None
    held.results = [{"label": "base", "step": 0, "success_rate": 0.02, "episodes": 64}]
    assert held.line() == "held-out success: base 2% (64 tasks, T=0.7)"
    held.results.append({"label": "step-3", "step": 3, "success_rate": 0.25, "episodes": 64})
    assert held.line() == "held-out success: base 2% -> RL 25% (step 3) (64 tasks, T=0.7)"
    held.results.append({"label": "final", "step": 5, "success_rate": 0.5, "episodes": 64})
    held.results.append({"label": "step-6", "step": 6, "success_rate": 0.4, "episodes": 64})
    assert held.line() == "held-out success: base 2% -> RL 50% (64 tasks, T=0.7)"


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return info.value.problems


def test_bad_eval_settings_fail_before_the_first_episode(tiny_model_dir, tmp_path):
    assert any(
        p.startswith("eval.every: must be 0 while eval.episodes is 0")
        for p in _problems(["env.id=x", "eval.every=2"])
    )
    bad = _problems(["env.id=x", "eval.episodes=4", "eval.temperature=-1"])
    assert any(p.startswith("eval.temperature: must be >= 0") for p in bad)
    external = _problems(["env.id=x", "eval.episodes=4", "rollout.agents=external"])
    assert any("evaluate the checkpoints with areal-agent eval" in p for p in external)
    cfg = _cfg(tmp_path, tiny_model_dir, "eval.env_kwargs={nope: 1}")
    with pytest.raises(ConfigError, match=r"eval\.env_kwargs .* does not take them"):
        HeldOut(cfg, tmp_path)
    cfg = _cfg(tmp_path, tiny_model_dir, "eval.split=dev")
    with pytest.raises(ConfigError, match=r"eval\.split='dev'"):
        HeldOut(cfg, tmp_path)
