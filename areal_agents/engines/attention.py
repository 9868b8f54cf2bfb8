"""Attention hooks of the embedded engine: what a CPU decode step computes differently.

Two changes to a transformers model the engine serves, both exact:

- the vocabulary projection on CPU in slices of its weight's rows
  (:func:`slice_output_projection`), whose matmul results stay in cache;
- *cascade attention* for decode steps (:func:`use_cascade_attention`): a prefix shared by
  every row of the batch is read once per step for all rows instead of once per row, the
  two parts of each row's attention merged exactly (:func:`_cascade_attention`). A decode
  step runs its forward pass under :func:`cascade` with the step's plan
  (:func:`cascade_plan`); any other forward pass runs transformers' ``sdpa`` attention.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from areal_agents.engines.kv_cache import SharedPrefix

_LOGIT_SLICE = 1024
"""Vocabulary rows of the output projection per matmul on CPU
(:func:`slice_output_projection`)."""

_CASCADE_MIN_TOKENS = 16
"""Decode steps attend to a prefix shared by every row at least this long as one block
(:func:`_cascade_attention`); shorter shared prefixes are read per row."""


@dataclass
class _CascadePlan:
    """What one decode step's attention needs besides the batch cache: the shared prefix's
    keys and values per layer (``[1, H_kv, n, D]``) and, over the batch cache's columns
    ``n..W-1``, an additive bias that is 0 on each row's own tokens and -inf elsewhere (its
    padding and its copy of the shared prefix)."""

    n: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    bias: torch.Tensor  # [B, W - n]


_PLAN = threading.local()
_CASCADE = "areal_cascade"


def _cascading(model: Any) -> bool:
    return getattr(model.config, "_attn_implementation", None) == _CASCADE


def use_cascade_attention(model: Any) -> None:
    """Let a CPU model's decode steps read a prefix shared by every row once per step
    instead of once per row (:func:`_cascade_attention`); other forward passes (prefill, a
    model without a plan) run transformers' ``sdpa`` attention unchanged."""
    from transformers import AttentionInterface  # noqa: PLC0415  transformers loads with a model
    from transformers.masking_utils import (  # noqa: PLC0415  transformers loads with a model
        AttentionMaskInterface,
        sdpa_mask,
    )

    if (
        next(model.parameters()).device.type != "cpu"
        or getattr(model.config, "_attn_implementation", None) != "sdpa"
        or not hasattr(model, "set_attn_implementation")
    ):
        return
    AttentionInterface.register(_CASCADE, _cascade_attention)
    AttentionMaskInterface.register(_CASCADE, sdpa_mask)
    model.set_attn_implementation(_CASCADE)


def cascade_plan(
    model: Any, shared: SharedPrefix | None, mask: torch.Tensor, device: torch.device
) -> _CascadePlan | None:
    """The plan of a decode step whose rows (``mask``: ``[B, W]``, 1 = a real token, rows
    left-padded) all start with ``shared``, or None when the step reads every row whole (no
    shared prefix, one shorter than ``_CASCADE_MIN_TOKENS``, or a model without the hook)."""
    if shared is None or shared.length < _CASCADE_MIN_TOKENS or not _cascading(model):
        return None
    n, width = shared.length, mask.shape[1]
    # row r's tokens start at column pad_r; its own (unshared) ones at pad_r + n
    pad = width - mask.sum(1, keepdim=True)
    cols = torch.arange(n, width).unsqueeze(0)
    bias = torch.zeros(cols.shape[1]).expand(len(pad), -1)
    bias = bias.masked_fill(cols < pad + n, float("-inf"))
    return _CascadePlan(n, [(k[:, :, :n], v[:, :, :n]) for k, v in shared.kv], bias.to(device))


@contextlib.contextmanager
def cascade(plan: _CascadePlan | None) -> Iterator[None]:
    """Forward passes in this thread use ``plan`` (None: plain attention) until the end."""
    _PLAN.value = plan
    try:
        yield
    finally:
        _PLAN.value = None


