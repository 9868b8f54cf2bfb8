"""The trainable policy: a transformers causal LM (optionally with a peft LoRA adapter).

Choices made here:

* Sequences are packed into micro-batches without padding: several sequences share one row,
  ``position_ids`` restart at 0 for each, and transformers builds a block-diagonal causal mask
  from them (``use_cache=False``), so no token attends across sequences and no compute is
  spent on pad tokens.
* Shared prefixes are computed once (``share_prefixes``, on by default): the sequences of a
  micro-batch are laid out as a prefix tree (a group's episodes share the system prompt,
  the tool schemas and the question), each token at the position it has in its own
  sequence, with a 4D attention mask that lets a token see exactly its own sequence's
  earlier tokens. Logits, logprobs and gradients equal those of separate forward passes;
  the compute falls with the shared tokens (a calculator step of 16 episodes of ~400
  tokens, ~330 of them prompt, becomes ~1,900 tokens instead of ~6,400). Flash-attention
  kernels take no custom mask, so with them sequences are packed flat.
* Micro-batches are filled up to a token budget (``micro_batch_tokens``); gradients
  accumulate over all micro-batches of a step, and the loss callback receives per-token
  weights computed over the *whole* batch, so accumulation never changes the objective.
* Logprobs follow the inference engine's convention exactly: ``log_softmax(logits / T)`` in
  float32 over the full vocabulary (T = 1 for greedy), computed as
  ``logits[t] / T - logsumexp(logits / T)`` without materialising the full log-softmax.
* LoRA through peft; weight sync then ships only the adapter tensors.
* ``sharded``: the model is one FSDP2 data-parallel rank of several
  (:mod:`areal_agents.trainer.fsdp`): each rank trains its own part of the batch, gradients
  are summed over ranks, and a rank with fewer micro-batches runs zero-loss dummies so that
  every rank enters every collective. The weights, checkpoints and the exported model are
  the same as one process's. :mod:`areal_agents.trainer.distributed` sends each rank its
  part.
* Checkpoints hold the trained tensors and the optimizer state in
  ``torch.distributed.checkpoint`` form (``dcp/``, loadable by any number of ranks), plus
  the model or adapter as a transformers / peft directory (``model/``) for ``eval`` and
  ``serve``.

Left out: tensor/pipeline parallelism, sequence parallelism.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from areal_agents import spans
from areal_agents.engines.protocol import WeightUpdate
from areal_agents.engines.weights import apply_weight_update
from areal_agents.errors import ConfigError
from areal_agents.hardware import default_device
from areal_agents.trainer import fsdp
from areal_agents.trainer.loss import entropy_from_logits, scale_logits
from areal_agents.trainer.protocols import Temperature
from areal_agents.trainer.schedule import LrSchedule
from areal_agents.trajectory import common_prefix_len


@dataclass
class Packed:
    """One micro-batch: sequences laid out in a single row.

    Flat (:func:`make_packed`): concatenated, ``position_ids`` restarting at 0 for each, so
    transformers builds the block-diagonal causal mask. Tree (:func:`make_tree_packed`):
    shared prefixes stored once and an explicit ``attention_mask``."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    spans: list[tuple[int, int, int]]  # (item index, start, end) in the row (flat layout)
    keep: torch.Tensor | None = None
    """[1, T] bool: row positions whose logits are needed (None: all of them)."""
    windows: list[tuple[int, int]] | None = None
    """Per item, the window [a, b) of its tokens 1..n-1 (0-based) whose logprobs are needed."""
    rows: list[torch.Tensor] | None = None
    """Per item, the row position of each of its tokens (tree layout; None when flat)."""
    attention_mask: torch.Tensor | None = None
    """[1, 1, T, T] additive mask of the tree layout (0 = attend, dtype min = blocked)."""

    @property
    def items(self) -> list[int]:
        return [i for i, _, _ in self.spans]

    def item_rows(self, k: int) -> torch.Tensor:
        if self.rows is not None:
            return self.rows[k]
        _, s, e = self.spans[k]
        return torch.arange(s, e)


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group item indices into micro-batches of at most ``max_tokens`` tokens (first fit,
    longest first). An item longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def pack_shared(seqs: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Micro-batches for the tree layout: items in lexicographic order, each micro-batch
    holding at most ``max_tokens`` tree tokens (an item costs its length minus the prefix
    it shares with the item before it, which in sorted order is the longest prefix it
    shares with any earlier item). An item longer than the budget is alone."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    bins: list[list[int]] = []
    used = 0
    for k, i in enumerate(order):
        shared = common_prefix_len(seqs[order[k - 1]], seqs[i]) if bins and bins[-1] else 0
        cost = len(seqs[i]) - shared
        if bins and used + cost <= max_tokens:
            bins[-1].append(i)
            used += cost
        else:
            bins.append([i])
            used = len(seqs[i])
    return bins


def tree_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """Tokens of the prefix tree of ``seqs`` (what :func:`make_tree_packed` lays out)."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    return sum(
        len(seqs[i]) - (common_prefix_len(seqs[order[k - 1]], seqs[i]) if k else 0)
        for k, i in enumerate(order)
    )


def _needed_windows(
    indices: Sequence[int], needed: Sequence[torch.Tensor]
) -> list[tuple[int, int]]:
    windows = []
    for i in indices:
        hits = torch.nonzero(torch.as_tensor(needed[i]) > 0).flatten()
        windows.append((int(hits[0]), int(hits[-1]) + 1) if len(hits) else (0, 0))
    return windows


def make_packed(
    seqs: Sequence[Sequence[int]],
    indices: Sequence[int],
    device: Any,
    needed: Sequence[torch.Tensor] | None = None,
) -> Packed:
    """Concatenate ``seqs[indices]`` into one row.

    ``needed[i]`` (bool or 0/1 over tokens 1..n-1 of sequence i): the tokens whose logprobs
    the loss uses. Then only the logits of the window from the first to the last needed
    token are computed (prompt tokens need none), which skips most of the vocabulary
    projection and log-softmax; logprobs outside the window are returned as 0.
    """
    ids: list[int] = []
    pos: list[int] = []
    spans = []
    for i in indices:
        start = len(ids)
        ids.extend(seqs[i])
        pos.extend(range(len(seqs[i])))
        spans.append((i, start, len(ids)))
    packed = Packed(torch.tensor([ids], device=device), torch.tensor([pos], device=device), spans)
    if needed is not None:
        windows = _needed_windows(indices, needed)
        keep = torch.zeros(1, len(ids), dtype=torch.bool)
        for (_, s, _), (a, b) in zip(spans, windows, strict=True):
            keep[0, s + a : s + b] = True  # logits at row position p predict token p + 1
        packed.keep, packed.windows = keep.to(device), windows
    return packed


def make_tree_packed(
    seqs: Sequence[Sequence[int]],
    indices: Sequence[int],
    device: Any,
    needed: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Packed:
    """Lay out ``seqs[indices]`` as a prefix tree in one row (see the module docstring).

    Each tree segment is a run of tokens shared by the same items; segments come in
    depth-first order, so a token's ancestors always precede it. A token at row j attends
    to row k iff k <= j and k's segment is j's segment or one of its ancestors. Its
    position id is its index in its own sequence. ``needed`` as in :func:`make_packed`.
    """
    segments: list[tuple[int, int, int, int]] = []  # (parent, source item, start, end)
    ends: dict[int, int] = {}

    def grow(items: list[int], depth: int, parent: int) -> None:
        branches: dict[int, list[int]] = {}
        for i in items:
            if len(seqs[i]) == depth:
                ends[i] = parent
            else:
                branches.setdefault(seqs[i][depth], []).append(i)
        for branch in branches.values():
            first = seqs[branch[0]]
            end = min(common_prefix_len(first, seqs[i]) for i in branch)
            segments.append((parent, branch[0], depth, end))
            grow(branch, end, len(segments) - 1)

    grow(list(indices), 0, -1)
    offsets: list[int] = []
    ids: list[int] = []
    pos: list[int] = []
    seg_of_row: list[int] = []
    for s, (_, src, a, b) in enumerate(segments):
        offsets.append(len(ids))
        ids.extend(seqs[src][a:b])
        pos.extend(range(a, b))
        seg_of_row.extend([s] * (b - a))
    n_seg = len(segments)
    ancestor = torch.eye(n_seg, dtype=torch.bool)  # [s, t]: t is s or an ancestor of s
    for s, (parent, *_rest) in enumerate(segments):
        if parent >= 0:
            ancestor[s] |= ancestor[parent]
    seg = torch.tensor(seg_of_row)
    allowed = ancestor[seg][:, seg] & torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    mask = torch.zeros(len(ids), len(ids), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    rows = []
    for i in indices:
        path, s = [], ends[i]
        while s >= 0:
            path.append(s)
            s = segments[s][0]
        spans = [(offsets[t], offsets[t] + segments[t][3] - segments[t][2]) for t in path[::-1]]
        rows.append(torch.cat([torch.arange(a, b) for a, b in spans]))
    packed = Packed(
        torch.tensor([ids], device=device),
        torch.tensor([pos], device=device),
        [(i, -1, -1) for i in indices],
        rows=rows,
        attention_mask=mask[None, None].to(device),
    )
    if needed is not None:
        windows = _needed_windows(indices, needed)
        keep = torch.zeros(1, len(ids), dtype=torch.bool)
        for r, (a, b) in zip(rows, windows, strict=True):
            keep[0, r[a:b]] = True  # logits at row r[t] predict the item's token t + 1
        packed.keep, packed.windows = keep.to(device), windows
    return packed


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log_softmax(logits / T)[target] in float32 (T = 1 where it is 0); ``temperature`` is
    a number or one per row of ``logits``."""
    scaled = scale_logits(logits, temperature)
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, -1)


