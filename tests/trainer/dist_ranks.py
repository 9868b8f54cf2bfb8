"""What the trainer ranks of ``test_distributed.py`` run (``run_ranks(n, [this file, MODE,
...])``), and the parity cases both sides share.

Modes: ``parity DATA OUT`` trains every case on the ranks; ``raise`` / ``kill``: rank 1
raises, or kills itself, while rank 0 waits in a collective; ``hang DIR``: every rank
writes its pid and waits forever.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

COMMON = [
    "env.id=areal/Calculator-v0",
    # float32 everywhere: with dtype auto a CPU with native bfloat16 holds a LoRA case's
    # frozen base in bfloat16, whose rounding differs between packings by far more than 1e-5
    "model.dtype=float32",
    "sampling.max_new_tokens=16",
    "rollout.max_head_offpolicyness=1",
    "train.micro_batch_tokens=40",
    "optim.lr=0.001",
]
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
CASES: dict[str, list[str]] = {
    "grpo-lora": ["algorithm=grpo", *LORA, "loss.kl_coef=0.1", "loss.proximal=recompute"],
    "dapo-lora": ["algorithm=dapo", *LORA, "train.minibatches=2"],
    "dr_grpo-lora": ["algorithm=dr_grpo", *LORA],
    "ppo-lora": [
        "algorithm=ppo",
        *LORA,
        "loss.proximal=recompute",
        "critic.lr=0.001",
        "model.activation_checkpointing=true",
    ],
    "grpo-full": ["algorithm=grpo", "loss.kl_coef=0.1", "model.activation_checkpointing=true"],
    "ppo-full": ["algorithm=ppo", "critic.lr=0.001"],
}
RESUMED = ("grpo-lora", "ppo-full")
"""Cases also resumed on the ranks from the one-process checkpoint after step 1."""


WEIGHT_TOL = 1e-4
"""How far a weight of the ranks may lie from one process's after the steps. The losses,
norms and records match to 1e-5; the weights are looser because AdamW's step is
``lr * m / (sqrt(v) + eps)``: an element whose gradient is within float noise of zero moves
by up to ``lr`` either way, and a small gradient's relative noise becomes a fraction of
``lr`` (measured: up to 5.4e-5 at lr 1e-3 on one CPU, under 1e-5 on another). A missed or
doubled reduction moves every element by O(lr) = 1e-3."""


SFT_CASE = "grpo-lora"
"""The case whose fresh policy also runs a warm start (:func:`warm_start`) on the ranks."""


def warm_start(policy: Any, model: str) -> dict[str, float]:
    """A warm start on 5 calculator demonstrations (batches of 3 and 2: odd splits) with
    40-token micro-batches."""
    from areal_agents.envs.registry import make
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.trainer.sft import run_sft

    env = make("areal/Calculator-v0", kind="arithmetic")
    _, info = env.reset(seed=0)
    demos = env.unwrapped.demos(5, seed=0, kind="arithmetic")
    env.close()
    tok = ChatTokenizer.from_dir(model)
    kw = {"epochs": 1, "lr": 1e-3, "micro_batch_tokens": 40, "batch_size": 3, "seed": 0}
    return run_sft(policy, tok, demos, info["tools"], **kw)


def case_config(name: str, model: str) -> Any:
    from areal_agents.trainer.config_io import load_config

    return load_config(None, [*COMMON, *CASES[name], f"model.path={model}"])


def train_steps(policy: Any, critic: Any, episodes: list, cfg: Any, steps: range) -> list[dict]:
    """``train_on_batch`` on the same episodes for ``steps``; each step's loss and norms, and
    sums over the ``train_tokens`` rows its records give (on ranks: gathered by rank 0)."""
    from areal_agents.trainer.batch import build_batch
    from areal_agents.trainer.step import train_on_batch, train_token_rows

    spec = cfg.algorithm_spec()
    out = []
    for version in steps:
        batch, _ = build_batch(episodes, spec, cfg.rollout.gamma, cfg.sampling.max_new_tokens, 1.0)
        done = train_on_batch(policy, critic, batch, spec, cfg, version, record=True)
        stats, records = done.stats, done.records
        step = {
            k: stats[k]
            for k in ("loss", "grad_norm", "value_grad_norm", "value_loss")
            if k in stats
        }
        rows = train_token_rows(records, version + 1, version)
        step["recorded_rows"] = float(len(rows))
        for name in ("advantages", "train_logprobs", "prox_logprobs", "behaviour_weights"):
            step[f"recorded_{name}"] = sum(x for r in rows for x in r[name] if x == x)  # not NaN
        out.append(step)
    return out


def _parity(data_path: str, out_dir: str) -> None:
    from areal_agents.trainer import fsdp
    from areal_agents.trainer.distributed import DistributedCritic, DistributedPolicy, Ranks, serve
    from areal_agents.trainer.model_build import model_kwargs

    data = pickle.loads(Path(data_path).read_bytes())
    if fsdp.rank() != 0:
        serve(seed=0)
        return
    ranks = Ranks(seed=0)
    out = Path(out_dir)
    results: dict[str, Any] = {}
    jobs = [(name, None) for name in CASES] + [(name, "resume") for name in RESUMED]
    for name, how in jobs:
        cfg = case_config(name, data["model"])
        torch.manual_seed(0)  # the one process's adapters and head start from this seed
        policy_kw, critic_kw = model_kwargs(cfg, cfg.algorithm_spec(), data["model"])
        policy = DistributedPolicy(ranks, ranks.build("policy", "policy", policy_kw))
        critic = None
        if critic_kw is not None:
            critic = DistributedCritic(ranks, ranks.build("critic", "critic", critic_kw))
        key = name if how is None else f"{name}+resume"
        steps = range(2)
        if how == "resume":  # a checkpoint one process wrote after step 1
            ckpt = Path(data["checkpoints"][name])
            policy.load(ckpt)
            if critic is not None:
                critic.load(ckpt / "critic")
            steps = range(1, 2)
        t0 = time.perf_counter()
        results[key] = {"steps": train_steps(policy, critic, data["episodes"], cfg, steps)}
        results[key]["seconds"] = time.perf_counter() - t0
        update = policy.weight_update(2)
        torch.save(update.state_dict, out / f"{key}.weights.pt")
        policy.save(out / key)
        if critic is not None:
            critic.save(out / key / "critic")
    cfg = case_config(SFT_CASE, data["model"])
    torch.manual_seed(0)
    policy_kw, _ = model_kwargs(cfg, cfg.algorithm_spec(), data["model"])
    policy = DistributedPolicy(ranks, ranks.build("policy", "policy", policy_kw))
    results["sft"] = warm_start(policy, data["model"])
    torch.save(policy.weight_update(1).state_dict, out / "sft.weights.pt")
    ranks.stop()
    (out / "results.json").write_text(json.dumps(results))


def main(argv: list[str]) -> None:
    from areal_agents.trainer import fsdp

    mode = argv[0]
    fsdp.GATHER_BUCKET_BYTES = 1 << 16  # many buckets: LoRA tensors share one, big ones alone
    fsdp.init_process_group(timeout_s=120)
    try:
        if mode == "parity":
            _parity(argv[1], argv[2])
        elif mode in ("raise", "kill"):
            if fsdp.rank() == 1:
                time.sleep(1)
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("rank one broke on purpose")
            dist.barrier()  # rank 0 waits for a peer that never comes
        elif mode == "hang":
            Path(argv[1], f"pid-{fsdp.rank()}").write_text(str(os.getpid()))
            if fsdp.rank() == 0:
                time.sleep(3600)
            dist.barrier()
    finally:
        fsdp.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from areal_agents.trainer.distributed import _die_with_parent

    _die_with_parent()
    record(main)(sys.argv[1:])
