"""Training configuration: small frozen dataclasses, one per component, and one loader.

``TrainConfig`` composes ``env``, ``model`` (with ``lora``), ``algorithm``, ``sampling``,
``rollout``, ``context`` (what the proxy does with conversations that outgrow the model's
context), ``optim``, ``loss``, ``critic`` (PPO's value model), ``advantage`` (the
estimator, when not the algorithm's own), ``train``, ``sft``,
``metrics``, ``agent`` (the user's agent in this process), ``workers`` (the worker API of
external agents) and ``scheduler``. Only ``env.id`` has no default (``model.path: null`` is the
default model, ``algorithm: grpo``)::

    cfg = load_config("run.yaml", ["rollout.group_size=16", "optim.betas=[0.9, 0.95]"])

``load_config`` checks every key, type and value and raises one ``ConfigError`` listing
every problem with its key and fix. It has no side effects. ``dump_yaml`` writes the
resolved config beside a run's outputs; loading that file gives an equal object.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from areal_agents.errors import ConfigError

# fmt: off
ALGORITHMS = ("grpo", "dr_grpo", "lite_ppo", "rloo", "gspo", "dapo", "ppo", "reinforce_pp",
              "reinforce_pp_baseline", "sapo", "m2po")
# fmt: on
"""The values of ``TrainConfig.algorithm`` (``areal_agents.trainer.algorithms`` defines each)."""

GROUP_ALGORITHMS = frozenset(ALGORITHMS) - {"ppo", "reinforce_pp"}
"""Algorithms whose advantages are normalized within a group: they need group_size >= 2."""

CRITIC_ALGORITHMS = frozenset({"ppo"})
"""Algorithms that train a critic (the ``critic`` section applies to them only)."""

DYNAMIC_SAMPLING_ALGORITHMS = frozenset({"dapo"})
"""Algorithms that drop groups whose rewards are all equal (``rollout.probe_size`` applies)."""


def _cores_ok(cores: tuple[int, ...] | None) -> bool:
    """None, or a non-empty list of distinct core numbers >= 0."""
    return cores is None or (bool(cores) and min(cores) >= 0 and len(set(cores)) == len(cores))


class _Checked:
    """Mixin: a section checks its values when built (all problems at once)."""

    def __post_init__(self) -> None:
        if problems := self._problems():
            raise ConfigError(f"invalid {type(self).__name__}", problems=problems)

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        """``(field, holds, rule)`` for each value check of this section."""
        return ()

    def _problems(self) -> list[str]:
        """This section's value problems, each as ``"field: what is wrong"``."""
        return [
            f"{n}: must be {r}, got {getattr(self, n)!r}" for n, ok, r in self._rules() if not ok
        ]


@dataclass(frozen=True)
class EnvConfig(_Checked):
    """Which environment to train on."""

    id: str | None = None
    """Registered environment id, e.g. ``areal/Math-v0`` (see ``areal-agent envs``).
    Required, except in self-rewarded runs (``rollout.agents: self_rewarded``), which have
    no env."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``make(id, **kwargs)``."""
    split: str = "train"
    """Task split to train on, passed to the environment as ``split``."""
    seed: int | None = None
    """Seed of task sampling; None = ``train.seed``."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return [("id", self.id != "", "a registered id, e.g. areal/Math-v0")]


@dataclass(frozen=True)
class LoraConfig(_Checked):
    """Low-rank adapters (through peft); only the adapter is trained and synced."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight."""
    r: int = 16
    """Adapter rank."""
    alpha: float = 32.0
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Names (suffixes) of the linear modules that get adapters."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("r", self.r >= 1, ">= 1"),
            ("alpha", self.alpha > 0, "> 0"),
            ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
            ("target_modules", bool(self.target_modules) or not self.enabled, "non-empty"),
        )


@dataclass(frozen=True)
class ModelConfig(_Checked):
    """The policy model: served for rollouts and trained."""

    path: str | None = None
    """Local directory or hub id; None = the offline default model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype. auto: the engine serves in bfloat16 where the device computes it
    natively (CUDA with bf16, CPUs with AVX512-BF16 / AMX / Arm BF16), else float32; the
    trainer holds the weights in bfloat16 only then and with LoRA (the frozen base), else
    float32. An explicit bfloat16 on a CPU without it runs far slower (a warning says so)."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None = cuda when available, else cpu."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters; off by default (full fine-tuning)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_context: int | None = None
    """Longest prompt + output in tokens: the engine stops there and the proxy refuses a
    prompt this long (400 ``context_length_exceeded``); None = the model's own limit."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        device_ok = bool(re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", self.device or "cpu"))
        return (
            ("device", device_ok, "'cpu', 'cuda', 'cuda:N' (or null = auto)"),
            ("max_context", self.max_context is None or self.max_context >= 1, ">= 1 or null"),
        )


