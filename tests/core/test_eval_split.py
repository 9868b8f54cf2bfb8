"""Issue 48: ``areal-agent eval`` scores the env's test split unless ``--env-kwargs`` names a
split (it evaluated train and test tasks of ``areal/Tasks-v0`` together, while training takes
the train split)."""

from __future__ import annotations

import json

import pytest

from areal_agents import envs  # noqa: F401  (registers the built-in envs)
from areal_agents.envs.registry import make
from areal_agents.errors import ConfigError


def _eval(tiny_model_dir, out, *extra: str) -> list[str]:
    """``eval`` of areal/Tasks-v0 (8 tasks: 6 train, 2 test) for 8 episodes; the task ids."""
    from areal_agents.cli.main import main

    argv = [
        "eval",
        "--env",
        "areal/Tasks-v0",
        *extra,
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--episodes",
        "8",
        "--max-tokens",
        "2",
        "--max-turns",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    return [r["result"]["info"]["task"]["task_id"] for r in rows]


def test_eval_scores_the_test_split_unless_told_otherwise(tiny_model_dir, tmp_path, capsys):
    test_ids = {t.task_id for t in make("areal/Tasks-v0", split="test").unwrapped.tasks}
    assert test_ids == {"add-2", "mul-2"}
    default = _eval(tiny_model_dir, tmp_path / "default")
    assert len(default) == 8 and set(default) == test_ids, default
    assert "eval: the test split of areal/Tasks-v0" in capsys.readouterr().err
    every = _eval(tiny_model_dir, tmp_path / "all", "--env-kwargs", '{"split": "all"}')
    assert len(set(every)) == 8  # asked for: every task


def test_the_default_split_leaves_envs_without_splits_and_names_the_fix(tmp_path):
    from areal_agents.cli.backend import eval_split

    assert eval_split("areal/Tasks-v0", {}) == {"split": "test"}
    assert eval_split("areal/Tasks-v0", {"split": "train"}) == {"split": "train"}
    assert eval_split("areal/Calculator-v0", {"kind": "arithmetic"})["split"] == "test"
    tasks = tmp_path / "tasks.jsonl"
    rows = [
        {"id": f"t{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1), "split": s}
        for i, s in enumerate(["train", "val"])
    ]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kwargs = {"path": str(tasks), "score": "areal_agents.envs.tasks.scoring:exact_match"}
    with pytest.raises(ConfigError, match="--env-kwargs"):
        eval_split("areal/Tasks-v0", kwargs)
    assert eval_split("areal/Tasks-v0", {**kwargs, "split": "val"})["split"] == "val"
