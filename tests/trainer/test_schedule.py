"""The learning-rate schedule (``optim.schedule``, ``warmup_steps``, ``total_steps``): the
rates by hand, the rates the optimizer uses, the metric and the checkpoint."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.model_build import lr_schedule
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.schedule import LrSchedule

# lr = 1, W = 2, T = 6. Training step k + 1 (k = 0..6):
#   warmup  k = 0, 1:  (k + 1) / 2          -> 0.5, 1.0
#   decay   p = (k - 2) / 4 for k = 2..5    -> p = 0, 0.25, 0.5, 0.75; k = 6 is past T: p = 1
#   linear  1 - p                           -> 1.0, 0.75, 0.5, 0.25, 0.0
#   cosine  (1 + cos(pi p)) / 2             -> 1.0, (1 + 0.70710678) / 2, 0.5,
#                                              (1 - 0.70710678) / 2, 0.0
HAND = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0],
    "cosine": [0.5, 1.0, 1.0, 0.85355339, 0.5, 0.14644661, 0.0],
}


def _rates(schedule: LrSchedule, lr: float, steps: int) -> list[float]:
    """The rate each of ``steps`` optimizer steps runs at, read from the optimizer."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = schedule.scheduler(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_rates_match_the_hand_computed_values(kind):
    schedule = LrSchedule(kind, warmup_steps=2, total_steps=6)  # type: ignore[arg-type]
    assert [schedule.factor(k) for k in range(7)] == pytest.approx(HAND[kind], abs=1e-8)
    assert _rates(schedule, 2e-3, 7) == pytest.approx([2e-3 * f for f in HAND[kind]], abs=1e-11)


def test_no_warmup_starts_at_the_peak_and_constant_is_the_default():
    assert _rates(LrSchedule(), 1e-3, 3) == pytest.approx([1e-3] * 3)
    assert LrSchedule("linear", 0, 4).factor(0) == 1.0  # the first step runs at lr
    assert LrSchedule("cosine", 3, 3).factor(2) == 1.0  # warmup to the end: no decay
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        LrSchedule("linear", 5, 4)


def test_total_steps_default_to_train_steps():
    cfg = load_config(None, ["env.id=x", "optim.schedule=linear", "train.steps=10"])
    assert lr_schedule(cfg) == LrSchedule("linear", 0, 10)
    cfg = load_config(None, ["env.id=x", "optim.total_steps=4", "optim.warmup_steps=2"])
    assert lr_schedule(cfg) == LrSchedule("constant", 2, 4)
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps"):
        load_config(None, ["env.id=x", "optim.warmup_steps=5", "train.steps=4"])


def test_a_policy_checkpoint_continues_its_schedule(tiny_model_dir, tmp_path):
    schedule = LrSchedule("cosine", warmup_steps=1, total_steps=5)
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3, schedule=schedule)
    for _ in range(3):
        policy.step_schedule()
    assert policy.lr == pytest.approx(1e-3 * (1 + math.cos(math.pi * 2 / 4)) / 2)
    policy.save(tmp_path / "ckpt")
    again = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3, schedule=schedule)
    assert again.lr == pytest.approx(1e-3)  # a fresh one starts at the first step's rate
    again.load(tmp_path / "ckpt")
    assert again.lr == pytest.approx(policy.lr)
    again.step_schedule()
    assert again.lr == pytest.approx(1e-3 * (1 + math.cos(math.pi * 3 / 4)) / 2)
    (tmp_path / "ckpt" / "scheduler.pt").unlink()  # written before schedules were saved
    with pytest.raises(ConfigError, match=r"optim\.schedule=constant"):
        again.load(tmp_path / "ckpt")


@pytest.mark.slow
def test_cosine_schedule_drives_the_optimizer_through_the_loop_and_a_resume(
    narrow_model_dir: Path, tmp_path: Path
) -> None:
    """optim.schedule=cosine, warmup 1, 3 steps: the rates are lr * [1, 1, 0.5] (k = 0 ends
    the warmup; k = 1, 2 decay with p = 0, 1/2). They are logged as optim/lr, and a run
    stopped after step 2 and resumed runs step 3 at lr / 2. On the narrow tiny model."""
    from areal_agents.trainer.loop import Trainer

    seen: list[float] = []

    class Recording(Trainer):
        async def _train_step(self, got, *args):
            out = await super()._train_step(got, *args)
            seen.append(self.policy.optimizer.param_groups[0]["lr"])  # after the step
            return out

    out = tmp_path / "run"
    overrides = [
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={narrow_model_dir}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "rollout.max_head_offpolicyness=0",
        "sampling.max_new_tokens=4",
        "rollout.max_turns=1",
        "optim.lr=1e-3",
        "optim.schedule=cosine",
        "optim.warmup_steps=1",
        "optim.total_steps=3",
        "train.save_every=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
    ]
    asyncio.run(Recording(load_config(None, [*overrides, "train.steps=2"]), quiet=True).run())
    second = Recording(load_config(None, [*overrides, "train.steps=3"]), resume=True, quiet=True)
    asyncio.run(second.run())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["optim/lr"] for r in rows] == pytest.approx([1e-3, 1e-3, 5e-4])
    # the rate after each step is the next step's: 1e-3, then 5e-4, then 0 (past T)
    assert seen == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-12)
