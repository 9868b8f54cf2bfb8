"""Supervised warm start: next-token loss on the assistant turns of demonstration chats.

Choices made:

* Demonstrations are rendered exactly as the proxy renders prompts during RL (the same chat
  template, the same tool schemas from the environment), so the warm start teaches the very
  token format the policy will be sampled in.
* Loss on assistant turns only (their content or tool-call text and the end-of-turn token);
  system, user and tool tokens are context. Token i of assistant turn k is trained when the
  tokens rendered for turns < k followed by the generation prompt are a prefix of the whole
  conversation; a turn whose prefix does not hold is skipped and counted.
* Recorded episodes (``sft.kind: episodes``: an ``episodes.jsonl`` as ``areal-agent eval
  --out`` writes it) are trained on as recorded, no template involved: each row's training
  samples (``samples``: ``input_ids`` with their ``loss_mask``), so exactly the tokens the
  model sampled are trained, in the token ids it sampled them as. Rows that failed
  (``result.success`` false) or ended in an error (``result.error`` set) are skipped and
  counted; rows without a verdict are kept.
* The loss of a batch is the mean over its trained tokens:
  ``L = -(1 / N) * sum_{i in assistant tokens} log p(x_i | x_<i)``, accumulated over packed
  micro-batches with the same weight ``1 / N``.

Left out: packing several demos per epoch order by length, learning-rate schedules.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from tqdm import tqdm

from areal_agents.errors import ConfigError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.trainer.protocols import Trainable


def _jsonl_rows(p: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-empty line; a ConfigError names a bad one."""
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{p}:{n}: not valid JSON: {exc}") from None


