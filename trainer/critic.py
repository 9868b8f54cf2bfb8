"""The PPO critic: a value model beside the policy, and where its GAE inputs come from.

Choices made:

* A separate model, not a head on the policy: the policy's backbone (``AutoModel``, without
  the vocabulary projection) loaded again from the same weights (or ``critic.path``) plus a
  scalar linear head in float32. Policy and critic have their own optimizers and losses, so
  neither loss scale leaks into the other's update, the weights shipped to the inference
  engine are the policy's alone, and either can be LoRA-trained. With ``model.lora`` the
  critic gets the same adapters (its head is always trained in full).
* The head starts small, ``W ~ N(0, 1 / (hidden + 1)^2)``, ``b = 0``: values start near 0
  (about ``1 / sqrt(hidden)``) and the backbone gets a gradient from the first step.
* Values are per token and aligned with the policy's logprobs: for a sequence x_0..x_{n-1}
  the value at index t (t = 0..n-2) is the head on the hidden state after x_0..x_t, the
  state in which x_{t+1} is sampled. Sequences are packed as for the policy.
* Rewards are placed per the data contract: completion c's reward r(c) (its per-turn
  rewards, plus the final reward when c is a leaf) sits on c's last output token. The
  discount gamma (``rollout.gamma``) applies once per turn, after a completion's last token;
  tokens inside a completion are not discounted. A sample whose last completion has
  children in other samples continues into them (``tree_gae``), so with lambda = 1 GAE's
  returns are exactly ``Episode.returns``. A truncated episode's leaves bootstrap from the
  value before their last token; a terminated episode's leaves end at 0. (A completion
  without output tokens has no token to carry its reward.)
* ``critic_targets``: the advantages may be whitened over the step's tokens; the returns
  ``A + V_old``, the critic's targets, never are. ``explained_variance`` is measured on
  the values the advantages came from.
* Turn-level GAE (``advantage.estimator: turn_gae``, ``turn_critic_targets``): the value of
  a turn is the critic's value at its first sampled token (the state of its prompt), GAE
  runs over turns (``areal_agents.trainer.advantage.turn_gae``: gamma and lambda once per
  turn), every token of a turn gets its advantage, and the value loss trains the boundaries
  only, each with its turn's summed loss weight.
* The value loss (``areal_agents.trainer.loss.value_loss``) uses the policy loss's
  per-token weights, so each episode weighs the same in both losses.
* The critic's rate ``critic.lr`` follows the policy's schedule (``optim.schedule``, its
  warmup and decay; :mod:`areal_agents.trainer.schedule`) with ``critic.lr`` as its peak.
* ``save`` / ``load`` keep the trained tensors (the whole model, or the adapters and the
  head) and the optimizer state (``dcp/``, ``torch.distributed.checkpoint``: any number of
  ranks reads it) and the schedule's position; a checkpoint of the wrong shape is refused
  by name.
* ``sharded``: one FSDP2 rank of several, as the policy (:mod:`areal_agents.trainer.fsdp`):
  the backbone's layers and the root are sharded, gradients summed over ranks, and ranks
  with fewer micro-batches run dummies.

Left out: a value head sharing the policy's backbone, value-model warm-up before PPO,
several critic epochs per batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from areal_agents import spans
from areal_agents.errors import ConfigError
from areal_agents.hardware import default_device
from areal_agents.trainer import fsdp
from areal_agents.trainer.advantage import tree_gae, turn_gae, whiten
from areal_agents.trainer.loss import explained_variance, value_loss
from areal_agents.trainer.policy import Packed, load_schedule, make_packed, pack, step_scheduler
from areal_agents.trainer.schedule import LrSchedule

if TYPE_CHECKING:
    from areal_agents.trainer.algorithms import CriticConfig
    from areal_agents.trajectory import Episode, TrainingSample

ValueLossFn = Callable[[list[int], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
"""(item indices, per-item token values [len-1]) -> (loss, stats)."""


class ValueModel(torch.nn.Module):
    """``backbone`` (hidden states) then ``head`` (a scalar per token, float32)."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def __getitem__(self, name: str) -> torch.nn.Module:
        return getattr(self, name)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Values [T] of one packed row ``input_ids`` [1, T]."""
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state[0].float()).squeeze(-1)  # type: ignore[no-any-return]


class Critic:
    """A value model: the policy's backbone with a scalar head, and its optimizer."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        lora: dict[str, Any] | None = None,
        activation_checkpointing: bool = False,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        compute_lock: Any = None,
        schedule: LrSchedule | None = None,
        sharded: bool = False,
        cpu_offload: bool = False,
    ) -> None:
        """``schedule``: the policy's learning-rate schedule shape (warmup, decay) with peak
        ``lr``, advanced by :meth:`step_schedule` once per training step. ``sharded`` and
        ``cpu_offload`` as for ``Policy``."""
        from transformers import AutoModel  # noqa: PLC0415  transformers loads only when a model is built

        self.device = torch.device(default_device(device))
        self.sharded = sharded
        load_dtype, compute = getattr(torch, dtype), None
        if sharded and self.device.type == "cuda" and load_dtype != torch.float32:
            load_dtype, compute = torch.float32, load_dtype
        backbone = AutoModel.from_pretrained(model_path, dtype=load_dtype)
        hidden = int(backbone.config.hidden_size)
        if lora:
            from peft import LoraConfig, get_peft_model  # noqa: PLC0415  peft loads only with LoRA enabled

            config = LoraConfig(task_type="FEATURE_EXTRACTION", **lora)
            backbone = get_peft_model(backbone, config)
        if activation_checkpointing:
            backbone.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False} if sharded else None
            )
            if lora:
                backbone.enable_input_require_grads()
        head = torch.nn.Linear(hidden, 1, dtype=torch.float32)
        torch.nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
        torch.nn.init.zeros_(head.bias)
        model = ValueModel(backbone, head)
        if sharded:
            model = model.to("cpu" if cpu_offload else self.device)
            random = [
                p
                for n, p in model.named_parameters()
                if p.requires_grad and (lora or n.startswith("head."))
            ]
            fsdp.broadcast_from_rank0(random)  # the head and adapters start equal everywhere
            fsdp.shard(model, compute_dtype=compute, cpu_offload=cpu_offload)
            self.model = model
        else:
            self.model = model.to(self.device)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.schedule = schedule or LrSchedule()
        self.scheduler = self.schedule.scheduler(self.optimizer)
        self.grad_clip = grad_clip
        self._compute = spans.TimedLock(compute_lock, "trainer")

    def _forward(self, packed: Packed) -> torch.Tensor:
        return self.model(packed.input_ids, packed.position_ids)

    @torch.no_grad()
    def values(
        self, seqs: Sequence[Sequence[int]], micro_batch_tokens: int = 4096
    ) -> list[torch.Tensor]:
        """Per sequence, the value at tokens 0..n-2 (before tokens 1..n-1; float32, CPU)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor] = [torch.zeros(0)] * len(seqs)
        for packed in self._packs(seqs, micro_batch_tokens):
            with self._compute("logprobs", model="critic"):
                v = self._forward(packed or self._dummy())
            for i, s, e in packed.spans if packed is not None else ():
                out[i] = v[s : e - 1].cpu()
        self.model.train(was_training)
        return out

    def _packs(self, seqs: Sequence[Sequence[int]], micro_batch_tokens: int) -> list[Packed | None]:
        """The micro-batches of ``seqs``; sharded, padded with ``None`` (dummies) to the
        largest count of any rank."""
        packs: list[Packed | None] = [
            make_packed(seqs, group, self.device)
            for group in pack([len(s) for s in seqs], micro_batch_tokens)
        ]
        n = fsdp.max_over_ranks(len(packs)) if self.sharded else len(packs)
        return [*packs, *[None] * (n - len(packs))]

    def _dummy(self) -> Packed:
        return make_packed([[0, 0]], [0], self.device)

    def train_step(
        self, seqs: Sequence[Sequence[int]], loss_fn: ValueLossFn, micro_batch_tokens: int = 4096
    ) -> dict[str, float]:
        """One optimizer step over all ``seqs`` with gradient accumulation."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for packed in self._packs(seqs, micro_batch_tokens):
            with self._compute():  # one turn of the lock; its parts recorded as spans
                t0 = time.perf_counter()
                if packed is None:  # enters the collectives; adds nothing to the gradient
                    (self._forward(self._dummy()).sum() * 0.0).backward()
                    spans.add("trainer", "backward", t0, time.perf_counter(), model="critic")
                    continue
                v = self._forward(packed)
                items = [i for i, _, _ in packed.spans]
                loss, stats = loss_fn(items, [v[s : e - 1] for _, s, e in packed.spans])
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            spans.add("trainer", "forward", t0, t1, model="critic")
            spans.add("trainer", "backward", t1, t2, model="critic")
            for k, x in stats.items():
                totals[k] = totals.get(k, 0.0) + float(x)
        if self.sharded:
            totals = fsdp.sum_over_ranks(totals)
        with self._compute("optimizer", model="critic"):
            grads = list(self.params.values())
            norm = float(fsdp.full_value(torch.nn.utils.clip_grad_norm_(grads, self.grad_clip)))
            if math.isfinite(norm):
                self.optimizer.step()
        totals["value_grad_norm"] = norm
        return totals

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step_schedule(self) -> None:
        """Advance the learning-rate schedule by one training step."""
        step_scheduler(self.scheduler)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:
        """The trained tensors and optimizer state (``dcp/``) and the schedule state."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        fsdp.save_state(self.model, self.optimizer, d / "dcp", trainable_only=True)
        if fsdp.rank() == 0:
            torch.save(self.scheduler.state_dict(), d / "scheduler.pt")

    def load(self, directory: str | Path) -> None:
        d = Path(directory)
        if (d / "dcp").exists():
            try:
                fsdp.load_state(self.model, self.optimizer, d / "dcp", trainable_only=True)
            except fsdp.CheckpointMismatch as exc:
                raise ConfigError(
                    f"the critic in {d} does not fit this run's critic ({exc}); resume with "
                    "the model and model.lora it was written with, or set train.output_dir "
                    "to a new directory"
                ) from exc
        elif (d / "weights.safetensors").exists() and not self.sharded:
            self._load_tensors(d)
        elif self.sharded and (d / "weights.safetensors").exists():
            raise ConfigError(
                f"{d} was written by an older version (no dcp/ directory), which sharded "
                "ranks cannot read; resume it with train.nproc=1 first"
            )
        else:
            raise ConfigError(
                f"{d.parent} has no critic; it was written by a run without one. Resume it "
                "with the algorithm it was trained with, or set train.output_dir to a new one"
            )
        load_schedule(self.scheduler, self.schedule, d / "scheduler.pt")

    def _load_tensors(self, d: Path) -> None:
        """A checkpoint of the older format: ``weights.safetensors`` and ``optimizer.pt``."""
        tensors = load_file(str(d / "weights.safetensors"))
        if set(tensors) != set(self.params):
            missing = sorted(set(self.params) - set(tensors))
            extra = sorted(set(tensors) - set(self.params))
            raise ConfigError(
                f"the critic in {d} does not fit this run's critic (missing {missing[:3]}, "
                f"unexpected {extra[:3]}); resume with the model and model.lora it was written "
                "with, or set train.output_dir to a new directory"
            )
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[n].to(p.device, p.dtype))
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=False))


# ---------------------------------------------------------------------------- GAE inputs
@dataclass
class GaeInputs:
    """Per training sample, the inputs of ``tree_gae`` besides the values (tokens 1..n-1)."""

    rewards: list[torch.Tensor] = field(default_factory=list)
    discounts: list[torch.Tensor] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    def extend(self, other: GaeInputs) -> None:
        """Append ``other``'s samples, shifting its sample indices past this one's."""
        offset = len(self.rewards)
        self.rewards += other.rewards
        self.discounts += other.discounts
        self.children += [[j + offset for j in kids] for kids in other.children]
        self.truncated += other.truncated


def gae_inputs(episode: Episode, samples: Sequence[TrainingSample], gamma: float) -> GaeInputs:
    """Rewards, discounts and links of one episode's ``samples`` (see the module docstring).

    ``samples`` are ``episode.samples(gamma)[0]``: children follow their parents, and a
    completion with children in other samples is the last of its own sample.
    """
    kids = episode.children()
    by_id = {c.id: c for c in episode.completions}
    owner = {cid: i for i, s in enumerate(samples) for cid in s.completion_ids}
    final = episode.final_reward or 0.0
    out = GaeInputs()
    for s in samples:
        tokens = s.token_completion[1:]
        rewards, discounts = torch.zeros(len(tokens)), torch.ones(len(tokens))
        last = {k: t for t, k in enumerate(tokens) if k >= 0}
        for k, t in last.items():
            c = by_id[s.completion_ids[k]]
            rewards[t] = c.reward + (final if not kids[c.id] else 0.0)
            discounts[t] = gamma
        children = sorted(owner[k] for k in kids[s.completion_ids[-1]])
        assert all(samples[j].completion_ids[0] in kids[s.completion_ids[-1]] for j in children)
        out.rewards.append(rewards)
        out.discounts.append(discounts)
        out.children.append(children)
        out.truncated.append(not children and episode.end_reason == "truncated")
    return out


def critic_targets(
    gae: GaeInputs, values: list[torch.Tensor], masks: list[torch.Tensor], critic: CriticConfig
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sample, the advantages (whitened over all samples' tokens when ``critic.whiten``)
    and the returns ``A + V`` (the value targets, never whitened) by ``tree_gae`` with
    ``critic.lam`` (the ``critic`` section), and their metrics (``explained_variance`` of the
    values before the step)."""
    adv, ret = tree_gae(
        gae.rewards, values, masks, gae.discounts, gae.children, critic.lam, truncated=gae.truncated
    )
    mask = torch.cat(masks).bool()
    out, stats = _whitened(adv, values, ret, masks, mask, critic)
    return out, ret, stats


