"""``scheduler: ray``: rollouts on Ray actors (engine + rollout workers) while training stays in
this process; the new weights reach the engine actor after every step."""

from __future__ import annotations

import asyncio
import json

import pytest

from trainer.config import load_config


@pytest.mark.slow
def test_scheduler_ray_trains_with_rollouts_on_ray_workers(cluster, tiny_model_dir, tmp_path):
    from trainer.loop import Trainer

    cfg = load_config(
        None,
        [
            "scheduler=ray",
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.device=cpu",
            "rollout.group_size=2",
            "rollout.batch_size=2",
            "rollout.concurrency=4",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "optim.lr=1e-2",
            "metrics.tensorboard=false",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    summary = asyncio.run(trainer.run())
    assert type(trainer.source.runner).__name__ == "RayRunner"
    assert trainer.engine.version == 2, "the engine actor got the weights of both steps"
    counters = trainer.source.runner.counters
    assert counters["episodes"] >= 8 and not counters["episodes_lost"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples"] > 0 and "reward_mean" in r for r in rows)
    assert trainer.state.episodes_consumed == 8
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert summary["version"] == 1.0
