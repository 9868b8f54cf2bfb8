"""``scheduler: ray``: rollouts on Ray actors (engine + rollout workers) while training stays in
this process; the new weights reach the engine actor after every step."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_agents import spans
from areal_agents.trainer.config_io import load_config


@pytest.mark.slow
@pytest.mark.parametrize("idle_engine", [False, True], ids=["one-engine", "idle-replica"])
def test_scheduler_ray_trains_with_rollouts_on_ray_workers(
    cluster, tiny_model_dir, tmp_path, idle_engine
):
    """With the engine pinned to the first core and the trainer to the last (the
    disaggregated layout of benchmarks/async_vs_sync.py --setting pinned); with
    ``idle-replica``, a second engine replica at the idle priority on the trainer's core
    (``rollout.idle_engine_cpus``) serves episodes too, takes every weight update, and its
    compute counts on the trainer's core."""
    import os

    import torch

    from areal_agents.hardware import pin_to_cpus
    from areal_agents.trainer.loop import Trainer

    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    engine_core, trainer_core = cores[0], cores[-1]
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
            f"rollout.engine_cpus=[{engine_core}]",
            f"train.cpus=[{trainer_core}]",
            f"rollout.idle_engine_cpus={[trainer_core] if idle_engine else 'null'}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    try:
        summary = asyncio.run(trainer.run())
        assert os.sched_getaffinity(0) == {trainer_core} and torch.get_num_threads() == 1
    finally:  # the rest of the session runs on every core again
        pin_to_cpus(cores, "every core")
        torch.set_num_threads(threads)
    info = trainer.engine.info
    if idle_engine:
        assert info["cpus"] == [[engine_core], [trainer_core]]
        assert info["lanes"] == ["engine", "engine_idle"]
        assert info["idle_priority"] == [False, True]
    else:
        assert info["cpus"] == [[engine_core]], "the engine actor runs on its core"
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
    # The engine actor's spans reach the run's spans.jsonl and the busy metrics, on the
    # trainer's clock: each decode lies inside the run's time.
    _, rows_s = spans.read(tmp_path / "run" / "spans.jsonl")
    decodes = [r for r in rows_s if r["lane"] == "engine" and r["name"] == "decode"]
    assert decodes and any(r["lane"] == "trainer" and r["name"] == "backward" for r in rows_s)
    last = max(r["end"] for r in rows_s)
    assert all(0 <= r["start"] < r["end"] <= last + 1e-3 for r in decodes)
    for r in rows:
        assert r["time/busy_engine"] > 0 and r["time/busy_trainer"] > 0
        two = (r["time/busy_engine"] + r["time/busy_trainer"]) / 2
        if not idle_engine:
            assert r["time/busy_cores"] == pytest.approx(two)
            continue
        # the idle replica's compute on the trainer's core counts there, at most once
        guest = r.get("time/busy_engine_idle", 0.0)
        assert two - 1e-9 <= r["time/busy_cores"] <= two + guest / 2 + 1e-9
    if idle_engine:  # both replicas served episodes and took the weights of both steps
        for lane in ("engine", "engine_idle"):
            names = [r["name"] for r in rows_s if r["lane"] == lane]
            assert "decode" in names and names.count("weight_update") >= 2, lane


def _dist_ranks():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "trainer" / "dist_ranks.py"
    spec = importlib.util.spec_from_file_location("dist_ranks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_trainer_ranks_as_ray_actors_take_the_step_one_process_takes(cluster, narrow_model_dir):
    """``RayRanks``: 2 actors form their own gloo group by a rendezvous at rank 0's actor;
    GRPO with LoRA and KL and PPO in full, 2 steps each, equal one process to 1e-5 (the
    weights to ``WEIGHT_TOL``). On the narrow tiny model, as tests/trainer/test_distributed.py."""
    import torch

    from areal_agents.trainer.critic import Critic
    from areal_agents.trainer.distributed import DistributedCritic, DistributedPolicy, RayRanks
    from areal_agents.trainer.model_build import model_kwargs
    from areal_agents.trainer.policy import Policy

    dr = _dist_ranks()
    model = str(narrow_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the actors (OMP_NUM_THREADS=1): the same summation order
    torch.manual_seed(0)
    base = Policy(model, dtype="float32", device="cpu")
    episodes = _episodes(base)
    ranks = RayRanks(2, seed=0, timeout_s=120)
    try:
        for name in ("grpo-lora", "ppo-full"):
            cfg = dr.case_config(name, model)
            policy_kw, critic_kw = model_kwargs(cfg, cfg.algorithm_spec(), model)
            torch.manual_seed(0)
            one = Policy(**policy_kw)
            one_critic = None if critic_kw is None else Critic(**critic_kw)
            want = dr.train_steps(one, one_critic, episodes, cfg, range(2))
            torch.manual_seed(0)  # the actors' adapters come from rank 0's own seed
            ranks.call("", "__seed__", (0,))
            policy = DistributedPolicy(ranks, ranks.build("policy", "policy", policy_kw))
            critic = None
            if critic_kw is not None:
                critic = DistributedCritic(ranks, ranks.build("critic", "critic", critic_kw))
            got = dr.train_steps(policy, critic, episodes, cfg, range(2))
            for g, w in zip(got, want, strict=True):
                for k in w:
                    assert g[k] == pytest.approx(w[k], abs=1e-5, rel=1e-5), f"{name}: {k}"
            a, b = policy.weight_update(2).state_dict, one.weight_update(2).state_dict
            assert a.keys() == b.keys()
            assert max(float((a[k] - b[k]).abs().max()) for k in a) <= dr.WEIGHT_TOL, name
            assert policy.lr == pytest.approx(one.lr) and policy.is_lora == one.is_lora
    finally:
        ranks.stop()
        torch.set_num_threads(threads)


def _episodes(policy):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "trainer" / "test_distributed.py"
    spec = importlib.util.spec_from_file_location("test_distributed_for_ray", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._episodes(policy)


@pytest.mark.slow
def test_scheduler_ray_with_two_trainer_ranks_runs_to_the_end(cluster, tiny_model_dir, tmp_path):
    """``scheduler: ray`` and ``train.nproc=2``: the engine, the rollout workers and the two
    trainer ranks are actors; the loop, the source and the proxy stay here."""
    from areal_agents.trainer.loop import train

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "scheduler=ray",
            "train.nproc=2",
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.device=cpu",
            "model.lora.enabled=true",
            "rollout.group_size=2",
            "rollout.batch_size=3",
            "rollout.concurrency=4",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "train.save_every=1",
            "optim.lr=1e-2",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    summary = train(cfg, quiet=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["version"] == 1.0
    assert all(r["weight_sync_s"] > 0 for r in rows)
    assert (out / "checkpoints" / "step-000002" / "rng-rank1.pt").exists()
    assert (out / "final" / "config.json").exists()
