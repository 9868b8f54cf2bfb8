"""The asynchronous RL loop behind ``areal-agent train``.

Choices made:

* One process, one event loop. Rollout groups (``rollout.group_size`` episodes of one task)
  come from a group source (:mod:`areal_agents.trainer.rollout`: the model driving the env,
  the user's agent in this process, agents in their own processes through the worker API,
  or any of these on Ray), generated continuously through the recording proxy and the
  engine (its own worker thread), while the trainer trains (in a worker thread). The loop
  itself only takes the next batch, trains, syncs the weights, logs and checkpoints.
* Staleness is bounded by AReaL's capacity rule (:mod:`areal_agents.trainer.staleness`);
  eta = 0 is the synchronous baseline. Every output token carries its policy version; the
  metrics log how stale each consumed token was.
* After each optimizer step the new weights (the LoRA adapter only, with LoRA) reach the
  engine, which interrupts generation in flight: later tokens carry the new version.
* The loss is the decoupled PPO objective of the configured algorithm
  (:mod:`areal_agents.trainer.loss`, :mod:`areal_agents.trainer.algorithms`): behaviour
  logprobs come from the engine, proximal logprobs from a recompute pass
  (``loss.proximal=recompute``) or the log-linear approximation, and the behaviour weight is
  always applied in async mode. One step on a batch is :mod:`areal_agents.trainer.step`.
* Advantages come from per-completion discounted returns along each episode's completion
  tree, normalized over the group's episodes by group id; by default every episode weighs
  the same, however many turns it has.
* PPO (``spec.needs_critic``) instead takes per-token GAE advantages from a critic
  (:mod:`areal_agents.trainer.critic`): its values before the step, rewards on each
  completion's last token, then one critic step on the clipped value loss after the policy
  step. The critic and its optimizer are checkpointed and resumed with the policy.
* Data position: group g of the run uses env seed ``seed_base + g``. A checkpoint
  (:mod:`areal_agents.trainer.checkpoint`) stores the groups consumed so far; on resume, every
  started-but-unconsumed group is generated again and nothing consumed is used twice.

* ``train.nproc > 1`` (or ``train.fsdp``): the policy and critic are FSDP2 ranks
  (:mod:`areal_agents.trainer.distributed`); this loop runs on rank 0 unchanged, its policy
  and critic then send each call to every rank with that rank's part of the batch.
* After each step, what the loss did with every trained completion (its advantages, current
  and proximal logprobs, behaviour weights, clip flags, return and merge decision) goes to
  the run's episode store as ``train_tokens`` rows (step = the metrics' step), written by
  the store's writer thread. With trainer ranks, each rank's records come back to rank 0
  with the step's result, and rank 0 alone writes (with ``scheduler: ray`` through the
  store-writer actor the rollout workers' proxies record through too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch
from tqdm import tqdm

from areal_agents import run_state as run_file
from areal_agents import spans
from areal_agents.engines.embedded import FairLock
from areal_agents.errors import ConfigError
from areal_agents.hardware import default_device, pin_to_cpus
from areal_agents.model import resolve_model
from areal_agents.rollout.observe import observe_prompt
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.trainer.algorithms import check_async_correction
from areal_agents.trainer.batch import build_batch
from areal_agents.trainer.calibration import calibrate_judge
from areal_agents.trainer.checkpoint import (
    RunState,
    append_ledger,
    restore_checkpoint,
    save_checkpoint,
)
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_io import dump_yaml
from areal_agents.trainer.distributed import Ranks, RayRanks, launch
from areal_agents.trainer.engine_build import check_lora_targets, first_sync
from areal_agents.trainer.heldout import HeldOut
from areal_agents.trainer.metrics import MetricsWriter
from areal_agents.trainer.model_build import build_models
from areal_agents.trainer.protocols import Critic, Policy, Trainable
from areal_agents.trainer.rollout import Group
from areal_agents.trainer.rollout_build import build_rollout
from areal_agents.trainer.run_dir import claim_output_dir
from areal_agents.trainer.sft import (
    SftOptions,
    demo_tools,
    load_demos,
    load_episode_samples,
    run_sft,
)
from areal_agents.trainer.step import (
    ADDITIVE_STATS,
    Update,
    apply_update,
    record_train_tokens,
    train_on_batch,
)
from areal_agents.trainer.time_budget import TimeBoxed, out_of_time_budget

if TYPE_CHECKING:
    from areal_agents.rollout.runner import EpisodeResult

log = logging.getLogger(__name__)
T = TypeVar("T")

Summary = dict[str, float | str | None]
"""What a run returns: its last step's metrics, ``held_out`` (the held-out evaluations'
line), ``final_model`` (its path), and ``stopped_by_request`` / ``stopped_by_time_limit``
when the run stopped early."""


class StepMetrics(NamedTuple):
    """A training step's metrics (:meth:`Trainer._train_step`), as ``_publish`` logs them."""

    scalars: dict[str, float]
    staleness: list[float]
    """Per trained token, how many versions behind the policy it was sampled (a histogram)."""


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
"""The cores this process may run on: ``time/cpu`` is its CPU time over wall time x CORES."""
ENGINE_COUNTERS = (
    "prefills",
    "prefill_tokens",
    "prefix_hit_tokens",
    "prefix_full_hits",
    "prefill_batches",
    "decode_steps",
    "cascade_steps",
    "output_tokens",
    "interruptions",
    "restarts",
    "requests",
    "updates",
)