@dataclass(frozen=True)
class ContextConfig(_Checked):
    """What the proxy does with a conversation that outgrows ``model.max_context``, for
    env-driven, in-process and external agents alike (:mod:`areal_agents.serve.context`)."""

    policy: Literal["fail", "truncate_tool_results", "summarize"] = "fail"
    """``fail``: the call is a 400 ``context_length_exceeded`` and the episode ends as
    ``context_overflow``. ``truncate_tool_results``: the oldest tool results are replaced by
    a marker until the prompt leaves ``reserve_tokens`` free. ``summarize``: the model
    summarizes the older turns (a recorded call of its own) and they are sent as that
    summary; truncation when the summary does not make it fit. A rewritten call starts a
    new segment: a training sample of its own, its returns still along the episode's tree."""
    reserve_tokens: int = 512
    """Tokens kept free for the answer: a request is rewritten once its prompt + this would
    exceed the context (the rewriting policies only)."""
    keep_last_turns: int = 2
    """The last this many turns (an assistant message and the tool results after it) are
    never truncated nor summarized; 0 = none kept (the rewriting policies only)."""
    summary_max_tokens: int = 512
    """``summarize``: the longest summary in tokens."""
    summary_trained: bool = False
    """``summarize``: train the summary calls (sampled like the agent's calls); false: they
    are greedy and carry no loss."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("reserve_tokens", self.reserve_tokens >= 0, ">= 0"),
            ("keep_last_turns", self.keep_last_turns >= 0, ">= 0 (0 = no turn kept whole)"),
            ("summary_max_tokens", self.summary_max_tokens >= 1, ">= 1"),
        )

    def _problems(self) -> list[str]:
        out = super()._problems()
        base = {f.name: f.default for f in dataclasses.fields(self)}
        for name, policies in _CONTEXT_KEY_POLICIES.items():
            if self.policy not in policies and getattr(self, name) != base[name]:
                out.append(
                    f"{name}: set, but context.policy={self.policy} does not use it; set "
                    f"context.policy={'|'.join(policies)} or remove context.{name}"
                )
        return out


_CONTEXT_KEY_POLICIES = {
    "reserve_tokens": ("truncate_tool_results", "summarize"),
    "keep_last_turns": ("truncate_tool_results", "summarize"),
    "summary_max_tokens": ("summarize",),
    "summary_trained": ("summarize",),
}
"""The ``context`` keys and the policies that use them."""


@dataclass(frozen=True)
class SamplingConfig(_Checked):
    """How the policy samples during rollouts."""

    temperature: float = 1.0
    """Softmax temperature, > 0 (greedy decoding gives a group no variance to learn from).
    Agents (``agent``, external workers) sample as their own calls ask; these values (and
    ``by_kind``) fill in what their calls leave unset."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    max_new_tokens: int = 512
    """Most tokens generated by one model call (one turn); also the limit of an agent's
    calls that set no ``max_tokens`` of their own."""
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per task kind (the ``kind`` of the env's reset info), values that replace
    ``temperature``, ``top_p`` or ``top_k`` for its episodes, e.g. ``{arithmetic:
    {temperature: 1.0}, word: {temperature: 0.7}}``. The trainer scores every token at the
    temperature it was sampled with."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            *_sampling_rules(vars(self), known_only=True),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
        )

    def _problems(self) -> list[str]:
        out = super()._problems()
        for kind, values in self.by_kind.items():
            if not isinstance(values, Mapping):
                out.append(f"by_kind.{kind}: expected a mapping such as {{temperature: 1.0}}")
                continue
            for name, ok, rule in _sampling_rules(values):
                if not ok:
                    out.append(f"by_kind.{kind}.{name}: must be {rule}, got {values[name]!r}")
        return out


_SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _is_number(v) and v > 0, "> 0 for training"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: _is_number(v) and v == int(v) and v >= 0, "an integer >= 0 (0 disables)"),
}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _sampling_rules(
    values: Mapping[str, Any], known_only: bool = False
) -> list[tuple[str, bool, str]]:
    """Checks of the sampling values in ``values``; other keys are errors unless
    ``known_only``."""
    out = []
    for key, value in values.items():
        if key in _SAMPLING_CHECKS:
            ok, rule = _SAMPLING_CHECKS[key]
            out.append((key, bool(ok(value)), rule))
        elif not known_only:
            out.append((key, False, f"one of {', '.join(_SAMPLING_CHECKS)} (unknown key)"))
    return out


