"""The asynchronous RL loop behind ``areal-agent train``.

Choices made:

* One process, one event loop. Rollout groups (``rollout.group_size`` episodes of one task)
  are generated continuously by the episode runner through the recording proxy and the
  embedded engine (its own worker thread), while the trainer trains (in a worker thread).
* Staleness is bounded by AReaL's capacity rule (:mod:`trainer.staleness`); eta = 0 is the
  synchronous baseline. Every output token carries its policy version; the metrics log how
  stale each consumed token was.
* After each optimizer step the new weights (the LoRA adapter only, with LoRA) reach the
  engine, which interrupts generation in flight: later tokens carry the new version.
* The loss is the decoupled PPO objective of the configured algorithm (:mod:`trainer.loss`,
  :mod:`trainer.algorithms`): behaviour logprobs come from the engine, proximal logprobs
  from a recompute pass (``loss.proximal=recompute``) or the log-linear approximation, and
  the behaviour weight is always applied in async mode.
* Advantages come from per-completion discounted returns along each episode's completion
  tree, normalized over the group's episodes by group id; by default every episode weighs
  the same, however many turns it has.
* Data position: group g of the run uses env seed ``seed_base + g``. A checkpoint stores the
  groups consumed so far; on resume, every started-but-unconsumed group is generated again
  and nothing consumed is used twice.

Left out: a PPO critic inside this loop (``ppo`` is refused here until it has one), a
reference model for KL, multi-node training (see the Ray scheduler issue).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from areal_agents.chat import ChatTokenizer
from areal_agents.embedded import FairLock
from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.proxy import Proxy
from areal_agents.runner import EpisodeResult, Runner
from areal_agents.trajectory import Episode

from .advantage import completion_returns, filter_uniform_groups
from .algorithms import AlgorithmSpec, check_async_correction, get_algorithm
from .config import TrainConfig, dump_yaml
from .metrics import MetricsWriter
from .policy import Policy
from .staleness import StalenessGate


@dataclass
class RunState:
    """What a checkpoint must remember besides the weights and the optimizer."""

    step: int = 0
    next_group: int = 0
    consumed_groups: list[int] = field(default_factory=list)
    skipped_groups: list[int] = field(default_factory=list)
    """Groups rejected (too few usable episodes, or uniform rewards under dynamic sampling)."""
    episodes_consumed: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- batch math
@dataclass
class Batch:
    seqs: list[list[int]]
    mask: list[torch.Tensor]  # per sample, over tokens 1..n-1
    behav: list[torch.Tensor]
    versions: list[torch.Tensor]
    adv: list[torch.Tensor]
    weights: list[torch.Tensor]
    segments: list[torch.Tensor]
    prox: list[torch.Tensor] | None = None


def build_batch(
    episodes: list[Episode], spec: AlgorithmSpec, gamma: float, max_tokens: int
) -> tuple[Batch, dict[str, float]]:
    """Training samples with per-token advantages and batch-normalized loss weights."""
    rows = completion_returns(episodes, gamma)
    adv = spec.advantage.group(rows.returns, rows.group_ids, rows.episode_ids, rows.roots)
    adv_of = dict(zip(rows.completion_ids, adv.tolist(), strict=True))
    seqs, tcs, sample_eps = [], [], []
    out = Batch([], [], [], [], [], [], [])
    merged = eligible = 0
    for ep in episodes:
        samples, merges = ep.samples(gamma)
        merged += sum(1 for m in merges if m["merged"])
        eligible += sum(1 for m in merges if m["reason"] != "root")
        for s in samples:
            seqs.append(s.input_ids)
            tcs.append(s.token_completion[1:])
            sample_eps.append(ep.session_id)
            tok_adv = [
                adv_of[s.completion_ids[k]] if k >= 0 else 0.0 for k in s.token_completion[1:]
            ]
            out.mask.append(torch.tensor(s.loss_mask[1:], dtype=torch.float32))
            out.behav.append(torch.tensor(s.logprobs[1:], dtype=torch.float32))
            out.versions.append(torch.tensor(s.versions[1:]))
            out.adv.append(torch.tensor(tok_adv, dtype=torch.float32))
            out.segments.append(torch.tensor(s.token_completion[1:]))
    width = max(len(t) for t in tcs)
    tc = torch.full((len(tcs), width), -1, dtype=torch.long)
    for i, t in enumerate(tcs):
        tc[i, : len(t)] = torch.tensor(t)
    w = spec.loss.weights(tc, sample_eps, max_tokens=max_tokens)
    out.weights = [w[i, : len(t)] for i, t in enumerate(tcs)]
    out.seqs = seqs
    stats = {
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv_abs_max": float(adv.abs().max()),
        "merge_rate": merged / eligible if eligible else 0.0,
        "samples": len(seqs),
    }
    return out, stats


def _pad(xs: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value)


def make_loss_fn(batch: Batch, spec: AlgorithmSpec, cfg: TrainConfig, version: int) -> Any:
    """The callback ``Policy.train_step`` calls for each micro-batch."""

    def loss_fn(
        items: list[int], logps: list[torch.Tensor], ents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logp = _pad(logps)
        mask = _pad([batch.mask[i] for i in items])
        behav = _pad([batch.behav[i] for i in items])
        if cfg.loss.proximal == "recompute":
            assert batch.prox is not None
            prox = _pad([batch.prox[i] for i in items])
        else:
            from .loss import approx_proximal_logp

            prox = approx_proximal_logp(
                behav, logp, _pad([batch.versions[i] for i in items]), version + 1, version
            )
        loss, stats = spec.loss.policy_loss(
            logp,
            behav,
            prox,
            _pad([batch.adv[i] for i in items]),
            mask,
            weights=_pad([batch.weights[i] for i in items]),
            segment_ids=_pad([batch.segments[i] for i in items], -1).long(),
            max_tokens=cfg.sampling.max_new_tokens,
        )
        n = float(mask.sum())
        stats = dict(stats)
        stats["entropy_sum"] = float((_pad(ents) * mask).sum())
        stats["tokens"] = n
        return loss, stats

    return loss_fn


# ---------------------------------------------------------------------------- the run
class Trainer:
    """Owns the engine, proxy, runner and policy of one run."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.spec = _algorithm(cfg)
        check_async_correction(
            cfg.rollout.max_head_offpolicyness, self.spec.loss.behaviour_correction
        )
        self.out = Path(cfg.train.output_dir)
        self.resume = resume or cfg.train.resume
        if not self.resume and (self.out / "checkpoints").exists():
            raise ConfigError(
                f"{self.out} already holds a run; pass --resume to continue it "
                "or set train.output_dir to a new directory"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, self.out / "config.yaml")
        self.state = RunState()

    # -- setup -------------------------------------------------------------------
    def _build(self) -> None:
        from areal_agents.embedded import EmbeddedEngine
        from envs.registry import make

        cfg = self.cfg
        _seed_everything(cfg.train.seed)
        self.model_path = resolve_model(cfg.model.path, quiet=self.quiet)
        self.tokenizer = ChatTokenizer.from_dir(self.model_path)
        dtype = "float32" if cfg.model.dtype == "auto" else cfg.model.dtype
        lora = None
        if cfg.model.lora.enabled:
            lora = {
                "r": cfg.model.lora.r,
                "lora_alpha": cfg.model.lora.alpha,
                "lora_dropout": cfg.model.lora.dropout,
                "target_modules": list(cfg.model.lora.target_modules),
            }
        # On CPU the engine and the trainer share the cores: their forward passes take turns.
        on_cpu = not torch.cuda.is_available() or (cfg.model.device or "").startswith("cpu")
        lock = FairLock() if on_cpu else None
        self.policy = Policy(
            self.model_path,
            dtype=dtype,
            device=cfg.model.device,
            lora=lora,
            activation_checkpointing=cfg.model.activation_checkpointing,
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            betas=tuple(cfg.optim.betas),  # type: ignore[arg-type]
            grad_clip=cfg.optim.grad_clip or float("inf"),
            compute_lock=lock,
        )
        engine_dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
        self.engine = EmbeddedEngine.from_pretrained(
            self.model_path,
            dtype=engine_dtype,
            device=cfg.model.device,
            decode=self.tokenizer.decode,
            max_batch_size=max(cfg.rollout.concurrency, 1),
            compute_lock=lock,
        )
        self.proxy = Proxy(self.engine, self.tokenizer)
        s = cfg.sampling
        sampling = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_tokens": s.max_new_tokens,
        }
        self.runner = Runner(
            self.proxy,
            concurrency=cfg.rollout.concurrency,
            max_turns=cfg.rollout.max_turns,
            episode_timeout_s=cfg.rollout.episode_timeout_s or 1e9,
            sampling=sampling,
        )
        kwargs = dict(cfg.env.kwargs)
        probe = make(cfg.env.id, **kwargs)
        if "split" in inspect.signature(type(probe.unwrapped).__init__).parameters:
            kwargs.setdefault("split", cfg.env.split)
        probe.close()
        self.make_env = lambda: make(cfg.env.id, **kwargs)
        self.seed_base = cfg.env.seed if cfg.env.seed is not None else cfg.train.seed * 100_000

    def _warm_start(self) -> None:
        """Supervised warm start on ``sft.demos`` (rendered with the env's tools)."""
        from .sft import load_demos, run_sft

        cfg = self.cfg
        if cfg.sft.kind != "messages":
            raise ConfigError("sft.kind=episodes is not supported yet; use sft.kind=messages")
        env = self.make_env()
        _, info = env.reset(seed=self.seed_base)
        env.close()
        stats = run_sft(
            self.policy,
            self.tokenizer,
            load_demos(cfg.sft.demos or ""),
            info.get("tools") or None,
            epochs=cfg.sft.epochs,
            lr=cfg.sft.lr,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            seed=cfg.train.seed,
        )
        self.policy.reset_optimizer(cfg.optim.lr)
        (self.out / "sft.json").write_text(json.dumps(stats))
        if not self.quiet:
            print(f"warm start: {stats}", file=sys.stderr)

    # -- checkpoints --------------------------------------------------------------
    def _checkpoint(self) -> None:
        d = self.out / "checkpoints" / f"step-{self.state.step:06d}"
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.policy.save(tmp)
        (tmp / "state.json").write_text(json.dumps(self.state.__dict__))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)  # a checkpoint directory is complete or absent
        (self.out / "checkpoints" / "latest").write_text(d.name)

    def _restore(self) -> bool:
        latest = self.out / "checkpoints" / "latest"
        if not latest.exists():
            return False
        d = self.out / "checkpoints" / latest.read_text().strip()
        self.policy.load(d)
        self.state = RunState(**json.loads((d / "state.json").read_text()))
        rng = torch.load(d / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        _truncate_ledger(self.out / "groups.jsonl", self.state.step)
        return True

    # -- main --------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        self._build()
        cfg, st = self.cfg, self.state
        if self.resume and self._restore():
            st = self.state
            if not self.quiet:
                print(f"resumed from step {st.step}", file=sys.stderr)
        elif cfg.sft.enabled:
            await asyncio.to_thread(self._warm_start)
        version = st.step
        await self.engine.update_weights(self.policy.weight_update(version))
        B, G = cfg.rollout.batch_size, cfg.rollout.group_size
        gate = StalenessGate(
            B, cfg.rollout.max_head_offpolicyness, version=version, accepted=len(st.consumed_groups)
        )
        queue: asyncio.Queue[tuple[int, list[EpisodeResult]]] = asyncio.Queue()
        done = set(st.consumed_groups) | set(st.skipped_groups)
        redo = [g for g in range(st.next_group) if g not in done]
        metrics = MetricsWriter(
            self.out,
            jsonl=cfg.metrics.jsonl,
            tensorboard=cfg.metrics.tensorboard,
            wandb=cfg.metrics.wandb,
        )
        dropped: Counter[str] = Counter(st.dropped)

        async def one_group(g: int) -> None:
            results = await self.runner.run_group(
                self.make_env,
                G,
                seed=self.seed_base + g,
                group_id=f"g{g}",
                sampling_seed=(self.seed_base + g) * G,
            )
            for r in results:
                if not r.ok:
                    dropped[r.end_reason] += 1
            ok = [r for r in results if r.ok and r.episode.completions]
            keep = len(ok) >= 2
            if keep and self.spec.dynamic_sampling:
                rewards = torch.tensor([r.reward for r in ok])
                keep = bool(filter_uniform_groups(rewards, [f"g{g}"] * len(ok)).any())
                if not keep:
                    dropped["uniform_group"] += 1
            await gate.finish(accepted=keep)
            if keep:
                await queue.put((g, ok))
            else:
                st.skipped_groups.append(g)  # never redone; the gate admits a new group

        async def producer() -> None:
            tasks = set()
            while True:
                await gate.acquire()
                if redo:
                    g = redo.pop(0)
                else:
                    g = st.next_group
                    st.next_group += 1
                t = asyncio.create_task(one_group(g))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        prod = asyncio.create_task(producer())
        bar = tqdm(
            total=cfg.train.steps,
            initial=st.step,
            desc="train",
            unit="step",
            disable=self.quiet,
            file=sys.stderr,
        )
        summary: dict[str, Any] = {}
        try:
            while st.step < cfg.train.steps:
                t0 = time.perf_counter()
                got = [await queue.get() for _ in range(B)]
                t_wait = time.perf_counter() - t0
                summary = await self._train_step(got, version, t_wait, metrics, dropped)
                version += 1
                st.step += 1
                st.consumed_groups += [g for g, _ in got]
                st.episodes_consumed += sum(len(eps) for _, eps in got)
                st.dropped = dict(dropped)
                with (self.out / "groups.jsonl").open("a") as f:
                    for g, eps in got:
                        f.write(
                            json.dumps({"step": st.step, "group": g, "episodes": len(eps)}) + "\n"
                        )
                await self.engine.update_weights(self.policy.weight_update(version))
                await gate.set_version(version)
                if st.step % cfg.train.save_every == 0 or st.step == cfg.train.steps:
                    self._checkpoint()
                bar.update()
                bar.set_postfix(
                    reward=f"{summary['reward_mean']:.2f}",
                    success=f"{summary['success_rate']:.0%}",
                    stale=f"{summary['staleness_mean']:.2f}",
                    gen_tps=f"{summary['gen_tokens_per_s']:.0f}",
                )
        finally:
            prod.cancel()
            bar.close()
            metrics.close()
            await self.engine.close()
        final = self.policy.export(self.out / "final", self.model_path, merge_lora=True)
        summary["final_model"] = str(final)
        return summary

    async def _train_step(
        self,
        got: list[tuple[int, list[EpisodeResult]]],
        version: int,
        t_wait: float,
        metrics: MetricsWriter,
        dropped: Counter[str],
    ) -> dict[str, Any]:
        cfg = self.cfg
        results = [r for _, eps in got for r in eps]
        episodes = [r.episode for r in results]
        batch, bstats = build_batch(
            episodes, self.spec, cfg.rollout.gamma, cfg.sampling.max_new_tokens
        )
        temp = cfg.sampling.temperature
        t0 = time.perf_counter()
        if cfg.loss.proximal == "recompute":
            batch.prox = await asyncio.to_thread(
                self.policy.logprobs, batch.seqs, temp, cfg.train.micro_batch_tokens
            )
        loss_fn = make_loss_fn(batch, self.spec, cfg, version)
        stats = await asyncio.to_thread(
            self.policy.train_step, batch.seqs, loss_fn, temp, cfg.train.micro_batch_tokens
        )
        t_train = time.perf_counter() - t0
        tokens = stats.pop("tokens", 0.0) or 1.0
        stale = [
            version - int(v)
            for vs, m in zip(batch.versions, batch.mask, strict=True)
            for v, keep in zip(vs.tolist(), m.tolist(), strict=True)
            if keep
        ]
        gen_tokens = sum(r.output_tokens for r in results)
        gen_time = max((r.duration_s for r in results), default=1.0)
        scalars = {
            "reward_mean": sum(r.reward for r in results) / len(results),
            "success_rate": sum(bool(r.success) for r in results) / len(results),
            "turns_mean": sum(r.turns for r in results) / len(results),
            "episode_tokens_mean": gen_tokens / len(results),
            "loss": stats.get("loss", 0.0),
            "grad_norm": stats["grad_norm"],
            "entropy": stats.pop("entropy_sum", 0.0) / tokens,
            "staleness_mean": sum(stale) / max(len(stale), 1),
            "staleness_max": float(max(stale, default=0)),
            "train_tokens_per_s": tokens / max(t_train, 1e-9),
            "gen_tokens_per_s": gen_tokens / max(gen_time, 1e-9),
            "wait_s": t_wait,
            "train_s": t_train,
            "version": float(version),
            **bstats,
            **{f"loss/{k}": float(v) for k, v in stats.items()},
            **{f"dropped/{k}": float(v) for k, v in dropped.items()},
        }
        metrics.log(self.state.step + 1, scalars, {"staleness": [float(s) for s in stale]})
        return scalars


def _algorithm(cfg: TrainConfig) -> AlgorithmSpec:
    """The configured algorithm, with every ``loss.*`` value the config sets (not None)."""
    import dataclasses

    spec = get_algorithm(cfg.algorithm)
    if spec.needs_critic:
        raise ConfigError(
            f"algorithm {cfg.algorithm!r} needs a critic, which the training loop does not "
            "run yet; choose a critic-free algorithm (grpo, dr_grpo, rloo, gspo, dapo, "
            "lite_ppo, reinforce_pp, sapo, m2po)"
        )
    names = (
        "clip_low",
        "clip_high",
        "behaviour_correction",
        "behaviour_cap",
        "kl_coef",
        "agg",
        "weighting",
    )
    changes = {n: getattr(cfg.loss, n) for n in names if getattr(cfg.loss, n) is not None}
    loss = dataclasses.replace(spec.loss, **changes)
    adv = dataclasses.replace(spec.advantage, gamma=cfg.rollout.gamma)
    return dataclasses.replace(spec, loss=loss, advantage=adv)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _truncate_ledger(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def train(cfg: TrainConfig, *, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run ``cfg`` to completion (blocking); returns the last step's metrics."""
    return asyncio.run(Trainer(cfg, resume=resume, quiet=quiet).run())