# ---------------------------------------------------------------------------- the run
class Trainer:
    """Owns the engine, the group source and the policy of one run."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        quiet: bool = False,
        ranks: Ranks | RayRanks | None = None,
    ) -> None:
        """``ranks``: rank 0's command channel (``areal_agents.trainer.distributed.Ranks``) when the
        trainer is sharded (``train.nproc > 1`` or ``train.fsdp``); ``train`` sets it up."""
        if cfg.train.sharded and ranks is None:
            raise ConfigError(
                f"train.nproc={cfg.train.nproc} (fsdp={cfg.train.fsdp}): the ranks are started "
                "by areal_agents.trainer.loop.train or areal-agent train, not by Trainer itself"
            )
        self.ranks = ranks
        self.cfg = cfg
        self.quiet = quiet
        self.spec = cfg.algorithm_spec()
        check_async_correction(
            cfg.rollout.max_head_offpolicyness, self.spec.loss.behaviour_correction
        )
        self.out = Path(cfg.train.output_dir)
        self.resume = resume or cfg.train.resume
        if claim_output_dir(cfg, self.resume) is not cfg:  # train() and the CLI claim it first
            raise ConfigError(f"{cfg.train.output_dir} already holds a run; see train.if_exists")
        self.out.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, self.out / "config.yaml")
        self._fills: list[Update] = []  # the last batch's updates still to repeat (fill_passes)
        self.policy: Policy
        self.critic: Critic | None
        self.state = RunState()
        self._engine_last: tuple[float, float, float] | None = None  # time, tokens, steps
        self._phase = "starting"  # RUN_DIR/run.json's phase (run_state)
        self._saved_step = -1  # the step of the newest checkpoint (-1: none yet)
        self._last_eval: dict[str, float] = {}  # the latest held-out evaluation's metrics

    # -- setup -------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.cfg
        _seed_everything(cfg.train.seed)
        self.model_path = resolve_model(cfg.model.path, quiet=self.quiet)
        self.tokenizer = ChatTokenizer.from_dir(self.model_path)
        # On CPU the engine and the trainer share the cores: their forward passes take turns.
        lock = FairLock() if default_device(cfg.model.device).startswith("cpu") else None
        self.policy, self.critic = build_models(
            cfg, self.spec, self.model_path, self.ranks, lock, quiet=self.quiet
        )
        if cfg.train.cpus is not None and cfg.scheduler == "ray":
            # Before Ray starts, so its processes (and the rollout workers) share the
            # trainer's cores; the engine actor moves itself to rollout.engine_cpus.
            pin_to_cpus(cfg.train.cpus, "train.cpus")
        rollout = build_rollout(
            cfg,
            model_path=self.model_path,
            tokenizer=self.tokenizer,
            compute_lock=lock,
            state=self.state,
            out=self.out,
            dynamic_sampling=self.spec.dynamic_sampling,
            quiet=self.quiet,
        )
        self.engine, self.source = rollout.engine, rollout.source
        if self.ranks is None:  # trainer ranks hold theirs elsewhere
            check_lora_targets(self.policy.model, cfg)
        if cfg.train.cpus is not None and cfg.scheduler != "ray":
            pin_to_cpus(cfg.train.cpus, "train.cpus")
        self._lane_cores = spans.pinned_lane_cores(
            cfg.rollout.engine_cpus, cfg.train.cpus, cfg.rollout.idle_engine_cpus
        )
        self.make_env = self.source.make_env
        self.seed_base = self.source.settings.seed_base
        self.held_out = HeldOut(cfg, self.out)  # a bad eval section fails here

    async def _start(self) -> None:
        """Resume from the latest checkpoint, or warm-start; then the engine gets the
        weights and the source starts producing groups. The first step's time accounting
        (``time/*``) starts here, after the models are loaded."""
        self._t_window, self._cpu_window = time.perf_counter(), time.process_time()
        if self.source.judge is not None:  # an unreachable judge fails before any episode
            await self.source.judge.start()
        resumed = self.resume and self._restore()
        if resumed:
            self._t_start -= self.state.elapsed_s
            if not self.quiet:
                print(f"resumed from step {self.state.step}", file=sys.stderr)
        elif self.cfg.sft.enabled:
            await self._evaluate("base")
            with spans.span("trainer", "warm_start"):
                await asyncio.to_thread(self._warm_start)
            self._checkpoint()  # step 0: the warm-started model; a resume skips the warm start
        await first_sync(
            self.cfg, self.engine, self.policy.weight_update(self.state.step), self.out
        )
        if self.source.judge is not None:  # a judge that cannot tell right from wrong stops here
            with spans.span("rollout", "judge_calibration"):
                await calibrate_judge(self.cfg, self.source, self.out, quiet=self.quiet)
        if not resumed:
            await self._evaluate("warm_start" if self.cfg.sft.enabled else "base")
        await self._engine_counters()  # the start of the first step's engine rates
        await self.source.start(version=self.state.step)

    async def _evaluate(self, label: str) -> dict[str, float]:
        """The held-out evaluation (``eval``; :mod:`areal_agents.trainer.heldout`) of the
        weights the engine holds now, as ``label``; its ``eval/*`` metrics."""
        if not self.held_out.enabled:
            return {}
        last = self.held_out.results[-1:]
        if label == "final" and last and last[0]["step"] == self.state.step:
            self.held_out.record_again(label)  # the last step was just evaluated
            writer = getattr(self, "_metrics_writer", None)
            if writer is not None:
                writer.log_held_out(self.state.step, label, self._last_eval)
            return {}
        before = self._phase
        self._set_phase("evaluating")
        with spans.span("rollout", "held_out", label=label):
            scalars = await self.held_out.run(
                self.source, label, self.state.step, progress=not self.quiet
            )
        writer = getattr(self, "_metrics_writer", None)  # None: before the run's writer
        if writer is not None:
            writer.log_held_out(self.state.step, label, scalars)
        self._last_eval = scalars
        self._set_phase(before)
        return scalars

    def _warm_start(self) -> None:
        """Supervised warm start on ``sft.demos``: chat messages rendered with the env's tools
        (with an in-process agent, the way that agent's prompts look: ``observe_prompt``), or
        recorded episodes' training samples as they are (``sft.kind: episodes``). Runs on a
        thread of its own (the agent probe gets an event loop of its own there)."""
        cfg = self.cfg
        self._set_phase("warm_start")
        policy = self._sft_policy()
        if cfg.sft.kind == "episodes":  # recorded token ids: no env, template or agent
            pairs, skipped = load_episode_samples(cfg.sft.demos or "", self.policy.vocab_size)
            self._finish_warm_start(
                run_sft(
                    policy,
                    self.tokenizer,
                    [],
                    None,
                    tokenized=pairs,
                    skipped_episodes=skipped,
                    **self._sft_args(),
                ),
                policy,
            )
            return
        maker, tools = None, None
        if self.make_env is not None:  # None: a self-rewarded run, no env
            env = self.make_env()
            _, info = env.reset(seed=self.seed_base)
            maker, tools = getattr(env.unwrapped, "demos", None), info.get("tools") or None
            env.close()
        path = cfg.sft.demos or ""
        if cfg.sft.generate:
            if maker is None:
                raise ConfigError(
                    f"sft.generate: {cfg.env.id} offers no demos(); write the demonstrations "
                    "yourself (JSONL, one list of chat messages per line) and set sft.demos"
                )
            rows = maker(cfg.sft.generate, seed=cfg.train.seed, **cfg.sft.generate_kwargs)
            path = str(self.out / "sft_demos.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps({"messages": m}) + "\n" for m in rows)
        demos = load_demos(path)
        if self.source.local_agent is not None:
            # rendered the way the agent's prompts look: its messages before the env's
            # (instructions), its tool list, through the same chat template
            prefix, tools = asyncio.run(
                observe_prompt(
                    self.source.local_agent, self.make_env, self.tokenizer, seed=self.seed_base
                )
            )
            demos = [d if d[: len(prefix)] == prefix else [*prefix, *d] for d in demos]
        tools = demo_tools(path) or tools  # rows rendered for an agent carry its tools
        self._finish_warm_start(
            run_sft(policy, self.tokenizer, demos, tools, **self._sft_args()), policy
        )

    def _sft_policy(self) -> Trainable:
        """The policy as the warm start trains it: under ``train.time_limit_min`` a
        :class:`TimeBoxed` view of it (the warm start spends the run's budget too)."""
        limit = self.cfg.train.time_limit_min
        if limit is None:
            return self.policy
        return TimeBoxed(self.policy, self._elapsed, 60 * limit)

    def _sft_args(self) -> SftOptions:
        cfg = self.cfg
        return {
            "epochs": cfg.sft.epochs,
            "lr": cfg.sft.lr,
            "batch_size": cfg.sft.batch_size,
            "micro_batch_tokens": cfg.train.micro_batch_tokens,
            "seed": cfg.train.seed,
            "progress": not self.quiet,
        }

    def _finish_warm_start(self, stats: dict[str, float], policy: Trainable | None = None) -> None:
        """A fresh optimizer and schedule for RL; the warm start's stats in ``sft.json``
        (with ``sft_skipped_batches`` when ``train.time_limit_min`` cut it short)."""
        if isinstance(policy, TimeBoxed):
            stats.update(policy.stats())
            if not policy.steps:  # no batch trained: no loss to report
                stats.pop("sft_nll", None)
            if policy.skipped and not self.quiet:
                print(
                    f"train.time_limit_min={self.cfg.train.time_limit_min}: the warm start "
                    f"stopped after {policy.steps} batches ({policy.skipped} skipped; "
                    f"{self._elapsed() / 60:.1f} min)",
                    file=sys.stderr,
                )
        self.policy.reset_optimizer(self.cfg.optim.lr)
        (self.out / "sft.json").write_text(json.dumps(stats))
        if not self.quiet:
            print(f"warm start: {stats}", file=sys.stderr)

    def _set_phase(self, phase: str, **changes: int) -> None:
        """What the run does now, in ``RUN_DIR/run.json`` (with other ``changes``)."""
        self._phase = phase
        run_file.update_file(self.out, phase=phase, **changes)

    # -- checkpoints --------------------------------------------------------------
    def _elapsed(self) -> float:
        """Wall-clock seconds of the run so far (warm start included, over resumes)."""
        return time.perf_counter() - self._t_start

    def _checkpoint(self) -> None:
        self.state.elapsed_s = self._elapsed()
        save_checkpoint(self.out, self.state, self.policy, self.critic)
        self._saved_step = self.state.step

    def _restore(self) -> bool:
        restored = restore_checkpoint(self.out, self.policy, self.critic)
        if restored is not None:
            self.state.__dict__.update(restored.__dict__)  # the source holds this object
            self._saved_step = self.state.step
        return restored is not None

    def _consumed(self, groups: list[Group]) -> None:
        st = self.state
        st.step += 1
        st.consumed_groups += [g for g, _ in groups]
        st.episodes_consumed += sum(len(eps) for _, eps in groups)
        append_ledger(self.out, st.step, groups, trained_agents=self.cfg.agent.train)

    def _stop_requested(self) -> bool:
        """Whether ``areal-agent stop`` asked the run to stop (``RUN_DIR/stop``); then the
        steps done so far are checkpointed (unless they just were)."""
        if run_file.read_stop_request(self.out) is None:
            return False
        if self.state.step > 0 and self._saved_step != self.state.step:
            self._checkpoint()
        if not self.quiet:
            print(f"stop requested: stopping after step {self.state.step}", file=sys.stderr)
        return True

    def _out_of_time(self, recent: deque[float]) -> bool:
        limit = self.cfg.train.time_limit_min
        if limit is None or not out_of_time_budget(self._elapsed(), list(recent), 60 * limit):
            return False
        if not self.quiet:
            print(
                f"train.time_limit_min={limit}: stopping after step {self.state.step} "
                f"({self._elapsed() / 60:.1f} min; another step would overrun)",
                file=sys.stderr,
            )
        return True

    def _metrics(self) -> MetricsWriter:
        m = self.cfg.metrics
        return MetricsWriter(
            self.out,
            jsonl=m.jsonl,
            tensorboard=m.tensorboard,
            wandb=m.wandb,
            tags={"engine": self.cfg.engine.backend},
        )

    def _progress_bar(self) -> tqdm:
        return tqdm(
            total=self.cfg.train.steps,
            initial=self.state.step,
            desc="train",
            unit="step",
            disable=self.quiet,
            file=sys.stderr,
        )

    # -- main --------------------------------------------------------------------
    async def run(self) -> Summary:
        """Steps (:meth:`_step`: next batch, train step, weight sync, log, checkpoint) until
        ``train.steps``, ``train.time_limit_min`` or ``areal-agent stop``; then the final
        held-out evaluation, and the final model (LoRA merged) is exported."""
        self._t_start = time.perf_counter()
        spans.record_to(self.out / "spans.jsonl")  # where the time goes: spans.py
        self._build()
        metrics, bar = self._metrics(), self._progress_bar()
        self._metrics_writer = metrics
        recent: deque[float] = deque(maxlen=4)  # step durations, s
        summary: Summary = {}
        try:
            await self._start()
            self._set_phase("training", step=self.state.step)
            while self.state.step < self.cfg.train.steps:
                if self._stop_requested():  # areal-agent stop: no final evaluation or export
                    summary["stopped_by_request"] = True
                    return summary
                if not recent and self._out_of_time(recent):  # the warm start spent it all
                    summary["stopped_by_time_limit"] = True
                    break
                scalars, stop = await self._step(recent, metrics, bar)
                summary = {**scalars}
                if stop:
                    summary["stopped_by_time_limit"] = True
                    break
            await self.source.stop()  # the final evaluation has the engine to itself
            await self._evaluate("final")
            summary["held_out"] = self.held_out.line()
        finally:
            await self._close(bar, metrics)
        self._set_phase("exporting")
        final = self.policy.export(self.out / "final", self.model_path, merge_lora=True)
        summary["final_model"] = str(final)
        return summary

    async def _step(
        self, recent: deque[float], metrics: MetricsWriter, bar: tqdm
    ) -> tuple[dict[str, float], bool]:
        """One step of :meth:`run`: the next batch (:meth:`_next_batch`), the train step
        (:meth:`_train_step`), the new weights to the engine and the metrics
        (:meth:`_publish`), a checkpoint when one is due, the progress bar. Returns the
        step's metrics and whether ``train.time_limit_min`` leaves no time for another."""
        cfg, st = self.cfg, self.state
        t0 = time.perf_counter()
        groups, fill = await self._next_batch()
        t_wait = time.perf_counter() - t0 - fill["fill_s"]
        step = await self._train_step(groups, st.step, t_wait, self.source.dropped)
        scalars = await self._publish(groups, {**step.scalars, **fill}, step.staleness, metrics)
        recent.append(time.perf_counter() - t0)
        stop = self._out_of_time(recent)
        every = cfg.train.save_every
        if stop or st.step == cfg.train.steps or (every and st.step % every == 0):
            self._checkpoint()
        run_file.update_file(self.out, step=st.step)
        bar.update()
        bar.set_postfix(
            reward=f"{scalars['reward_mean']:.2f}",
            success=f"{scalars['success_rate']:.0%}" if "success_rate" in scalars else "-",
            stale=f"{scalars['staleness_mean']:.2f}",
            gen_tps=f"{scalars['gen_tokens_per_s']:.0f}",
        )
        return scalars, stop

    async def _close(self, bar: tqdm, metrics: MetricsWriter) -> None:
        """The end of :meth:`run`, however it ends: the source (groups in flight end here: a
        resume redoes them), the progress bar, the metrics, the spans and the engine."""
        await self.source.close()
        bar.close()
        metrics.close()
        spans.stop()
        await self.engine.close()

    async def _next_batch(self) -> tuple[list[Group], dict[str, float]]:
        """The next batch; while it is not complete, the last batch's updates again
        (``train.fill_passes``), one at a time. Returns it with how many updates filled the
        wait and how long they took."""
        n, done, t0 = self.cfg.rollout.batch_size, 0, time.perf_counter()
        while self._fills and not self.source.ready(n):
            update = self._fills.pop(0)
            await asyncio.to_thread(apply_update, self.policy, update, self.spec, self.cfg)
            done += 1
        t_fill = time.perf_counter() - t0
        self._fills = []  # the next batch is in: its own updates replace these
        engine = getattr(self, "engine", None)  # None: a test's trainer without one
        groups = await _unless_engine_fails(self.source.next_batch(n), engine)
        return groups, {"fill_updates": float(done), "fill_s": t_fill}

    async def _publish(
        self,
        groups: list[Group],
        scalars: dict[str, float],
        staleness: list[float],
        metrics: MetricsWriter,
    ) -> dict[str, float]:
        """After a step: the ledger, the new weights to the engine (``weight_sync_s``: how
        long that took), the step's metrics, then the source's new version. Returns the
        metrics as logged: ``scalars``, the sync's and the time shares, an evaluation's."""
        self._consumed(groups)
        t0 = time.perf_counter()
        with spans.span("trainer", "weight_sync", version=self.state.step):
            await self.engine.update_weights(self.policy.weight_update(self.state.step))
        now = time.perf_counter()
        scalars = {**scalars, "weight_sync_s": now - t0}
        recorder = spans.current()
        take = getattr(self.engine, "take_spans", None)  # an engine in a process of its own
        if take is not None:
            recorder.merge(await take())
        window = recorder.window(self._t_window, now)
        scalars.update(spans.busy_idle(window, self._t_window, now, cores=self._lane_cores))
        cpu = time.process_time()  # every thread of this process, user + system
        scalars["time/cpu"] = (cpu - self._cpu_window) / ((now - self._t_window) * CORES)
        self._t_window, self._cpu_window = now, cpu
        recorder.flush()
        every = self.cfg.eval.every
        if every and self.state.step % every == 0:  # while the rollouts go on
            scalars.update(await self._evaluate(f"step-{self.state.step}"))
        metrics.log(self.state.step, scalars, {"staleness": staleness})
        await self.source.set_version(self.state.step)
        return scalars

    async def _train_step(
        self, got: list[Group], version: int, t_wait: float, dropped: Counter[str]
    ) -> StepMetrics:
        """Train on the groups ``got`` (:func:`areal_agents.trainer.step.train_on_batch`);
        returns the step's metrics."""
        cfg = self.cfg
        results = [r for _, eps in got for r in eps]
        episodes = [r.episode for r in results]
        batch, bstats = build_batch(
            episodes,
            self.spec,
            cfg.rollout.gamma,
            cfg.sampling.max_new_tokens,
            cfg.sampling.temperature,
            trained_agents=cfg.agent.train,
        )
        t0 = time.perf_counter()
        lrs = {"optim/lr": self.policy.lr}  # the rates of this step's updates
        if self.critic is not None:
            lrs["optim/critic_lr"] = self.critic.lr
        store = getattr(self.source, "store", None)  # None: the step's tokens go nowhere
        done = await asyncio.to_thread(
            train_on_batch,
            self.policy,
            self.critic,
            batch,
            self.spec,
            cfg,
            version,
            record=store is not None,
        )
        self._fills = list(done.updates) * cfg.train.fill_passes  # while the next batch comes
        t_train = time.perf_counter() - t0
        if store is not None:
            await asyncio.to_thread(record_train_tokens, store, done.records, version)
        stats = dict(done.stats)
        policy_keys = set(stats) - {"grad_norm", "micro_batches", "entropy_sum", "tokens"}
        policy_keys -= {k for k in stats if k.startswith("value_")}
        tokens = stats.pop("tokens", 0.0) or 1.0
        stale = [
            version - int(v)
            for vs, m in zip(batch.versions, batch.mask, strict=True)
            for v, keep in zip(vs.tolist(), m.tolist(), strict=True)
            if keep
        ]
        gen_tokens = sum(r.output_tokens for r in results)
        gen_time = max((r.duration_s for r in results), default=1.0)
        known = [bool(r.success) for r in results if r.success is not None]
        scalars: dict[str, float] = {
            "reward_mean": sum(r.reward for r in results) / len(results),
            # over the episodes that report success (self-rewarded sessions do not)
            **({"success_rate": sum(known) / len(known)} if known else {}),
            "turns_mean": sum(r.turns for r in results) / len(results),
            **_tool_call_metrics(results),
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
            "elapsed_s": self._elapsed(),
            **lrs,
            **bstats,
            **done.batch_stats,
            **{
                f"loss/{k}": float(v) if k in ADDITIVE_STATS or k not in policy_keys else v / tokens
                for k, v in stats.items()
            },
            **{f"dropped/{k}": float(v) for k, v in dropped.items()},
        }
        scalars.update(await self._engine_counters())
        scalars.update(self.source.metrics())
        return StepMetrics(scalars, [float(s) for s in stale])

    async def _engine_counters(self) -> dict[str, float]:
        """The engine's running totals (prefills and their batches, prefill and prefix-hit
        tokens, decode steps, output tokens) as ``engine/*`` metrics, where its health report
        carries them, and two rates since the previous call:

            engine/output_tokens_per_s = d(output_tokens) / d(wall-clock)
            engine/decode_rows_mean    = d(output_tokens) / d(decode_steps)

        the first counts every generated token (groups that dynamic sampling drops too, which
        ``gen_tokens_per_s`` leaves out), the second is how full the decode batches were."""
        try:
            health = await self.engine.health()
        except Exception as exc:  # a metric must not end the run
            log.warning("engine health unavailable: %r", exc)
            return {}
        now = time.perf_counter()
        out = {
            f"engine/{k}": float(health[k])
            for k in ENGINE_COUNTERS
            if isinstance(health.get(k), int | float)
        }
        tokens, steps = out.get("engine/output_tokens"), out.get("engine/decode_steps")
        if tokens is None or steps is None:
            return out
        then, tokens0, steps0 = self._engine_last or (now, tokens, steps)
        if tokens >= tokens0:  # counters that went back: an engine restarted, no rate this step
            if now > then:
                out["engine/output_tokens_per_s"] = (tokens - tokens0) / (now - then)
            if steps > steps0:
                out["engine/decode_rows_mean"] = (tokens - tokens0) / (steps - steps0)
        self._engine_last = (now, tokens, steps)
        return out


async def _unless_engine_fails(wait: Awaitable[T], engine: object, poll_s: float = 1.0) -> T:
    """Await ``wait`` unless the engine gives up first (a server that died more often than
    ``engine.launch.max_restarts``): then its error ends the run instead of a wait for
    episodes that can no longer come."""
    task = asyncio.ensure_future(wait)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            failure = getattr(engine, "failure", None)
            if failure is not None:
                raise failure
    finally:
        if not task.done():
            task.cancel()


def _tool_call_metrics(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """``tool_calls_mean`` (tool calls per episode) and ``tool_call_valid_rate`` (the share
    whose result was not an error), over the episodes whose env ran the tools; {} when none
    did, and no rate without a call."""
    counted = [r for r in results if r.tool_calls is not None]
    calls = sum(r.tool_calls or 0 for r in counted)
    out = {"tool_calls_mean": calls / len(counted)} if counted else {}
    if calls:
        out["tool_call_valid_rate"] = 1.0 - sum(r.tool_errors or 0 for r in counted) / calls
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig, *, resume: bool = False, quiet: bool = False) -> Summary:
    """Run ``cfg`` to completion (blocking); returns the last step's metrics. A sharded
    trainer (``train.nproc > 1`` or ``train.fsdp``) runs on ranks that
    ``areal_agents.trainer.distributed.launch`` starts, or on Ray actors (``RayRanks``) with
    ``scheduler: ray``."""
    cfg = claim_output_dir(cfg, resume)  # before run.json: a refused directory keeps its own
    run_file.clear_stop_request(cfg.train.output_dir)  # it was for the run's last start
    with run_file.run_log(cfg.train.output_dir):  # RUN_DIR/train.log
        writer = run_file.RunStateWriter(cfg.train.output_dir, target_steps=cfg.train.steps)
        try:
            summary = _train(cfg, resume=resume, quiet=quiet)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM (areal_agents.cli.main)
            writer.end("stopped", "stopped")
            raise
        except BaseException as exc:
            writer.end("failed", f"failed: {type(exc).__name__}: {exc}"[:2000])
            raise
        stopped = summary.get("stopped_by_request")  # areal-agent stop
        limit = "time_limit" if summary.get("stopped_by_time_limit") else "steps_done"
        writer.end("stopped" if stopped else "finished", "stopped" if stopped else limit)
        return summary


def _train(cfg: TrainConfig, *, resume: bool, quiet: bool) -> Summary:
    if cfg.train.sharded and cfg.scheduler == "ray":
        ranks = RayRanks(cfg.train.nproc, cfg.train.seed, cfg.train.collective_timeout_s)
        try:
            return asyncio.run(Trainer(cfg, resume=resume, quiet=quiet, ranks=ranks).run())
        finally:
            ranks.stop()
    if cfg.train.sharded:
        return launch(cfg, resume=resume, quiet=quiet)
    return asyncio.run(Trainer(cfg, resume=resume, quiet=quiet).run())