@dataclass(frozen=True)
class RolloutConfig(_Checked):
    """How episodes are collected and how stale they may be."""

    group_size: int = 8
    """Episodes sampled per task; group advantages are normalized over them."""
    batch_size: int = 8
    """Groups (tasks) per training step: a step trains on batch_size * group_size episodes."""
    max_head_offpolicyness: int = 2
    """Staleness bound eta in policy versions; 0 = synchronous, > 0 = asynchronous."""
    concurrency: int = 32
    """Most episodes in flight at once."""
    max_turns: int = 16
    """Most model calls in one episode before it is truncated."""
    episode_timeout_s: float | None = 600.0
    """Wall-clock limit of one episode; None = no limit."""
    gamma: float = 1.0
    """Discount of later rewards along the completion tree (PPO: once per turn), in [0, 1]."""
    agents: Literal["local", "external", "self_rewarded"] = "local"
    """Where episodes run: in this process (the model drives the env, or the ``agent``
    section's agent), or ``external``: agents in their own processes pull tasks from the
    worker API (the ``workers`` section) and call the proxy themselves, or
    ``self_rewarded``: no env; a service opens sessions in groups with the worker token,
    posts their rewards and ends them (see ``areal_agents.trainer.rollout.SessionSource``)."""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """What a weight update does with the engine's requests in flight (asynchronous runs):
    ``recompute`` drops their KV caches and re-prefills each with the new weights; ``keep``
    lets them decode on from their caches (keys and values the old weights computed), with
    no re-prefill. Either way later tokens are sampled by the new weights and carry the new
    version and the logprobs they were sampled with."""
    engine_cpus: tuple[int, ...] | None = None
    """CPU cores the engine actor runs on, with that many torch threads (``scheduler: ray``
    only: the engine is then a process of its own); None = wherever Ray puts it. Beside
    ``train.cpus`` on other cores, a disaggregated layout: inference and training never
    take turns on a core."""
    idle_engine_cpus: tuple[int, ...] | None = None
    """A second engine replica on these cores (``scheduler: ray``) at the lowest CPU
    priority Linux has (``SCHED_IDLE``): it computes only while nothing else there wants
    the cores and gives them back at once when something does. On the trainer's cores
    (``train.cpus``) it turns the time the trainer waits for a batch into more episodes. A
    new session goes to the replica with the fewest requests in flight and stays there;
    weight updates reach both. Its compute is lane ``engine_idle`` of the spans, measured
    in CPU time. None = off."""
    probe_size: int = 0
    """Dynamic sampling with a probe (``algorithm: dapo``): sample this many episodes of a
    group first and drop the group there when their rewards are all equal, before the other
    ``group_size - probe_size`` are generated (``dropped/uniform_probe``); a group that
    passes is completed with the same episodes it would have had without the probe. Cheaper
    when many tasks are all-fail (or all-pass) for the current policy; a task with success
    rate p is also dropped with probability p^k + (1 - p)^k when its full group would not
    have been uniform. 0 = off: the whole group, then the check."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        timeout, counts = self.episode_timeout_s, ("group_size", "batch_size", "concurrency")
        k = self.probe_size
        return (
            ("probe_size", k == 0 or 2 <= k < self.group_size, "0 (off) or in [2, group_size)"),
            *((n, getattr(self, n) >= 1, ">= 1") for n in (*counts, "max_turns")),
            ("max_head_offpolicyness", self.max_head_offpolicyness >= 0, ">= 0 (0 = sync)"),
            ("episode_timeout_s", timeout is None or timeout > 0, "> 0 or null (no limit)"),
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("engine_cpus", _cores_ok(self.engine_cpus), "a non-empty list of distinct cores"),
            (
                "idle_engine_cpus",
                _cores_ok(self.idle_engine_cpus),
                "a non-empty list of distinct cores, or null (off)",
            ),
        )


@dataclass(frozen=True)
class OptimConfig(_Checked):
    """The optimizer (AdamW) and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates, each in [0, 1)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; None = no clipping."""
    warmup_steps: int = 0
    """Training steps of linear warmup: step k of them runs at lr * k / warmup_steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warmup: constant, or decayed (linearly or along a half cosine) to
    0 at total_steps; counted in training steps, every mini-batch of a step at the same rate
    (formulas in ``areal_agents.trainer.schedule``). Logged as ``optim/lr``."""
    total_steps: int | None = None
    """Length of the schedule in training steps; None = train.steps."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        clip, total = self.grad_clip, self.total_steps
        return (
            ("lr", self.lr > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("betas", all(0 <= b < 1 for b in self.betas), "each in [0, 1)"),
            ("grad_clip", clip is None or clip > 0, "> 0 or null (no clipping)"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("total_steps", total is None or total >= 1, ">= 1 or null (= train.steps)"),
        )


@dataclass(frozen=True)
class LossConfig(_Checked):
    """The decoupled PPO-style objective. None = the value that ``algorithm`` sets."""

    clip_low: float | None = None
    """eps_low: the ratio current / proximal policy is clipped below at 1 - eps_low."""
    clip_high: float | None = None
    """eps_high: the ratio is clipped above at 1 + eps_high (DAPO's clip-higher: 0.28)."""
    behaviour_correction: Literal["clip", "mask", "none"] | None = None
    """Weight proximal / behaviour: clip at behaviour_cap, mask tokens above it, or none."""
    behaviour_cap: float | None = None
    """Cap of the behaviour importance weight, >= 1."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Proximal logprobs: an extra forward pass, or interpolated from the versions."""
    kl_coef: float | None = None
    """Weight of the KL penalty to the reference (initial) model; 0 = none."""
    entropy_coef: float | None = None
    """Weight of an entropy bonus on the trained tokens (against early collapse of
    exploration); 0 = none."""
    agg: Literal["mean", "sum", "sum_norm"] | None = None
    """Token losses within a unit: mean, sum, or sum / max_new_tokens (Dr.GRPO)."""
    weighting: Literal["episode", "token", "completion"] | None = None
    """What weighs equally: each episode (however many turns), each completion, each token."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        low, high, cap, kl = self.clip_low, self.clip_high, self.behaviour_cap, self.kl_coef
        return (
            ("clip_low", low is None or low > 0, "> 0 or null"),
            ("clip_high", high is None or high > 0, "> 0 or null"),
            ("behaviour_cap", cap is None or cap >= 1, ">= 1 (on-policy tokens weigh 1) or null"),
            ("kl_coef", kl is None or kl >= 0, ">= 0 or null"),
            ("entropy_coef", self.entropy_coef is None or self.entropy_coef >= 0, ">= 0 or null"),
        )


@dataclass(frozen=True)
class CriticConfig(_Checked):
    """The value model of PPO: a copy of the policy's base with a scalar head, and GAE."""

    path: str | None = None
    """Initial weights of the critic's backbone; None = the policy's (``model.path``)."""
    lr: float = 1e-5
    """Peak learning rate of the critic's own AdamW (betas, decay, clip and the schedule's
    warmup and decay from ``optim``)."""
    lam: float = 0.95
    """GAE's lambda in [0, 1]: 1 = Monte-Carlo returns, 0 = one-step TD targets."""
    value_clip: float | None = 0.2
    """New values are clipped to within this of the old ones in the value loss; None = off."""
    whiten: bool = True
    """Whiten advantages over the step's sampled tokens (mean 0, std 1)."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        clip = self.value_clip
        return (
            ("lr", self.lr > 0, "> 0"),
            ("lam", 0 <= self.lam <= 1, "in [0, 1]"),
            ("value_clip", clip is None or clip > 0, "> 0 or null (no clipping)"),
        )


CRITIC_ESTIMATORS = frozenset({"gae", "turn_gae"})
"""The estimators that need a critic algorithm (the others need a group algorithm)."""


@dataclass(frozen=True)
class AdvantageConfig(_Checked):
    """The advantage estimator of the algorithm, when not its own (null = the algorithm's:
    ``gae`` for ppo, ``group`` for the others), and the step-level groups' settings."""

    estimator: Literal["group", "step_group", "gae", "turn_gae"] | None = None
    """group: the algorithm's baseline and scale over a group's episodes. step_group:
    GiGPO, that plus step-level groups, the turns of a group's episodes that start from the
    same state (the env's ``info["state_key"]``, else the prompt's last tool or user
    messages), normalized together: A = A_E + omega * A_S (``areal_agents.trainer.advantage.
    step_group_advantages``). gae: PPO's token-level GAE. turn_gae: GAE with one value per
    turn boundary, ``critic.lam`` and ``rollout.gamma`` once per turn (``areal_agents.trainer.advantage.
    turn_gae``). group and step_group go with algorithms without a critic, gae and turn_gae
    with ppo."""
    omega: float | None = None
    """step_group: weight of the step-level advantage, >= 0; null = 1.0 (GiGPO's). 0 gives
    the episode-level advantage alone (the algorithm's own)."""
    step_scale: Literal["std", "none"] | None = None
    """step_group: divide the step-level advantage by its step group's std (std), or not
    (none); null = std."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        omega = self.omega
        return (("omega", omega is None or 0 <= omega < float("inf"), ">= 0 or null (= 1.0)"),)

    def overrides(self) -> dict[str, Any]:
        """The ``AdvantageSpec`` fields this section sets (those not null)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class RunConfig(_Checked):
    """The training loop: length, batching, seeds, outputs and checkpoints."""

    micro_batch_tokens: int = 16384
    """Token budget of one packed micro-batch; a step accumulates gradients over several."""
    share_prefixes: bool = True
    """Compute the prefixes that sequences share (a group's prompt) once per micro-batch,
    as a prefix tree with an attention mask; exact. Off: every sequence packed whole."""
    minibatches: int = 1
    """Optimizer steps per training step: the batch is split into this many mini-batches
    of whole episodes (whole groups when it divides their number), each one update with
    its loss averaged over its own samples, as PPO's mini-batches (``split_batch``). The
    weights reach the engine once per step, so policy versions still count steps. With
    ``loss.proximal=recompute`` every mini-batch is clipped against the policy before the
    step; with ``loglinear`` the later ones interpolate towards the already updated policy."""
    epochs: int = 1
    """Passes over each step's batch: every pass runs its ``minibatches`` updates again on
    the same episodes (PPO's epochs), so a step takes ``epochs * minibatches`` optimizer
    steps and still one policy version. More training per generated episode: with the engine
    and the trainer on cores of their own, it fills the trainer's wait for the next batch.
    The clip keeps the later passes near the proximal policy (exactly the policy before the
    step with ``loss.proximal=recompute``; ``loglinear`` interpolates towards the updated one)."""
    fill_passes: int = 0
    """Further passes over the last batch, made only while the next one is not complete: the
    trainer's wait for the engine filled with more training per generated episode. After a
    step's weights reach the engine, the trainer runs the step's policy updates again (a
    critic trains once per batch), one update at a time, until the next batch is in or
    ``fill_passes`` more passes are done, so it never holds the rollouts back by more than one
    update. The updates belong to the next
    policy version (the engine gets them with the next step's weights); the clip keeps them
    near the batch's proximal policy as with ``epochs``. Each step's metrics count them
    (``fill_updates``, ``fill_s``). For a trainer with cores (or a device) of its own: with
    the engine on the same CPU cores they take turns with its decoding. 0 = off."""
    steps: int = 200
    """Training steps (policy versions) to run."""
    seed: int = 0
    """Seed of everything random in the run."""
    output_dir: str = "runs/default"
    """Where checkpoints, metrics and the resolved config are written."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    time_limit_min: float | None = None
    """Wall-clock budget in minutes (warm start included, summed over resumes): the run stops
    after the last step expected to end within it (the next step, as long as the longest
    of the last four, would overrun it), then writes a checkpoint and the final model; None = no
    limit, run ``steps`` steps."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir."""
    nproc: int = 1
    """Trainer ranks: data-parallel FSDP2 ranks on ``torch.distributed`` (started by its
    elastic agent on this machine, or as Ray actors with ``scheduler: ray``). Each step's
    groups are split across them, and they compute the step that one process would."""
    fsdp: bool | None = None
    """Shard the policy (and critic) with FSDP2; None = when ``nproc > 1``. True with one
    rank lets a single device use ``cpu_offload``."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory between uses
    (FSDP2's ``CPUOffloadPolicy``): less device memory, more host transfers."""
    collective_timeout_s: float = 600.0
    """How long a trainer rank waits in one collective before it gives up (a peer died or
    hangs); the run then ends with an error naming the rank."""
    cpus: tuple[int, ...] | None = None
    """CPU cores this process (the trainer, and with ``scheduler: local`` the engine and the
    episodes too) runs on, with that many torch threads (Linux ``sched_setaffinity``);
    None = every core. With ``scheduler: ray`` and ``rollout.engine_cpus`` on other cores,
    training and inference each get cores of their own, as on separate GPUs."""

    @property
    def sharded(self) -> bool:
        """Whether the trainer runs FSDP2 ranks (``fsdp``, default: ``nproc > 1``)."""
        return self.nproc > 1 if self.fsdp is None else self.fsdp

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("nproc", self.nproc >= 1, ">= 1"),
            (
                "fsdp",
                self.fsdp is not False or self.nproc == 1,
                "true or null with nproc > 1 (several ranks shard the model)",
            ),
            (
                "cpu_offload",
                not self.cpu_offload or self.sharded,
                "false unless the trainer is sharded (set train.fsdp=true)",
            ),
            ("collective_timeout_s", self.collective_timeout_s > 0, "> 0"),
            ("cpus", _cores_ok(self.cpus), "a non-empty list of distinct core numbers >= 0"),
            ("micro_batch_tokens", self.micro_batch_tokens >= 1, ">= 1"),
            ("minibatches", self.minibatches >= 1, ">= 1 (1 = one update per step)"),
            ("epochs", self.epochs >= 1, ">= 1 (1 = one pass over each batch)"),
            ("fill_passes", self.fill_passes >= 0, ">= 0 (0 = off)"),
            ("steps", self.steps >= 1, ">= 1"),
            ("save_every", self.save_every >= 0, ">= 0 (0 = only at the end)"),
            (
                "time_limit_min",
                self.time_limit_min is None or self.time_limit_min > 0,
                "> 0 or null (no limit)",
            ),
            ("output_dir", bool(self.output_dir), "a directory"),
        )


@dataclass(frozen=True)
class SFTConfig(_Checked):
    """Optional supervised warm start on demonstrations before RL."""

    enabled: bool = False
    """Run the warm start first."""
    demos: str | None = None
    """Path of the demonstrations (JSONL); required when enabled unless ``generate`` > 0."""
    generate: int = 0
    """Instead of reading ``demos``, write this many with the env's ``demos()`` (as
    ``areal-agent demos`` does) to ``sft_demos.jsonl`` in the run directory; 0 = off."""
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's ``demos()``, e.g. ``{kind: arithmetic}``."""
    epochs: int = 1
    """Passes over the demonstrations."""
    batch_size: int = 8
    """Demonstrations per optimizer step (``ceil(demos / batch_size)`` steps an epoch):
    fewer, longer demonstrations want a smaller batch for enough steps."""
    lr: float = 1e-5
    """Learning rate of the warm start, > 0."""
    kind: Literal["messages", "episodes"] = "messages"
    """Demo format: OpenAI chat messages (rendered by the chat template with the env's
    tools), or recorded episodes (an ``episodes.jsonl`` of ``areal-agent eval --out``),
    trained on their recorded samples: only the tokens the model sampled, skipping episodes
    that failed or ended in an error."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        episodes = self.kind == "episodes"
        return (
            (
                "demos",
                bool(self.demos) or self.generate > 0 or not self.enabled,
                "a JSONL path when sft is enabled (or set sft.generate to write demos)",
            ),
            (
                "kind",
                not (episodes and self.generate),
                "'messages' with sft.generate (it writes chat messages); or give recorded "
                "episodes as sft.demos and remove sft.generate",
            ),
            ("generate", self.generate >= 0, ">= 0 (0 = read sft.demos)"),
            ("epochs", self.epochs >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
        )


@dataclass(frozen=True)
class EvalConfig(_Checked):
    """Held-out evaluation during training: the same tasks, greedy by default, through the
    run's own engine and proxy (never trained on). It runs before the warm start (the base
    model), after it, every ``every`` steps and at the end; the results go to
    ``RUN_DIR/eval.json`` and the metrics (``eval/*``), and the run ends by printing
    ``held-out success: base X% -> warm start Y% -> RL Z%``."""

    episodes: int = 0
    """Held-out tasks per evaluation (one episode each); 0 = no evaluation."""
    seed: int = 0
    """Seed of the held-out tasks: a seeded permutation of the split's pool where the env has
    one (distinct tasks), else task t resets with seed ``seed + t``."""
    split: str = "test"
    """Task split evaluated on, passed to the environment as ``split`` where it takes one."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments on top of ``env.kwargs`` for the held-out env, e.g. an unweighted
    task mix."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation (0 = greedy)."""
    every: int = 0
    """Also evaluate every this many RL steps (0 = only before and after training)."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("episodes", self.episodes >= 0, ">= 0 (0 = no held-out evaluation)"),
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("every", self.every >= 0, ">= 0 (0 = only before and after training)"),
            (
                "every",
                self.every == 0 or self.episodes > 0,
                "0 while eval.episodes is 0 (set eval.episodes to evaluate)",
            ),
        )


_CRITERION = re.compile(r"[A-Za-z][\w -]{0,39}")


@dataclass(frozen=True)
class JudgeConfig(_Checked):
    """An LLM judge of the episodes' final answers (:mod:`areal_agents.trainer.judge`)."""

    mode: Literal["none", "rubric", "ranking"] = "none"
    """``rubric``: each answer scored per criterion (weighted mean); ``ranking``: a group's
    answers scored relative to each other (no reference needed); ``none``: no judge."""
    base_url: str | None = None
    """An OpenAI-compatible ``/v1`` URL of the judge; None = this run's own proxy and model
    (its calls recorded as sessions of groups ``judge-*``, never trained)."""
    model: str | None = None
    """The model name sent to ``base_url``; None = the first model it lists."""
    api_key_env: str | None = None
    """The environment variable holding the judge's API key (with ``base_url``)."""
    rubric: dict[str, Any] = field(default_factory=dict)
    """The criteria, ``{name: description}`` or ``{name: {description: ..., weight: 2}}``;
    required by ``rubric``, the points to compare by in ``ranking``."""
    scoring: Literal["text", "logprobs"] = "text"
    """How a rubric judge gives its scores: ``text``, one line ``name: score`` (0-10) per
    criterion; ``logprobs``, one yes/no question per criterion, scored 10 * P(yes) /
    (P(yes) + P(no)) from the first token's ``top_logprobs``: no format to follow, for small
    judges (the endpoint must return logprobs)."""
    include_trace: bool = False
    """Show the judge the tool calls the episode made and the start of each result (within
    ``max_answer_chars``), with the answer."""
    max_answer_chars: int = 2000
    """Each answer (and the task) is cut to this many characters in the judge's prompt."""
    max_tokens: int = 128
    """Tokens the judge may write per call."""
    temperature: float = 0.0
    """The judge's sampling temperature (0 = greedy)."""
    timeout_s: float = 60.0
    """A judge call that takes longer fails (the episode ends as ``judge_error``)."""
    retries: int = 1
    """Times an unreadable reply is asked again, before the episode ends as ``judge_error``."""
    concurrency: int = 4
    """Judge calls in flight at once."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        bad = [n for n, v in self.rubric.items() if not _criterion_ok(n, v)]
        unused = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "mode" and getattr(self, f.name) != _default(f)
        ]
        return (
            (
                "mode",
                self.mode != "none" or not unused,
                f"rubric or ranking: {', '.join(unused) or '-'} set, but no judge runs",
            ),
            (
                "rubric",
                not bad,
                "{name: description} or {name: {description: text, weight: number > 0}}, "
                "names of letters, digits, spaces, _ or - (at most 40); check "
                + ", ".join(map(repr, bad)),
            ),
            (
                "rubric",
                self.mode != "rubric" or bool(self.rubric),
                "at least one criterion with mode=rubric",
            ),
            (
                "scoring",
                self.scoring == "text" or self.mode != "ranking",
                "text with mode=ranking (answers are ranked in writing)",
            ),
            ("max_answer_chars", self.max_answer_chars >= 1, ">= 1"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("timeout_s", self.timeout_s > 0, "> 0"),
            ("retries", self.retries >= 0, ">= 0"),
            ("concurrency", self.concurrency >= 1, ">= 1"),
            (
                "model",
                self.model is None or self.base_url is not None,
                "null without base_url (the run's own proxy serves its own model)",
            ),
            (
                "api_key_env",
                self.api_key_env is None or self.base_url is not None,
                "null without base_url (the run's own proxy needs no key)",
            ),
        )


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _criterion_ok(name: Any, spec: Any) -> bool:
    if not isinstance(name, str) or not _CRITERION.fullmatch(name):
        return False
    if isinstance(spec, str):
        return bool(spec.strip())
    if not isinstance(spec, Mapping) or set(spec) - {"description", "weight"}:
        return False
    w = spec.get("weight", 1.0)
    desc = spec.get("description")
    return isinstance(desc, str) and bool(desc.strip()) and _is_number(w) and w > 0


@dataclass(frozen=True)
class RewardsConfig(_Checked):
    """Rewards beyond the env's: a judge's score of the final answer, combined with the
    env's rewards as ``env_weight * r_t`` per turn and ``env_weight * R + judge_weight *
    score`` for the final reward."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    judge_weight: float = 1.0
    """Weight of the judge's score (in [0, 1]) in the final reward."""
    env_weight: float = 1.0
    """Weight of the env's rewards (0 = the judge alone)."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        judged = self.judge.mode != "none"
        return (
            ("judge_weight", _is_number(self.judge_weight), "a number"),
            ("env_weight", _is_number(self.env_weight), "a number"),
            (
                "judge_weight",
                judged or self.judge_weight == 1.0,
                "left at 1 without a judge (set rewards.judge.mode)",
            ),
            (
                "env_weight",
                judged or self.env_weight == 1.0,
                "left at 1 without a judge (set rewards.judge.mode)",
            ),
        )


@dataclass(frozen=True)
class MetricsConfig(_Checked):
    """Where training metrics go (always under train.output_dir)."""

    tensorboard: bool = True
    """Write TensorBoard event files."""
    jsonl: bool = True
    """Write one JSON line of metrics per step."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""


@dataclass(frozen=True)
class AgentConfig(_Checked):
    """The user's agent, run in this process for every episode instead of the raw model
    driving the env (see :mod:`areal_agents.rollout.task_agent`)."""

    factory: str | None = None
    """``"pkg.module:make_agent"`` (or ``"path/to/file.py:make_agent"``), called once with
    ``kwargs``; it returns an OpenAI Agents SDK ``Agent``, an async callable taking an
    ``AgentTask``, or an object with ``async run(task)``. The env scores what the agent did.
    None = env-driven."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory."""
    train: tuple[str, ...] = ()
    """In a multi-agent run (handoffs, sub-agents), the names of the agents whose
    completions are trained; the others' are recorded but masked out of the loss. Each
    completion carries the name its call sent (``run_agent`` names the SDK agent whose turn
    it is); completions without a name are masked too once this is set. Empty = all."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        f = self.factory
        ok = f is None or bool(re.fullmatch(r"([A-Za-z_][\w.]*|.+\.py):[A-Za-z_]\w*", f))
        rule = "'pkg.module:factory', 'path/to/file.py:factory' or null (env-driven)"
        return (("factory", ok, rule),)


@dataclass(frozen=True)
class WorkersConfig(_Checked):
    """The worker API: external agents pull tasks from it (``rollout.agents: external``), a
    self-rewarded service opens sessions with its token (``self_rewarded``)."""

    host: str = "127.0.0.1"
    """Interface the proxy and the worker API listen on (0.0.0.0 for other machines)."""
    port: int = 0
    """Port of both; 0 = a free one, chosen at the first start and kept by ``--resume``."""
    token: str | None = None
    """The workers' bearer token; None = ``$AREAL_WORKER_TOKEN``, else a random one. Saved
    in ``workers.json`` (mode 0600) in the run directory and kept by ``--resume``."""
    heartbeat_timeout_s: float = 30.0
    """A task whose worker sent nothing for this long ends as ``agent_lost``."""
    on_lost: Literal["redo", "drop"] = "redo"
    """A group with an ``agent_lost`` episode: generated again, or the lost episode dropped
    (the group trains on the rest when enough are left)."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("port", 0 <= self.port <= 65535, "in [0, 65535] (0 = a free port)"),
            ("heartbeat_timeout_s", self.heartbeat_timeout_s > 0, "> 0"),
            ("host", bool(self.host), "an interface, e.g. 127.0.0.1"),
        )


@dataclass(frozen=True)
class TrainConfig(_Checked):
    """A whole training run. Only ``env.id`` has no default."""

    env: EnvConfig
    """The environment to train on."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    algorithm: str = "grpo"
    """One of ALGORITHMS: how advantages and the loss are configured."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling during rollouts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Episode collection and staleness."""
    context: ContextConfig = field(default_factory=ContextConfig)
    """What the proxy does with conversations that outgrow ``model.max_context``."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model and GAE (PPO only; the discount is ``rollout.gamma``, per turn)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """The advantage estimator, when not the algorithm's own (step-level groups, turn GAE)."""
    train: RunConfig = field(default_factory=RunConfig)
    """The training loop and its outputs."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm start."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation before, during and after training."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Rewards beyond the env's: an LLM judge of the final answers."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The user's agent in this process; none = the model drives the env."""
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    """The worker API of external agents and self-rewarded services (``rollout.agents``)."""
    scheduler: Literal["local", "ray"] = "local"
    """Run every component in this process (local) or spread them over Ray."""

    def _self_rewarded_problems(self) -> list[str]:
        """``rollout.agents: self_rewarded`` has no env and no task handout: the keys that
        only those use would do nothing."""
        out = []
        if self.env.id is not None:
            out.append(
                "env.id: a self-rewarded run takes its episodes and rewards from the sessions "
                "a service opens; remove the env section, or use rollout.agents=external to "
                "have the env hand out tasks and score them"
            )
        if self.rollout.probe_size:
            out.append("rollout.probe_size: a self-rewarded run has no probe; set it to 0")
        if self.sft.enabled and self.sft.generate:
            out.append(
                "sft.generate: needs an env's demos(); give sft.demos (JSONL) in a "
                "self-rewarded run"
            )
        base = WorkersConfig()
        for name in ("heartbeat_timeout_s", "on_lost"):
            if getattr(self.workers, name) != getattr(base, name):
                out.append(
                    f"workers.{name}: applies to tasks handed out to external workers, and a "
                    "self-rewarded run hands out none (rollout.episode_timeout_s bounds a "
                    "group); remove it"
                )
        return out

    def _advantage_problems(self) -> list[str]:
        """``advantage.*`` against the algorithm: a critic estimator needs a critic, a group
        one none, and the step-group keys only do something with ``step_group``."""
        out, adv, alg = [], self.advantage, self.algorithm
        critic = alg in CRITIC_ALGORITHMS
        est = adv.estimator or ("gae" if critic else "group")
        if est in CRITIC_ESTIMATORS and not critic:
            out.append(
                f"advantage.estimator: {est!r} takes its advantages from a critic, but "
                f"algorithm {alg!r} trains none; set algorithm="
                f"{'|'.join(sorted(CRITIC_ALGORITHMS))}, or advantage.estimator=group|step_group"
            )
        elif est not in CRITIC_ESTIMATORS and critic:
            out.append(
                f"advantage.estimator: {est!r} normalizes within groups, but algorithm "
                f"{alg!r} takes its advantages from a critic; set advantage.estimator="
                "gae|turn_gae, or a group algorithm (e.g. algorithm=grpo)"
            )
        if est == "step_group" and alg not in GROUP_ALGORITHMS and self.rollout.group_size < 2:
            out.append(
                "rollout.group_size: advantage.estimator=step_group compares the turns of a "
                f"group's episodes, so it needs group_size >= 2, got {self.rollout.group_size}"
            )
        for name in ("omega", "step_scale"):
            if est != "step_group" and getattr(adv, name) is not None:
                out.append(
                    f"advantage.{name}: only advantage.estimator=step_group uses it, but the "
                    f"estimator is {est!r}; set advantage.estimator=step_group or remove "
                    f"advantage.{name}"
                )
        return out

    def _problems(self) -> list[str]:
        """Checks that span sections (each section checks itself), with full keys."""
        out, group = [], self.rollout.group_size
        if self.algorithm not in ALGORITHMS:
            out.append(_choice_problem("algorithm", self.algorithm, ALGORITHMS))
        elif self.algorithm in GROUP_ALGORITHMS and group < 2:
            out.append(
                f"rollout.group_size: {self.algorithm} normalizes advantages within a group, "
                f"so it needs group_size >= 2, got {group}"
            )
        if self.rollout.probe_size and self.algorithm not in DYNAMIC_SAMPLING_ALGORITHMS:
            out.append(
                f"rollout.probe_size: only algorithms that drop uniform groups use a probe "
                f"({'|'.join(sorted(DYNAMIC_SAMPLING_ALGORITHMS))}), got algorithm="
                f"{self.algorithm}; set rollout.probe_size=0 or choose one of them"
            )
        if self.algorithm not in CRITIC_ALGORITHMS and self.critic != CriticConfig():
            out.append(
                f"critic: set, but algorithm {self.algorithm!r} trains no critic; remove the "
                f"critic section or choose algorithm={'|'.join(sorted(CRITIC_ALGORITHMS))}"
            )
        if self.algorithm in ALGORITHMS:
            out.extend(self._advantage_problems())
        eta = self.rollout.max_head_offpolicyness
        if eta > 0 and self.loss.behaviour_correction == "none":
            out.append(
                f"loss.behaviour_correction: 'none' is refused when training asynchronously "
                f"(rollout.max_head_offpolicyness={eta}): stale tokens need an off-policy "
                f"correction; set loss.behaviour_correction=clip (or mask), or "
                f"rollout.max_head_offpolicyness=0 for synchronous training"
            )
        agents = self.rollout.agents
        self_rewarded = agents == "self_rewarded"
        if agents == "local" and self.workers != WorkersConfig():
            out.append(
                "workers: set, but rollout.agents is 'local'; set rollout.agents=external "
                "to serve the worker API, or remove the workers section"
            )
        if self.env.id is None and not self_rewarded:
            out.append("env.id: required, but missing")
        if self_rewarded:
            out.extend(self._self_rewarded_problems())
        if self.agent.train and agents == "local" and self.agent.factory is None:
            out.append(
                "agent.train: picks among the agents of agent-driven episodes, but the model "
                "drives the env here; set agent.factory (or rollout.agents=external), or "
                "remove agent.train"
            )
        if agents != "local" and self.agent.factory is not None:
            out.append(
                "agent.factory: external agents bring their own code (areal-agent worker "
                "--agent ...); remove agent.factory or set rollout.agents=local"
            )
        if agents != "local" and self.scheduler == "ray":
            out.append(
                f"rollout.agents: {agents} workers connect to this process's worker API; "
                "use scheduler=local with them (the workers themselves may run anywhere)"
            )
        elsewhere = agents in ("external", "self_rewarded") or self.scheduler == "ray"
        if self.eval.episodes and elsewhere:
            out.append(
                "eval.episodes: the held-out evaluation runs episodes in this process (the "
                "model or agent.factory driving the env); with external workers, "
                "self-rewarded sessions or scheduler=ray, evaluate the checkpoints with "
                "areal-agent eval instead, and set eval.episodes=0"
            )
        if self.train.cpus is not None and self.train.nproc > 1:
            out.append(
                "train.cpus: pins this one trainer process, not the ranks that "
                f"train.nproc={self.train.nproc} starts; remove train.cpus or set train.nproc=1"
            )
        if self.rollout.engine_cpus is not None and self.scheduler != "ray":
            out.append(
                "rollout.engine_cpus: pins the engine's own process, which only "
                "scheduler=ray starts (with scheduler=local the engine shares this process: "
                "pin it with train.cpus); set scheduler=ray or remove rollout.engine_cpus"
            )
        if self.rollout.idle_engine_cpus is not None and self.scheduler != "ray":
            out.append(
                "rollout.idle_engine_cpus: starts a second engine process, which only "
                "scheduler=ray does; set scheduler=ray or remove rollout.idle_engine_cpus"
            )
        judge = self.rewards.judge
        if judge.mode != "none" and judge.base_url is None and self.scheduler == "ray":
            out.append(
                "rewards.judge.base_url: with scheduler=ray the proxy is not in this "
                "process; give the judge's OpenAI-compatible URL (e.g. a served model)"
            )
        total = self.optim.total_steps or self.train.steps
        if self.optim.warmup_steps > total:
            out.append(
                f"optim.warmup_steps: must be <= the schedule's {total} steps, "
                f"got {self.optim.warmup_steps}"
            )
        ctx, new = self.model.max_context, self.sampling.max_new_tokens
        if ctx is not None and new > ctx:
            out.append(f"sampling.max_new_tokens: {new} exceeds model.max_context={ctx}")
        if ctx is not None and self.train.micro_batch_tokens < ctx:
            out.append(
                f"train.micro_batch_tokens: must be >= model.max_context={ctx} (one "
                f"full-length sequence fits a micro-batch), got {self.train.micro_batch_tokens}"
            )
        out.extend(self._context_problems())
        return out

    def _context_problems(self) -> list[str]:
        """``context.*`` against the model's context and the scheduler."""
        out: list[str] = []
        c, ctx = self.context, self.model.max_context
        if c.policy == "fail":
            return out
        if self.scheduler == "ray":
            out.append(
                f"context.policy: {c.policy} is applied by the trainer's own proxy, and with "
                "scheduler=ray the rollout workers' proxies apply none; use scheduler=local "
                "or context.policy=fail"
            )
        limits = ["reserve_tokens"] + (["summary_max_tokens"] if c.policy == "summarize" else [])
        for name in limits:
            if ctx is not None and getattr(c, name) >= ctx:
                out.append(
                    f"context.{name}: must be below model.max_context={ctx}, got "
                    f"{getattr(c, name)}; lower it or raise model.max_context"
                )
        return out


class _Loader(yaml.SafeLoader):
    """A SafeLoader that reads ``1e-6`` as a float (as YAML 1.2 does), refuses duplicate keys."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key_node, deep=deep) for key_node, _ in node.value]
        if dup := [key for i, key in enumerate(keys) if key in keys[:i]]:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {dup[0]!r}", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """A SafeDumper that quotes the strings ``_Loader`` would read as floats (``'1e-6'``)."""


_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _yaml in (_Loader, _Dumper):
    _yaml.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))

_INVALID: Any = object()  # a value that failed its type check (its problem is recorded)


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML file (None: the defaults), apply ``a.b=c`` overrides, check everything.

    Raises one ``ConfigError`` listing every problem: unknown keys (with the nearest valid
    key), wrong types, values out of range and inconsistent combinations.
    """
    problems: list[str] = []
    data = {} if path is None else _read_file(Path(path), problems)
    for item in overrides:
        _apply_override(data, item, problems)
    if problems:  # the file or an override cannot be read: report those first
        raise ConfigError("cannot read the training config", problems=problems)
    cfg: TrainConfig = _build(TrainConfig, data, "", problems)
    problems.extend(_value_problems(cfg, ""))
    if problems:
        raise ConfigError("invalid training config", problems=problems)
    return cfg


def _read_file(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"cannot read config file '{path}': {exc}")
        return {}
    if not isinstance(data, dict | None):
        problems.append(f"config file '{path}': expected a mapping of keys, got {data!r}")
    return data if isinstance(data, dict) else {}


def _apply_override(data: dict[str, Any], item: str, problems: list[str]) -> None:
    """Set ``a.b.c=value`` in the raw nested dict ``data``, creating sections as needed."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        problems.append(f"override {item!r}: expected key=value, e.g. rollout.group_size=8")
        return
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        problems.append(f"override {item!r}: cannot parse {text!r} as YAML; quote it")
        return
    for part in keys[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[keys[-1]] = value


def _build(cls: type[Any], data: Any, prefix: str, problems: list[str]) -> Any:
    """Build dataclass ``cls`` from raw ``data``, recording unknown keys and type problems.

    Value checks are left to ``_value_problems`` (run once over the whole tree, so that every
    problem is reported at once); a field with a wrong type keeps its default meanwhile.
    """
    if not isinstance(data, Mapping):
        if data is not None:
            problems.append(f"{prefix.rstrip('.')}: expected a mapping of keys, got {data!r}")
        data = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems.extend(
        _unknown_key_problem(prefix + str(k), list(fields), prefix) for k in data if k not in fields
    )
    hints, values = typing.get_type_hints(cls), {}
    for name, f in fields.items():
        where, tp = prefix + name, hints[name]
        value = _coerce(tp, data[name], where, problems) if name in data else _INVALID
        if value is _INVALID and f.default is not dataclasses.MISSING:
            value = f.default
        elif value is _INVALID and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        elif value is _INVALID:  # required: a section is built from {}, else it is a problem
            value = _build(tp, {}, where + ".", problems) if _is_section(tp) else None
            if value is None and name not in data:
                problems.append(f"{where}: required, but missing")
        values[name] = value
    obj = object.__new__(cls)  # a frozen instance, built without __post_init__'s checks
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    """``value`` checked against annotation ``tp`` and converted, or ``_INVALID``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_section(tp):
        return _build(tp, value, where + ".", problems)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        problems.append(_choice_problem(where, value, args))
        return _INVALID
    if origin in (types.UnionType, typing.Union) and type(None) in args:  # X | None
        inner = next(a for a in args if a is not type(None))
        return None if value is None else _coerce(inner, value, where, problems)
    if origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        want = "a mapping with string keys"
    elif origin is tuple:
        variadic, seq = args[1:] == (Ellipsis,), value if isinstance(value, list | tuple) else None
        kinds = [args[0]] * len(seq) if variadic and seq is not None else list(args)
        items = [_scalar(kind, v) for kind, v in zip(kinds, seq or (), strict=False)]
        if seq is not None and len(seq) == len(kinds) and _INVALID not in items:
            return tuple(items)
        want = f"a list of {args[0].__name__}" + ("" if variadic else f" (length {len(args)})")
    else:
        converted = _scalar(tp, value)
        if converted is not _INVALID:
            return converted
        want = tp.__name__
    problems.append(f"{where}: expected {want}, got {value!r}")
    return _INVALID


def _scalar(tp: Any, value: Any) -> Any:
    """``value`` as a bool, int, float or str, or ``_INVALID``. Bools are never numbers."""
    if tp is bool or isinstance(value, bool):
        return value if tp is bool and isinstance(value, bool) else _INVALID
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e4 written for 10000
    if tp is float and isinstance(value, int):
        return float(value)
    return value if tp in (int, float, str) and isinstance(value, tp) else _INVALID


def _choice_problem(where: str, value: Any, options: Sequence[Any]) -> str:
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: expected one of {', '.join(map(repr, options))}, got {value!r}{hint}"


def _unknown_key_problem(key: str, siblings: list[str], prefix: str) -> str:
    """``unknown key 'a.b'`` with the nearest valid key: a sibling, else a key elsewhere."""
    leaf = key.rsplit(".", 1)[-1]
    near = [prefix + c for c in difflib.get_close_matches(leaf, siblings, n=1)]
    if not near:  # e.g. a top-level 'lr' -> 'optim.lr' or 'sft.lr'
        every = _all_keys(TrainConfig)
        leaves = {k.rsplit(".", 1)[-1] for k in every}
        match = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.75)
        near = [k for k in every if match and k.rsplit(".", 1)[-1] == match[0]][:3]
    if near:
        return f"unknown key {key!r}; did you mean {' or '.join(map(repr, near))}?"
    return f"unknown key {key!r}; valid keys here: {', '.join(siblings)}"


def _all_keys(cls: type[Any], prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls``, sections included."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if _is_section(hints[f.name]):
            out.extend(_all_keys(hints[f.name], f"{prefix}{f.name}."))
    return out


def _value_problems(section: Any, prefix: str) -> list[str]:
    """The value problems of ``section`` and of every section inside it, with full keys."""
    out = []
    for f in dataclasses.fields(section):
        if isinstance(child := getattr(section, f.name), _Checked):
            out.extend(_value_problems(child, f"{prefix}{f.name}."))
    own = section._problems()
    return out + (own if isinstance(section, TrainConfig) else [prefix + p for p in own])


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config (or one section) as plain nested dicts, lists and scalars, for YAML or JSON."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _plain(value: Any) -> Any:
    if _is_section(type(value)):
        return to_dict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def dump_yaml(cfg: TrainConfig, path: str | os.PathLike[str]) -> None:
    """Write ``format_config(cfg)`` to ``path`` atomically; ``load_config(path)`` reads it back."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(format_config(cfg) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def format_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML (for ``--dry-run``), ending with what differs from defaults."""
    text = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    defaults = _build(TrainConfig, {"env": {"id": cfg.env.id}}, "", [])  # not validated
    now, base = _flatten(to_dict(cfg)), to_dict(defaults)
    changed = ", ".join(f"{k} (default {v!r})" for k, v in _flatten(base).items() if now[k] != v)
    return text + "# changed from the defaults: " + (changed or "nothing")


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one dict with dotted keys (``env.kwargs`` stays one value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and prefix + key != "env.kwargs":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