def _cascade_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Decode-step attention in two parts, merged exactly.

    With the shared prefix ``K_s, V_s`` (``n`` tokens, the same for every row) and a row's
    own tokens ``K_r, V_r`` (the batch cache's columns from ``n`` on, masked to the row's
    tokens after its copy of the prefix), each query ``q`` (scaled scores ``s = q K^T *
    scaling``) gets::

        m_i = max(s_i),  z_i = sum exp(s_i - m_i),  o_i = exp(s_i - m_i) V_i   (i = s, r)
        out = (o_s e^(m_s - m) + o_r e^(m_r - m)) / (z_s e^(m_s - m) + z_r e^(m_r - m)),
        m = max(m_s, m_r)

    which is ``softmax([s_s, s_r]) [V_s; V_r]``, the attention over the whole row. The
    shared part is one matmul for all rows (the prefix is read once, not once per row: on a
    CPU the per-row reads of the keys and values bound a decode step). Grouped-query heads
    share their key-value head. Anything else (no plan: prefill, a model used elsewhere;
    sliding windows, soft-capping, attention sinks, position biases) is transformers' ``sdpa``
    attention.
    """
    from transformers.integrations.sdpa_attention import (  # noqa: PLC0415  loaded with a model
        sdpa_attention_forward,
    )

    plan: _CascadePlan | None = getattr(_PLAN, "value", None)
    layer = getattr(module, "layer_idx", None)
    if (
        plan is None
        or layer is None
        or query.shape[2] != 1
        or any(
            kwargs.get(k) is not None
            for k in ("sliding_window", "softcap", "s_aux", "position_bias")
        )
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    per = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.float().view(rows, kv_heads, per, dim)  # head h reads key-value head h // per
    ks, vs = plan.kv[layer]
    # shared: [kv_heads, rows * per, n]
    qs = q.transpose(0, 1).reshape(kv_heads, rows * per, dim)
    s_s = torch.matmul(qs, ks[0].float().transpose(-1, -2)) * scale
    m_s = s_s.amax(-1, keepdim=True)
    e_s = torch.exp(s_s - m_s)
    z_s, o_s = e_s.sum(-1, keepdim=True), torch.matmul(e_s, vs[0].float())

    def rowwise(x: torch.Tensor) -> torch.Tensor:  # [kv_heads, rows * per, d] -> [rows, ...]
        return x.view(kv_heads, rows, per, x.shape[-1]).transpose(0, 1)

    m_s, z_s, o_s = rowwise(m_s), rowwise(z_s), rowwise(o_s)
    # own tokens: [rows, kv_heads, per, W - n]
    kr, vr = key[:, :, plan.n :].float(), value[:, :, plan.n :].float()
    s_r = torch.matmul(q, kr.transpose(-1, -2)) * scale + plan.bias[:, None, None, :]
    m_r = s_r.amax(-1, keepdim=True)  # finite: every row has its current token
    e_r = torch.exp(s_r - m_r)
    z_r, o_r = e_r.sum(-1, keepdim=True), torch.matmul(e_r, vr)
    m = torch.maximum(m_s, m_r)
    a_s, a_r = torch.exp(m_s - m), torch.exp(m_r - m)
    out = (o_s * a_s + o_r * a_r) / (z_s * a_s + z_r * a_r)  # [rows, kv_heads, per, dim]
    out = out.reshape(rows, heads, 1, dim).transpose(1, 2).to(query.dtype)
    return out.contiguous(), None


def _sliced_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = self.weight, self.bias
    return torch.cat(
        [
            torch.nn.functional.linear(
                x, w[s : s + _LOGIT_SLICE], None if b is None else b[s : s + _LOGIT_SLICE]
            )
            for s in range(0, w.shape[0], _LOGIT_SLICE)
        ],
        -1,
    )


def slice_output_projection(model: Any) -> None:
    """On CPU, compute the vocabulary projection in slices of ``_LOGIT_SLICE`` rows.

    ``logits[:, j] = x @ W[j]`` for every slice: the same dot products, in matmuls whose
    results stay in cache. One ``[32, 576] x [576, 49152]`` matmul of the default model takes
    ~51 ms on a 2-core AVX2 CPU and ~31 ms in slices (``benchmarks/README.md``), a decode step
    ~280 ms. The module keeps its weight (tied or not) and its state dict; only the
    instance's ``forward`` changes, so weight updates load as before.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (
        type(head) is torch.nn.Linear
        and head.weight.device.type == "cpu"
        and head.out_features >= 4 * _LOGIT_SLICE
    ):
        head.forward = types.MethodType(_sliced_linear, head)  # type: ignore[method-assign]