def load_demos(path: str | Path) -> list[list[dict[str, Any]]]:
    """JSONL: each line a list of messages, or an object with a ``messages`` list."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"sft.demos: no file {p}; write one with `areal-agent demos`")
    out = []
    for n, row in _jsonl_rows(p):
        messages = row.get("messages") if isinstance(row, dict) else row
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{p}:{n}: expected a list of messages or {{'messages': [...]}}")
        out.append(messages)
    return out


def load_episode_samples(
    path: str | Path, vocab_size: int | None = None
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The training samples of the episodes in ``path`` (``episodes.jsonl``) as
    ``(token ids, loss mask)``, and how many rows were skipped (failed or errored; see the
    module docstring). ``vocab_size``: token ids must be below it (the episodes were recorded
    with this model's tokenizer)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"sft.demos: no file {p}; record episodes with `areal-agent eval --out DIR` "
            "(DIR/episodes.jsonl)"
        )
    out: list[tuple[list[int], list[int]]] = []
    skipped = 0
    for n, row in _jsonl_rows(p):
        samples = row.get("samples") if isinstance(row, dict) else None
        if not isinstance(samples, list):
            raise ConfigError(
                f"{p}:{n}: expected a recorded episode with 'samples' (as `areal-agent eval "
                "--out` writes); for chat messages set sft.kind=messages"
            )
        result = row.get("result") or {}
        if result.get("success") is False or result.get("error"):
            skipped += 1
            continue
        for s in samples:
            ids, mask = s.get("input_ids"), s.get("loss_mask")
            if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
                raise ConfigError(f"{p}:{n}: a sample needs input_ids and a loss_mask as long")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
                raise ConfigError(
                    f"{p}:{n}: token ids outside the model's vocabulary ({vocab_size}); the "
                    "episodes were recorded with another model: record them with this one"
                )
            out.append(([int(t) for t in ids], [int(bool(m)) for m in mask]))
    return out, skipped


def demo_tools(path: str | Path) -> list[dict[str, Any]] | None:
    """The tool list the rows of a demo file carry (``"tools"``, as ``areal-agent demos
    --agent`` writes them: the agent's tools, which the demos are rendered with), or None
    when they carry none. Rows that carry different lists are a :class:`ConfigError`."""
    found: list[Any] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        row = json.loads(line) if line.strip() else None
        tools = row.get("tools") if isinstance(row, dict) else None
        if tools is not None and not isinstance(tools, list):
            raise ConfigError(f"{path}:{n}: 'tools' must be a list of tool schemas")
        if tools is not None and found and tools != found[0]:
            raise ConfigError(f"{path}:{n}: the rows carry different tool lists; use one")
        if tools is not None and not found:
            found.append(tools)
    return found[0] if found else None


def sft_sample(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[int], int]:
    """(token ids, loss mask, skipped assistant turns) of one demonstration."""
    full = tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=False)
    mask = [0] * len(full)
    skipped = 0
    eos = set(tokenizer.eos_token_ids)
    for k, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        start = tokenizer.encode_chat(messages[:k], tools=tools, add_generation_prompt=True)
        if full[: len(start)] != start:
            skipped += 1
            continue
        # the turn's own tokens, up to and including its end-of-turn token
        i = len(start)
        while i < len(full):
            mask[i] = 1
            i += 1
            if full[i - 1] in eos:
                break
    return full, mask, skipped


@dataclass
class NllLoss:
    """The warm start's loss of one batch, ``-(1 / N) * sum(mask * log p)`` with N the
    batch's trained tokens, as a ``train_step`` loss: called per micro-batch with its items'
    log-probabilities. Trainer ranks split it by sample (:meth:`select` keeps the whole
    batch's N), so the ranks' summed losses and gradients are one process's."""

    masks: list[torch.Tensor]
    """Per sample, the trained tokens among its predicted ones (``mask[1:]``)."""
    total: float
    """N: the trained tokens of the whole batch."""

    @property
    def group_ids(self) -> list[str]:
        return [str(i) for i in range(len(self.masks))]  # any split of the samples is exact

    def select(self, idx: list[int]) -> NllLoss:
        return NllLoss([self.masks[i] for i in idx], self.total)

    def __call__(
        self, items: list[int], logps: list[torch.Tensor], ents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        terms = [(lp * self.masks[i]).sum() for i, lp in zip(items, logps, strict=True)]
        loss = -torch.stack(terms).sum() / self.total
        return loss, {"nll": float(loss.detach())}


class SftOptions(TypedDict):
    """:func:`run_sft`'s settings besides the data (from a run's ``sft`` and ``train``)."""

    epochs: int
    lr: float
    batch_size: int
    micro_batch_tokens: int
    seed: int
    progress: bool


def run_sft(
    policy: Trainable,
    tokenizer: ChatTokenizer,
    demos: Sequence[list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None,
    *,
    epochs: int = 1,
    lr: float = 1e-4,
    batch_size: int = 8,
    micro_batch_tokens: int = 4096,
    seed: int = 0,
    progress: bool = False,
    tokenized: Sequence[tuple[list[int], list[int]]] = (),
    skipped_episodes: int = 0,
) -> dict[str, float]:
    """Train ``policy`` on ``demos`` (and on ``tokenized``: ready ``(token ids, loss mask)``
    pairs, e.g. :func:`load_episode_samples`, with the count of episodes it skipped); returns
    the last batch's mean loss and counts.

    ``progress`` shows a progress bar (batches, with the running loss) on stderr.
    """
    samples = [sft_sample(tokenizer, d, tools) for d in demos]
    skipped = sum(s[2] for s in samples)
    pairs = [*((ids, mask) for ids, mask, _ in samples), *tokenized]
    data = [(ids, mask) for ids, mask in pairs if sum(mask)]
    if not data:
        raise ConfigError(
            "sft: no demonstration has an assistant turn (no episode a sampled token) to train on"
        )
    policy.set_lr(lr)
    rng = random.Random(seed)
    last = 0.0
    steps = 0
    per_epoch = -(-len(data) // batch_size)
    bar = tqdm(
        total=epochs * per_epoch,
        desc="warm start",
        unit="batch",
        disable=not progress,
        file=sys.stderr,
    )
    for _ in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for b in range(0, len(order), batch_size):
            batch = [data[i] for i in order[b : b + batch_size]]
            seqs = [ids for ids, _ in batch]
            masks = [torch.tensor(m[1:], dtype=torch.float32) for _, m in batch]
            loss_fn = NllLoss(masks, float(sum(m.sum() for m in masks)))
            stats = policy.train_step(seqs, loss_fn, 1.0, micro_batch_tokens, masks)
            last = stats["nll"]
            steps += 1
            bar.update()
            bar.set_postfix(nll=f"{last:.3f}")
    bar.close()
    return {
        "sft_nll": last,
        "sft_steps": float(steps),
        "sft_skipped_turns": float(skipped),
        "sft_skipped_episodes": float(skipped_episodes),
        "sft_demos": float(len(data)),
    }