def _whitened(
    adv: list[torch.Tensor],
    values: list[torch.Tensor],
    ret: list[torch.Tensor],
    masks: list[torch.Tensor],
    at: torch.Tensor,
    critic: CriticConfig,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per sample, the advantages whitened over all samples' trained tokens (when
    ``critic.whiten``), and the metrics: advantages over the trained tokens, values and
    returns over the positions ``at`` (flat, boolean)."""
    mask, flat = torch.cat(masks).bool(), torch.cat(adv)
    if critic.whiten:
        flat = whiten(flat, mask)
    used, v, r = flat[mask], torch.cat(values)[at], torch.cat(ret)[at]
    stats = {
        "adv_mean": float(used.mean()) if used.numel() else 0.0,
        "adv_std": float(used.std()) if used.numel() > 1 else 0.0,
        "adv_abs_max": float(used.abs().max()) if used.numel() else 0.0,
        "value_mean": float(v.mean()) if v.numel() else 0.0,
        "return_mean": float(r.mean()) if r.numel() else 0.0,
        "explained_variance": explained_variance(v, r, torch.ones_like(v)),
    }
    return list(flat.split([m.numel() for m in masks])), stats


def turn_critic_targets(
    gae: GaeInputs,
    values: list[torch.Tensor],
    masks: list[torch.Tensor],
    segments: list[torch.Tensor],
    critic: CriticConfig,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Turn-level ``critic_targets``: per sample, the advantages by ``turn_gae`` with
    ``critic.lam`` (whitened over all samples' tokens when ``critic.whiten``), the returns
    R(c) = A(c) + V(c) of each turn on its tokens, and the turn boundaries (where the value
    loss applies); the metrics are those of ``critic_targets``, over the boundaries."""
    adv, ret, bounds = turn_gae(
        gae.rewards,
        values,
        masks,
        gae.discounts,
        segments,
        gae.children,
        critic.lam,
        truncated=gae.truncated,
    )
    out, stats = _whitened(adv, values, ret, masks, torch.cat(bounds), critic)
    return out, ret, bounds, stats


