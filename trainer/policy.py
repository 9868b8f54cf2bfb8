"""The trainable policy: a transformers causal LM (optionally with a peft LoRA adapter).

Choices made here:

* Sequences are packed into micro-batches without padding: several sequences share one row,
  ``position_ids`` restart at 0 for each, and transformers builds a block-diagonal causal mask
  from them (``use_cache=False``), so no token attends across sequences and no compute is
  spent on pad tokens.
* Micro-batches are filled up to a token budget (``micro_batch_tokens``); gradients
  accumulate over all micro-batches of a step, and the loss callback receives per-token
  weights computed over the *whole* batch, so accumulation never changes the objective.
* Logprobs follow the inference engine's convention exactly: ``log_softmax(logits / T)`` in
  float32 over the full vocabulary (T = 1 for greedy), computed as
  ``logits[t] / T - logsumexp(logits / T)`` without materialising the full log-softmax.
* LoRA through peft; weight sync then ships only the adapter tensors.

Left out: tensor/pipeline parallelism (one device), sequence parallelism.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_agents.engine import WeightUpdate


@dataclass
class Packed:
    """One micro-batch: sequences concatenated into a single row."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    spans: list[tuple[int, int, int]]  # (item index, start, end) in the row
    keep: torch.Tensor | None = None
    """[1, T] bool: row positions whose logits are needed (None: all of them)."""
    windows: list[tuple[int, int]] | None = None
    """Per span, the window [a, b) of its tokens 1..n-1 (0-based) whose logprobs are needed."""


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
    windows: list[tuple[int, int]] = []
    for i in indices:
        start = len(ids)
        ids.extend(seqs[i])
        pos.extend(range(len(seqs[i])))
        spans.append((i, start, len(ids)))
        if needed is not None:
            hits = torch.nonzero(torch.as_tensor(needed[i]) > 0).flatten()
            a, b = (int(hits[0]), int(hits[-1]) + 1) if len(hits) else (0, 0)
            windows.append((a, b))
    packed = Packed(torch.tensor([ids], device=device), torch.tensor([pos], device=device), spans)
    if needed is not None:
        keep = torch.zeros(1, len(ids), dtype=torch.bool)
        for (_, s, _), (a, b) in zip(spans, windows, strict=True):
            keep[0, s + a : s + b] = True  # logits at row position p predict token p + 1
        packed.keep, packed.windows = keep.to(device), windows
    return packed


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[target] in float32 (T = 1 when temperature is 0)."""
    t = temperature if temperature > 0 else 1.0
    scaled = logits.float() / t
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, -1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, -1)
    return -(logp.exp() * logp).sum(-1)


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
    ) -> None:
        """``reference``: keep the starting weights as the reference policy of a KL penalty
        (:meth:`ref_logprobs`). With LoRA that costs nothing (the base without the adapter
        is the reference); a full fine-tune keeps a frozen copy of the model."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.is_lora = bool(lora)
        if lora:
            from peft import LoraConfig, get_peft_model

            self.lora_config = LoraConfig(task_type="CAUSAL_LM", **lora)
            model = get_peft_model(model, self.lora_config)  # type: ignore[assignment]
        if activation_checkpointing:
            model.gradient_checkpointing_enable()
            if lora:
                model.enable_input_require_grads()
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self._reference: Any = None
        if reference and not lora:
            import copy

            self._reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.grad_clip = grad_clip
        # Shared with an inference engine in the same process (see EmbeddedEngine).
        self._compute = compute_lock or contextlib.nullcontext()

    def reset_optimizer(self, lr: float) -> None:
        """A fresh optimizer state (after a warm start, before RL)."""
        group = self.optimizer.param_groups[0]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=group["weight_decay"], betas=group["betas"]
        )

    # ------------------------------------------------------------------ forward passes
    def _forward(self, packed: Packed) -> torch.Tensor:
        """Logits of the positions in ``packed.keep`` (all positions when it is None)."""
        kwargs: dict[str, Any] = {}
        if packed.keep is not None:
            kwargs["logits_to_keep"] = packed.keep
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **kwargs,
        )
        logits = out.logits
        return logits if packed.keep is not None and logits.dim() == 2 else logits[0]

    def _per_item(
        self, logits: torch.Tensor, packed: Packed, temperature: float, entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per item, logprobs (and entropies) of its tokens 1..n-1; positions outside the
        item's kept window hold 0 and carry no gradient."""
        ids = packed.input_ids[0]
        logps, ents = [], []
        row = 0  # next row of ``logits`` when only kept positions were computed
        windows = packed.windows
        for k, (_, s, e) in enumerate(packed.spans):
            a, b = windows[k] if windows is not None else (0, e - s - 1)
            if packed.keep is not None:
                lg = logits[row : row + (b - a)]
                row += b - a
            else:
                lg = logits[s : e - 1]
            lp = token_logprobs(lg, ids[s + 1 + a : s + 1 + b], temperature)
            ent = token_entropy(lg.detach(), temperature) if entropy else lp.new_zeros(b - a)
            n = e - s - 1
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
        temperature: float,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Per sequence, the logprob of tokens 1..n-1 given their prefix (float32, CPU);
        with ``needed``, 0 outside each sequence's needed window (see :func:`make_packed`)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for group in pack([len(s) for s in seqs], micro_batch_tokens):
            packed = make_packed(seqs, group, self.device, needed)
            with self._compute:
                logps, _ = self._per_item(self._forward(packed), packed, temperature, False)
            for (i, _, _), lp in zip(packed.spans, logps, strict=True):
                out[i] = lp.cpu()
        self.model.train(was_training)
        return [x for x in out if x is not None]

    @torch.no_grad()
    def ref_logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: float,
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
        temperature: float,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over all ``seqs`` with gradient accumulation.

        ``needed``: per sequence, the tokens the loss uses (e.g. its loss mask); logits are
        then computed only over their window (see :func:`make_packed`)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        n_micro = 0
        for group in pack([len(s) for s in seqs], micro_batch_tokens):
            packed = make_packed(seqs, group, self.device, needed)
            with self._compute:
                logps, ents = self._per_item(self._forward(packed), packed, temperature, True)
                loss, stats = loss_fn([i for i, _, _ in packed.spans], logps, ents)
                loss.backward()
            n_micro += 1
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        with self._compute:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            if math.isfinite(float(norm)):
                self.optimizer.step()
        totals["grad_norm"] = float(norm)
        totals["micro_batches"] = n_micro
        return totals

    # ------------------------------------------------------------------ weights
    def weight_update(self, version: int) -> WeightUpdate:
        """The current weights for the inference engine (adapter only with LoRA)."""
        if self.is_lora:
            from peft import get_peft_model_state_dict

            sd = {
                k: v.detach().cpu().clone()
                for k, v in get_peft_model_state_dict(self.model).items()
            }
            return WeightUpdate(
                kind="lora", state_dict=sd, lora_config=self.lora_config, version=version
            )
        sd = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return WeightUpdate(kind="full", state_dict=sd, version=version)

    def save(self, directory: str | Path) -> None:
        """Model (or adapter) and optimizer state, for resuming."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(d / "model")
        torch.save(self.optimizer.state_dict(), d / "optimizer.pt")

    def load(self, directory: str | Path) -> None:
        from areal_agents.weights import apply_weight_update

        d = Path(directory)
        path = str(d / "model")
        update = WeightUpdate(kind="lora", path=path) if self.is_lora else WeightUpdate(path=path)
        apply_weight_update(self.model, update)
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=False))

    def export(
        self, directory: str | Path, tokenizer_dir: str | Path, *, merge_lora: bool = True
    ) -> Path:
        """A HF directory that ``areal-agent serve --model`` loads."""
        import shutil

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        model = self.model
        if self.is_lora and merge_lora:
            import copy

            model = copy.deepcopy(self.model).merge_and_unload()
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