def step_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """``scheduler.step()``, without torch's warning for a step whose optimizer update was
    skipped (the schedule counts training steps, updates or not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
        )
        scheduler.step()


def load_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, schedule: LrSchedule, path: Path
) -> None:
    """Restore a saved schedule position. A checkpoint written before schedules were saved
    (no ``scheduler.pt``) resumes a constant rate as it is and refuses any other schedule,
    naming the fix."""
    if not path.exists():
        if schedule == LrSchedule(total_steps=schedule.total_steps):  # constant, no warmup
            return
        raise ConfigError(
            f"{path.parent} has no scheduler.pt (the learning-rate schedule's position); it "
            "was written by an older version: resume it with optim.schedule=constant and "
            "optim.warmup_steps=0, or start a new run (set train.output_dir)"
        )
    scheduler.load_state_dict(torch.load(path, weights_only=False))
    # the rate the optimizer uses next is the schedule's (also when no optimizer state was
    # saved: a checkpoint before the first update)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


LossFn = Callable[[list[int], list[torch.Tensor], list[torch.Tensor]], tuple[torch.Tensor, dict]]
"""(item indices, per-item token logprobs [len-1], per-item entropies) -> (loss, stats)."""


class Policy:
    """The model being trained, its optimizer, and how its weights reach the engine."""

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
        reference: bool = False,
        share_prefixes: bool = True,
        schedule: LrSchedule | None = None,
        sharded: bool = False,
        cpu_offload: bool = False,
    ) -> None:
        """``sharded``: this process is one FSDP2 rank (the process group is initialised;
        see the module docstring), with ``cpu_offload`` of its shards to host memory.
        ``schedule``: the learning-rate schedule with peak ``lr``
        (:mod:`areal_agents.trainer.schedule`; None = constant), advanced by
        :meth:`step_schedule` once per training step.
        ``reference``: keep the starting weights as the reference policy of a KL penalty
        (:meth:`ref_logprobs`). With LoRA that costs nothing (the base without the adapter
        is the reference); a full fine-tune keeps a frozen copy of the model.
        ``share_prefixes``: compute shared prefixes once (the tree layout of
        :func:`make_tree_packed`); ignored with flash-attention kernels."""
        from transformers import AutoModelForCausalLM  # noqa: PLC0415  transformers loads only when a model is built

        self.device = torch.device(default_device(device))
        self.model_path = model_path
        self.sharded, self.cpu_offload = sharded, cpu_offload
        load_dtype, self.compute_dtype = getattr(torch, dtype), None
        if sharded and self.device.type == "cuda" and load_dtype != torch.float32:
            # float32 master weights, computed in the configured low precision
            load_dtype, self.compute_dtype = torch.float32, load_dtype
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=load_dtype)
        self.is_lora = bool(lora)
        if lora:
            from peft import LoraConfig, get_peft_model  # noqa: PLC0415  peft loads only with LoRA enabled

            self.lora_config = LoraConfig(task_type="CAUSAL_LM", **lora)
            model = get_peft_model(model, self.lora_config)  # type: ignore[assignment]
        if activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False} if sharded else None
            )
            if lora:
                model.enable_input_require_grads()
        self.model = self._placed(model, random_init=bool(lora))
        self._reference: Any = None
        if reference and not lora:
            if sharded:  # a sharded module cannot be copied: load the starting weights again
                with torch.random.fork_rng(devices=[]):  # as random as the copy: not at all
                    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=load_dtype)
                self._reference = self._placed(ref.eval().requires_grad_(False), False)
            else:
                self._reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.schedule = schedule or LrSchedule()
        self.scheduler = self.schedule.scheduler(self.optimizer)
        self.grad_clip = grad_clip
        attn = str(getattr(model.config, "_attn_implementation", "") or "")
        self.share_prefixes = share_prefixes and not attn.startswith("flash")
        self.mask_dtype = self.compute_dtype or next(model.parameters()).dtype
        # Shared with an inference engine in the same process (see EmbeddedEngine).
        self._compute = spans.TimedLock(compute_lock, "trainer")

    def _placed(self, model: Any, random_init: bool) -> Any:
        """``model`` on the device; sharded: every rank starting from rank 0's randomly
        initialised tensors (``random_init``: LoRA adapters), then sharded."""
        if not self.sharded:
            return model.to(self.device)
        model = model.to("cpu" if self.cpu_offload else self.device)
        if random_init:
            fsdp.broadcast_from_rank0(p for p in model.parameters() if p.requires_grad)
        fsdp.shard(model, compute_dtype=self.compute_dtype, cpu_offload=self.cpu_offload)
        return model

    def _padded(self, packs: list[Packed]) -> list[Packed | None]:
        """``packs`` and, sharded, as many ``None`` (dummy micro-batches) as make every
        rank run the same number of forward passes."""
        n = fsdp.max_over_ranks(len(packs)) if self.sharded else len(packs)
        return [*packs, *[None] * (n - len(packs))]

    def _dummy_forward(self) -> torch.Tensor:
        """A two-token forward pass that enters the sharded model's collectives."""
        return self._forward(make_packed([[0, 0]], [0], self.device))

    def reset_optimizer(self, lr: float) -> None:
        """A fresh optimizer state and schedule, peak ``lr`` (after a warm start, before RL)."""
        group = self.optimizer.param_groups[0]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=group["weight_decay"], betas=group["betas"]
        )
        self.scheduler = self.schedule.scheduler(self.optimizer)

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate, until the schedule's next step (the warm
        start trains at ``sft.lr`` without a schedule)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def vocab_size(self) -> int:
        """The rows of the model's input embeddings (the token ids it reads)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    def step_schedule(self) -> None:
        """Advance the learning-rate schedule by one training step (also when the step's
        update was skipped for a non-finite gradient norm: the schedule counts steps)."""
        step_scheduler(self.scheduler)

    # ------------------------------------------------------------------ forward passes
    def _forward(self, packed: Packed) -> torch.Tensor:
        """Logits of the positions in ``packed.keep`` (all positions when it is None)."""
        kwargs: dict[str, Any] = {}
        if packed.keep is not None:
            kwargs["logits_to_keep"] = packed.keep
        if packed.attention_mask is not None:
            kwargs["attention_mask"] = packed.attention_mask
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **kwargs,
        )
        logits = out.logits
        return logits if packed.keep is not None and logits.dim() == 2 else logits[0]

    def _pack(
        self,
        seqs: Sequence[Sequence[int]],
        micro_batch_tokens: int,
        needed: Sequence[torch.Tensor] | None,
    ) -> list[Packed]:
        """The micro-batches of ``seqs``: a prefix tree each when prefixes are shared (and
        the attention kernel takes a mask), else flat."""
        if self.share_prefixes and tree_tokens(seqs) < sum(len(s) for s in seqs):
            return [
                make_tree_packed(seqs, group, self.device, needed, self.mask_dtype)
                for group in pack_shared(seqs, micro_batch_tokens)
            ]
        return [
            make_packed(seqs, group, self.device, needed)
            for group in pack([len(s) for s in seqs], micro_batch_tokens)
        ]

    def _per_item(
        self,
        logits: torch.Tensor,
        packed: Packed,
        temperature: Temperature,
        entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per item, logprobs (and entropies, with gradient if ``entropy_grad``) of its tokens
        1..n-1; positions outside the item's kept window hold 0 and carry no gradient."""
        ids = packed.input_ids[0]
        logps, ents = [], []
        # row of ``logits`` for each row position (only kept positions were computed)
        compact = None if packed.keep is None else packed.keep[0].long().cumsum(0) - 1
        windows = packed.windows
        for k in range(len(packed.spans)):
            rows = packed.item_rows(k).to(ids.device)
            n = len(rows) - 1
            a, b = windows[k] if windows is not None else (0, n)
            src = rows[a:b] if compact is None else compact[rows[a:b]]
            if b > a and int(src[-1] - src[0]) == b - a - 1:  # contiguous: a view, no copy
                lg = logits[int(src[0]) : int(src[0]) + b - a]
            else:
                lg = logits[src]
            t: float | torch.Tensor = (
                temperature
                if isinstance(temperature, (int, float))
                else temperature[packed.items[k]][a:b]
            )
            lp = token_logprobs(lg, ids[rows[a + 1 : b + 1]], t)
            if entropy:
                ent = entropy_from_logits(lg if entropy_grad else lg.detach(), t)
            else:
                ent = lp.new_zeros(b - a)
            if (a, b) != (0, n):
                pad = (lp.new_zeros(a), lp.new_zeros(n - b))
                lp = torch.cat([pad[0], lp, pad[1]])
                ent = torch.cat([pad[0], ent, pad[1]])
            logps.append(lp)
            ents.append(ent if entropy else lp.new_zeros(0))
        return logps, ents

    @torch.no_grad()
    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Per sequence, the logprob of tokens 1..n-1 given their prefix (float32, CPU);
        with ``needed``, 0 outside each sequence's needed window (see :func:`make_packed`)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for packed in self._padded(self._pack(seqs, micro_batch_tokens, needed)):
            with self._compute("logprobs"):
                if packed is None:
                    self._dummy_forward()
                    continue
                logps, _ = self._per_item(self._forward(packed), packed, temperature, False)
            for i, lp in zip(packed.items, logps, strict=True):
                out[i] = lp.cpu()
        self.model.train(was_training)
        return [x for x in out if x is not None]

    @torch.no_grad()
    def ref_logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`logprobs` under the reference policy: the starting weights (the base model
        with the LoRA adapter disabled, or the frozen copy kept with ``reference=True``)."""
        if self.is_lora:
            with self.model.disable_adapter():
                return self.logprobs(seqs, temperature, micro_batch_tokens, needed)
        if self._reference is None:
            raise RuntimeError("Policy(reference=True) keeps the reference of a full fine-tune")
        current, self.model = self.model, self._reference
        try:
            return self.logprobs(seqs, temperature, micro_batch_tokens, needed)
        finally:
            self.model = current

    def train_step(
        self,
        seqs: Sequence[Sequence[int]],
        loss_fn: LossFn,
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over all ``seqs`` with gradient accumulation.

        ``needed``: per sequence, the tokens the loss uses (e.g. its loss mask); logits are
        then computed only over their window (see :func:`make_packed`). ``entropy_grad``:
        the entropies handed to ``loss_fn`` carry gradient (an entropy bonus); otherwise
        they are detached, for metrics only."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        n_micro = 0
        for packed in self._padded(self._pack(seqs, micro_batch_tokens, needed)):
            with self._compute():  # one turn of the lock; its parts recorded as spans
                t0 = time.perf_counter()
                if packed is None:  # enters the collectives; adds nothing to the gradient
                    (self._dummy_forward().sum() * 0.0).backward()
                    spans.add("trainer", "backward", t0, time.perf_counter(), dummy=True)
                    continue
                logits = self._forward(packed)
                logps, ents = self._per_item(logits, packed, temperature, True, entropy_grad)
                loss, stats = loss_fn(packed.items, logps, ents)
                t1 = time.perf_counter()
                loss.backward()
                del logits, logps, ents, loss  # not held through the optimizer step
                t2 = time.perf_counter()
            spans.add("trainer", "forward", t0, t1, tokens=int(packed.input_ids.shape[1]))
            spans.add("trainer", "backward", t1, t2)
            n_micro += 1
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        totals["micro_batches"] = n_micro
        if self.sharded:
            totals = fsdp.sum_over_ranks(totals)
        with self._compute("optimizer"):
            norm = float(
                fsdp.full_value(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
            )
            if math.isfinite(norm):
                self.optimizer.step()
        totals["grad_norm"] = norm
        return totals

    # ------------------------------------------------------------------ weights
    def _trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors the engine needs, as host copies: the LoRA adapter (peft's names,
        without the adapter name) or the whole model. Sharded: gathered in buckets, whole
        on rank 0 only ({} on the others)."""
        if self.is_lora:
            from peft import get_peft_model_state_dict  # noqa: PLC0415  peft loads only with LoRA enabled

            state = get_peft_model_state_dict(self.model)
        else:
            state = self.model.state_dict()
        if self.sharded:
            return fsdp.gather_state(state)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def weight_update(self, version: int) -> WeightUpdate:
        """The current weights for the inference engine (adapter only with LoRA); sharded,
        complete on rank 0 only."""
        sd = self._trained_state()
        if self.is_lora:
            return WeightUpdate(
                kind="lora", state_dict=sd, lora_config=self.lora_config, version=version
            )
        return WeightUpdate(kind="full", state_dict=sd, version=version)

    def save(self, directory: str | Path) -> None:
        """Trained tensors and optimizer state (``dcp/``), the model or adapter as a
        transformers / peft directory (``model/``) and the schedule state, for resuming.
        Sharded: every rank writes its shards; rank 0 the rest."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        fsdp.save_state(self.model, self.optimizer, d / "dcp", trainable_only=self.is_lora)
        if not self.sharded:
            self.model.save_pretrained(d / "model")
        elif self.is_lora:
            self._save_adapter(self._trained_state(), d / "model")
        else:
            host = self._host_copy()
            if host is not None:
                host.save_pretrained(d / "model")
        if fsdp.rank() == 0:
            torch.save(self.scheduler.state_dict(), d / "scheduler.pt")

    def _save_adapter(self, state: dict[str, torch.Tensor], directory: Path) -> None:
        """Rank 0: the adapter as peft writes it (``adapter_model.safetensors`` and
        ``adapter_config.json``)."""
        if fsdp.rank() != 0:
            return
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in state.items()}, directory / "adapter_model.safetensors"
        )
        self.model.peft_config["default"].save_pretrained(str(directory))

    def _host_copy(self) -> Any:
        """Sharded: on rank 0, an unsharded copy of the model on the host with the current
        weights (the base model loaded again, plus the gathered trained tensors); None on
        the other ranks. Unsharded: the model itself."""
        if not self.sharded:
            return self.model
        state = self._trained_state()
        if fsdp.rank() != 0:
            return None
        from transformers import AutoModelForCausalLM  # noqa: PLC0415  transformers loads only when a model is built

        with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it is
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.mask_dtype)
            if self.is_lora:
                from peft import get_peft_model, set_peft_model_state_dict  # noqa: PLC0415  peft loads only with LoRA enabled

                model = get_peft_model(model, self.lora_config)  # type: ignore[assignment]
                set_peft_model_state_dict(model, state)
            else:
                model.load_state_dict(state)
        return model

    def load(self, directory: str | Path) -> None:
        d = Path(directory)
        if (d / "dcp").exists():
            try:
                fsdp.load_state(self.model, self.optimizer, d / "dcp", trainable_only=self.is_lora)
            except fsdp.CheckpointMismatch as exc:
                raise ConfigError(
                    f"the checkpoint {d} does not fit this run's model ({exc}); resume with "
                    "the model and model.lora it was written with, or set train.output_dir "
                    "to a new directory"
                ) from exc
        elif self.sharded:
            raise ConfigError(
                f"{d} was written by an older version (no dcp/ directory), which sharded "
                "ranks cannot read; resume it with train.nproc=1 (one checkpoint later it "
                "can be resumed with any train.nproc)"
            )
        else:
            path = str(d / "model")
            update = (
                WeightUpdate(kind="lora", path=path) if self.is_lora else WeightUpdate(path=path)
            )
            apply_weight_update(self.model, update)
            self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=False))
        load_schedule(self.scheduler, self.schedule, d / "scheduler.pt")

    def export(
        self, directory: str | Path, tokenizer_dir: str | Path, merge_lora: bool = True
    ) -> Path:
        """A HF directory that ``areal-agent serve --model`` loads (sharded: written by
        rank 0)."""
        d = Path(directory)
        model = self._host_copy()
        if model is None:  # another rank: it took part in the gather
            return d
        d.mkdir(parents=True, exist_ok=True)
        if self.is_lora and merge_lora:
            model = (model if self.sharded else copy.deepcopy(model)).merge_and_unload()
        model.save_pretrained(d)
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(
                (
                    "tokenizer",
                    "chat_template",
                    "special_tokens",
                    "generation_config",
                    "vocab",
                    "merges",
                )
            ):
                shutil.copy(f, d / f.name)
        return d