@dataclass
class ValueLoss:
    """The ``Critic.train_step`` callback: ``value_loss`` (clipped by ``critic.value_clip``;
    None = unclipped) over a micro-batch, with the policy loss's per-token ``weights``.
    A plain object, so that :meth:`select` can send a trainer rank its part."""

    clip: float | None
    old_values: list[torch.Tensor]
    returns: list[torch.Tensor]
    masks: list[torch.Tensor]
    weights: list[torch.Tensor]
    group_ids: list[str] = field(default_factory=list)

    def select(self, idx: list[int]) -> ValueLoss:
        """The loss of samples ``idx`` only (items then index ``idx``)."""

        def pick(xs: list[Any]) -> list[Any]:
            return [xs[i] for i in idx] if xs else []

        return ValueLoss(
            self.clip,
            pick(self.old_values),
            pick(self.returns),
            pick(self.masks),
            pick(self.weights),
            pick(self.group_ids),
        )

    def __call__(
        self, items: list[int], values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        def pad(xs: list[torch.Tensor]) -> torch.Tensor:
            padded = torch.nn.utils.rnn.pad_sequence([xs[i] for i in items], batch_first=True)
            return padded.to(values[0].device)

        v = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
        return value_loss(
            v,
            pad(self.old_values),
            pad(self.returns),
            pad(self.masks),
            clip=self.clip,
            weights=pad(self.weights),
        )
