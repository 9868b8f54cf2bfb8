"""Issue 48: ``train.time_limit_min`` covers the warm start (a 10-minute run took 12.6
minutes: the warm start ran past the budget). The warm start trains a batch only while it is
expected to end within the budget, by the rule of the RL steps (the next one as long as the
longest so far), and RL gets what is left."""

from __future__ import annotations

import asyncio
import json

import pytest


class FakePolicy:
    """``set_lr`` and ``train_step`` (all ``run_sft`` calls), each step 1 s of a fake clock."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.steps = 0

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def train_step(self, *args, **kwargs) -> dict[str, float]:
        self.clock[0] += 1.0
        self.steps += 1
        return {"nll": 1.0 / self.steps}


def test_the_warm_start_stops_at_the_last_batch_that_ends_within_the_budget():
    from areal_agents.trainer.time_budget import TimeBoxed

    clock = [0.5]  # the models took 0.5 s to load
    policy = FakePolicy(clock)
    boxed = TimeBoxed(policy, lambda: clock[0], limit_s=4.0)
    boxed.set_lr(1e-4)
    outs = [boxed.train_step([], None, 1.0) for _ in range(10)]
    # 0.5 -> 1.5 -> 2.5 -> 3.5 trained; a fourth would end at 4.5 > 4.0: skipped, as the rest
    assert policy.steps == 3 and clock[0] == 3.5 and policy.lr == 1e-4
    assert outs[-1] == {"nll": 1.0 / 3}  # run_sft reports the last batch that trained
    assert boxed.stats() == {"sft_steps": 3.0, "sft_skipped_batches": 7.0}
    unbounded = TimeBoxed(FakePolicy([0.0]), lambda: 0.0, limit_s=100.0)
    unbounded.train_step([], None, 1.0)
    assert unbounded.stats() == {"sft_steps": 1.0}


@pytest.mark.slow
def test_a_warm_start_past_the_time_limit_trains_no_further_batch(tiny_model_dir, tmp_path):
    """A budget already spent when the warm start begins (the models took longer to load):
    no warm-start batch runs (the old code ran all 16 of them, whatever the budget)."""
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import Trainer

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "sampling.max_new_tokens=8",
            "sft.enabled=true",
            "sft.generate=8",
            "sft.generate_kwargs={kind: arithmetic}",
            "sft.batch_size=1",
            "sft.epochs=2",
            "train.steps=1",
            "train.time_limit_min=0.0001",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    stats = json.loads((out / "sft.json").read_text())
    assert stats["sft_steps"] == 0 and stats["sft_skipped_batches"] == 16, stats
    assert "sft_nll" not in stats  # no batch trained: no loss to report
    # nor does RL take a step once the budget is spent (it used to take the first one)
    assert summary["stopped_by_time_limit"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "held_out" not in r], "an RL step ran past the budget"
