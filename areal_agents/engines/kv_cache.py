"""KV caches of the embedded engine: the batch's buffers, shared prefixes, reused prefixes.

- :func:`batch_layer_class`: one layer of the batch's cache in preallocated buffers (rows
  left-padded to a common width), so a decode step writes its column in place, a joining
  request fills the next free row and a finished one's row is refilled by the last row;
- :class:`SharedPrefix`: the cached tokens every active row starts with (what cascade
  attention reads once per step, :mod:`areal_agents.engines.attention`);
- :class:`PrefixCache`: keys and values of recently prefilled token sequences, reused
  exactly by later requests that start with them.

transformers' cache classes (``DynamicCache``, ``DynamicLayer``) are loaded on first use.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areal_agents.trajectory import common_prefix_len

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Keys and values per layer (``[1, H_kv, L, D]`` each for one sequence)."""


def dynamic_cache(kv: KV) -> Any:
    """A transformers ``DynamicCache`` holding ``kv``."""
    from transformers import DynamicCache  # noqa: PLC0415  transformers loads with a model

    return DynamicCache(ddp_cache_data=kv)


def empty_cache(model: Any, device: torch.device) -> Any:
    """A ``DynamicCache`` of no tokens with ``model``'s layers, heads and dtype."""
    cfg = model.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    empty = torch.zeros(1, heads, 0, head_dim, dtype=dtype, device=device)
    return dynamic_cache([(empty, empty)] * cfg.num_hidden_layers)


def cache_kwarg(model: Any) -> str:
    """transformers >= 5.24 names the KV-cache argument ``cache``; earlier: past_key_values."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class PrefixCache:
    """Keys and values of recently prefilled token sequences, for exact reuse.

    ``lookup`` finds the stored sequence sharing the longest prefix with the query and
    returns that many tokens of its keys and values (the KV of a prefix depends only on the
    prefix): a system prompt and tool list common to many episodes, or the previous turn of
    the same conversation (its prompt and the reply generated for it, stored when the
    request finishes), are computed once. Entries are evicted least recently used.
    Tensors are never modified in place (caches grow by concatenation), so entries are
    shared without copies. Whoever changes the weights must ``clear`` it.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], KV]
        self._entries = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, ids: Sequence[int]) -> tuple[int, KV]:
        query = tuple(ids)
        best, best_key = 0, None
        for key in self._entries:
            n = common_prefix_len(query, key)
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in self._entries[best_key]]

    def store(self, ids: Sequence[int], kv: KV) -> None:
        if self.max_entries < 1 or not ids:
            return
        key = tuple(ids)
        self._entries[key] = [(k[:, :, : len(key)], v[:, :, : len(key)]) for k, v in kv]
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


@dataclass
class SharedPrefix:
    """The first ``length`` cached tokens of every active row (``ids[:length]``), with the
    keys and values of the row they were taken from (``[1, H_kv, >= length, D]`` per layer)."""

    ids: list[int]
    kv: KV
    length: int


@functools.cache
def batch_layer_class() -> type:
    """The class of the batch cache's layers: a transformers ``DynamicLayer`` subclass, made
    on first use."""
    from transformers.cache_utils import (  # noqa: PLC0415  transformers loads with a model
        DynamicLayer,
    )

    class BatchLayer(DynamicLayer):
        """One layer of the batch's KV cache, in buffers with room to grow.

        Rows ``[0, rows)`` are the active requests; the live columns ``[start, end)`` hold
        their keys and values, left-padded (with zeros) to a common width. ``keys`` and
        ``values`` are views of that region, which the model reads. A decode step writes
        its column in place (``DynamicLayer`` concatenates, copying the whole batch's cache
        at every step); a joining request is written into the next free row; a retired row
        is refilled by the last row (:meth:`compact`). Buffers are reallocated (one copy)
        only when they run out of rows or columns.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.device, self.is_initialized = keys.device, True
            self.rows, self.start, self.end = 0, 0, 0
            self._kbuf = keys.new_zeros(0, *keys.shape[1:2], 0, keys.shape[3])
            self._vbuf = values.new_zeros(0, *values.shape[1:2], 0, values.shape[3])
            self.add_row(keys, values)

        def _view(self) -> None:
            self.keys = self._kbuf[: self.rows, :, self.start : self.end]
            self.values = self._vbuf[: self.rows, :, self.start : self.end]

        def _realloc(self, rows: int, left: int, right: int) -> None:
            """New buffers for ``rows`` rows with ``left`` free columns before the live
            region and ``right`` after it."""
            width = self.end - self.start
            k, v = self._kbuf, self._vbuf
            self._kbuf = k.new_zeros(rows, k.shape[1], left + width + right, k.shape[3])
            self._vbuf = v.new_zeros(rows, v.shape[1], left + width + right, v.shape[3])
            self._kbuf[: self.rows, :, left : left + width] = k[
                : self.rows, :, self.start : self.end
            ]
            self._vbuf[: self.rows, :, left : left + width] = v[
                : self.rows, :, self.start : self.end
            ]
            self.start, self.end = left, left + width

        def add_row(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Append a request's cache (``[1, H, L, D]``) as the last row."""
            n, width = keys.shape[-2], self.end - self.start
            full = self.rows == self._kbuf.shape[0]
            if full or self.end - n < 0:  # no free row, or too little room on the left
                rows = max(4, 2 * self._kbuf.shape[0]) if full else self._kbuf.shape[0]
                room = max(64, max(width, n) // 2)
                self._realloc(rows, left=max(0, n - width) + room, right=room)
            if self.end - n < self.start:  # wider than the others: they get zero padding
                self._kbuf[: self.rows, :, self.end - n : self.start] = 0
                self._vbuf[: self.rows, :, self.end - n : self.start] = 0
                self.start = self.end - n
            r = self.rows
            self._kbuf[r, :, self.start : self.end - n] = 0
            self._vbuf[r, :, self.start : self.end - n] = 0
            self._kbuf[r, :, self.end - n : self.end] = keys[0]
            self._vbuf[r, :, self.end - n : self.end] = values[0]
            self.rows += 1
            self._view()

        def compact(self, rows: int, moves: list[tuple[int, int]], trim: int) -> None:
            """Keep ``rows`` rows after copying row ``src`` to ``dst`` for each move, and
            drop ``trim`` leading columns (padding in every row)."""
            live = slice(self.start, self.end)
            for dst, src in moves:
                self._kbuf[dst, :, live] = self._kbuf[src, :, live]
                self._vbuf[dst, :, live] = self._vbuf[src, :, live]
            self.rows = rows
            self.start += trim
            self._view()

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            new = key_states.shape[-2]
            if self.end + new > self._kbuf.shape[2]:
                width = self.end - self.start
                self._realloc(self._kbuf.shape[0], self.start, max(64, width // 2) + new)
            self._kbuf[: self.rows, :, self.end : self.end + new] = key_states
            self._vbuf[: self.rows, :, self.end : self.end + new] = value_states
            self.end += new
            self._view()
            return (
                self._kbuf[: self.rows, :, self.start : self.end],
                self._vbuf[: self.rows, :, self.start : self.end],
            )

    return BatchLayer


def cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a ``[B, T]`` mask with zeros to ``width`` columns."""
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([torch.zeros(mask.shape[0], missing, dtype=mask.dtype), mask], 1)
