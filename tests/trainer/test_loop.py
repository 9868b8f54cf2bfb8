"""The training loop's parts on a tiny model: packing, the gate, every algorithm, resume."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_agents.trajectory import Completion, Episode
from trainer.algorithms import ALGORITHMS
from trainer.config import load_config
from trainer.loop import _algorithm, build_batch, make_loss_fn
from trainer.policy import Policy, pack
from trainer.staleness import StalenessGate


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)


def test_pack_fills_budget_without_splitting():
    bins = pack([5, 3, 8, 2, 9], max_tokens=10)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    lengths = [5, 3, 8, 2, 9]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3


def test_packed_logprobs_equal_one_sequence_at_a_time(policy):
    seqs = [list(range(10, 30)), list(range(40, 47)), list(range(5, 18))]
    packed = policy.logprobs(seqs, temperature=0.7, micro_batch_tokens=64)
    for seq, lp in zip(seqs, packed, strict=True):
        (alone,) = policy.logprobs([seq], temperature=0.7)
        assert lp.shape == (len(seq) - 1,)
        assert torch.allclose(lp, alone, atol=1e-5)
    with torch.no_grad():
        logits = policy.model(torch.tensor([seqs[0]])).logits[0, :-1].float() / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(seqs[0][1:]).unsqueeze(1))
    assert torch.allclose(packed[0], ref.squeeze(1), atol=1e-5)


async def test_gate_eta0_admits_one_batch_per_version_and_eta2_three():
    gate = StalenessGate(batch_size=2, eta=0)
    await gate.acquire()
    await gate.acquire()
    assert gate.capacity() == 0
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await gate.finish(accepted=True)
    await gate.finish(accepted=True)
    await asyncio.sleep(0.01)
    assert not waiter.done(), "eta=0: the next batch waits for the next version"
    await gate.set_version(1)
    await asyncio.wait_for(waiter, 1)
    gate2 = StalenessGate(batch_size=2, eta=2)
    for _ in range(6):
        await asyncio.wait_for(gate2.acquire(), 1)
    assert gate2.capacity() == 0
    await gate2.finish(accepted=False)  # a rejected group frees its slot
    assert gate2.capacity() == 1


def _episodes(policy: Policy, n_groups: int = 2, size: int = 3) -> list[Episode]:
    """Groups of scripted one- and two-turn episodes with behaviour logprobs from the policy."""
    eps = []
    g = torch.Generator().manual_seed(0)
    for gi in range(n_groups):
        for k in range(size):
            ep = Episode(f"e{gi}-{k}", group_id=f"g{gi}")
            prompt = list(range(100 + gi, 112 + gi))
            out = torch.randint(200, 300, (5 + k,), generator=g).tolist()
            (lp,) = policy.logprobs([prompt + out], 1.0)
            c = Completion(
                f"c{gi}{k}",
                [{"role": "user", "content": "q"}],
                prompt,
                out,
                lp[-len(out) :].tolist(),
                [0] * len(out),
                {"role": "assistant", "content": f"a{k}"},
                "stop",
            )
            ep.add(c)
            if k == 2:  # a second turn that extends the first exactly
                prompt2 = [*prompt, *out, 7, 8]
                out2 = [301, 302, 303]
                (lp2,) = policy.logprobs([prompt2 + out2], 1.0)
                ep.add(
                    Completion(
                        f"d{gi}{k}",
                        [
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": f"a{k}"},
                            {"role": "user", "content": "more"},
                        ],
                        prompt2,
                        out2,
                        lp2[-3:].tolist(),
                        [0] * 3,
                        {"role": "assistant", "content": "b"},
                        "stop",
                    )
                )
            ep.final_reward = float(k == gi)
            eps.append(ep)
    return eps


@pytest.mark.parametrize("name", sorted(n for n, s in ALGORITHMS.items() if not s.needs_critic))
def test_every_algorithm_trains_two_steps(tiny_model_dir, name):
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            f"algorithm={name}",
            "rollout.max_head_offpolicyness=1",
            "sampling.max_new_tokens=16",
        ],
    )
    spec = _algorithm(cfg)
    before = {k: v.clone() for k, v in policy.model.named_parameters()}
    for step in range(2):
        batch, stats = build_batch(_episodes(policy), spec, 1.0, 16)
        assert stats["merge_rate"] == 1.0
        batch.prox = policy.logprobs(batch.seqs, 1.0)
        out = policy.train_step(batch.seqs, make_loss_fn(batch, spec, cfg, step), 1.0, 64)
        assert torch.isfinite(torch.tensor(out["grad_norm"]))
        assert out["micro_batches"] >= 2
    changed = [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]
    assert changed, f"{name}: no parameter changed"


def test_lora_sync_ships_adapter_only(tiny_model_dir):
    policy = Policy(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    update = policy.weight_update(version=3)
    assert update.kind == "lora" and update.version == 3
    assert update.state_dict and all("lora_" in k for k in update.state_dict)


def _train_cmd(tiny_model_dir: Path, out: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal_agents.cli",
        "train",
        "--quiet",
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=2",
        "rollout.max_head_offpolicyness=1",
        "sampling.max_new_tokens=8",
        f"train.steps={steps}",
        "train.save_every=1",
        f"train.output_dir={out}",
    ]


@pytest.mark.slow
def test_kill_9_then_resume_loses_and_repeats_no_group(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _train_cmd(tiny_model_dir, out, 4),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() >= "step-000002"):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run(
        [*_train_cmd(tiny_model_dir, out, 4), "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    groups = [r["group"] for r in rows]
    assert len(set(groups)) == len(groups), "a group was consumed twice"
    state = json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["episodes_consumed"] == 16
    unconsumed = set(range(state["next_group"])) - set(groups) - set(state["skipped_groups"])
    assert all(g >= max(groups) for g in unconsumed), "an earlier group was lost"
    assert (out / "final" / "config.json").exists()


@pytest.mark.slow
def test_eta0_async_loop_equals_a_synchronous_step(tiny_model_dir, tmp_path):
    """With max_head_offpolicyness = 0 the loop is the synchronous baseline: the same groups,
    all sampled by version 0, and the same update as generating first and then training."""
    import envs
    from envs.base import AgentEnv
    from trainer.loop import Trainer

    class Parity(AgentEnv):
        """One turn; the reward depends on the sampled text, so advantages are not all 0."""

        def _start(self, options):
            return [{"role": "user", "content": "Say something."}], {"task_id": "parity"}

        def tools(self):
            return []

        def _respond(self, message):
            reward = float(len(message.get("content") or "") % 2)
            return [], reward, True, {"success": reward > 0}

    envs.register("test/Parity-v0", Parity, description="reply length parity", override=True)

    def cfg_for(out: Path):
        return load_config(
            None,
            [
                "env.id=test/Parity-v0",
                f"model.path={tiny_model_dir}",
                "model.dtype=float32",
                "rollout.group_size=4",
                "rollout.batch_size=2",
                "rollout.max_head_offpolicyness=0",
                "sampling.max_new_tokens=8",
                "train.steps=1",
                "optim.lr=1e-2",
                "metrics.tensorboard=false",
                f"train.output_dir={out}",
            ],
        )

    class Recording(Trainer):
        async def _train_step(self, got, *args):
            self.got = got
            return await super()._train_step(got, *args)

    trainer = Recording(cfg_for(tmp_path / "async"), quiet=True)
    summary = asyncio.run(trainer.run())
    assert summary["staleness_max"] == 0.0  # every token was sampled by version 0
    assert summary["adv_abs_max"] > 0, "the test needs a nonzero gradient"
    trained = {k: v.clone() for k, v in trainer.policy.model.named_parameters()}

    ref = Trainer(cfg_for(tmp_path / "sync"), quiet=True)
    ref._build()

    async def sync_step() -> None:
        groups = await asyncio.gather(
            *[
                ref.runner.run_group(
                    ref.make_env,
                    4,
                    seed=ref.seed_base + g,
                    group_id=f"g{g}",
                    sampling_seed=(ref.seed_base + g) * 4,
                )
                for g in range(2)
            ]
        )
        await ref.engine.close()

        # The loop trained on exactly these groups: same tasks, same sampled tokens.
        def outputs(results):
            return sorted(tuple(c.output_ids) for r in results for c in r.episode.completions)

        assert {g: outputs(eps) for g, eps in trainer.got} == {
            g: outputs(eps) for g, eps in enumerate(groups)
        }
        episodes = [r.episode for group in groups for r in group]
        batch, _ = build_batch(episodes, ref.spec, 1.0, 8)
        batch.prox = ref.policy.logprobs(batch.seqs, 1.0)
        ref.policy.train_step(batch.seqs, make_loss_fn(batch, ref.spec, ref.cfg, 0), 1.0)

    asyncio.run(sync_step())
    initial = dict(Policy(str(tiny_model_dir), dtype="float32").model.named_parameters())
    sync_delta = torch.cat(
        [(v - initial[k]).flatten() for k, v in ref.policy.model.named_parameters()]
    )
    async_delta = torch.cat([(trained[k] - initial[k]).flatten() for k in initial])
    assert sync_delta.norm() > 0, "the step changed nothing"
    # Same samples, same loss: the updates agree up to float summation order (a handful of
    # near-zero-gradient entries that Adam's normalisation amplifies).
    assert (async_delta - sync_delta).norm() / sync_delta.norm() < 1e-2
    assert torch.nn.functional.cosine_similarity(async_delta, sync_delta, dim=0) > 0.998
