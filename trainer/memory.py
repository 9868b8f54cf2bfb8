"""Per-rank memory of one training step, from the model's config alone (``train --dry-run``).

The estimate counts the tensors a step keeps alive at its peak, for the trainer as it is:
a transformers decoder-only causal LM (Llama, Qwen2, Qwen3 and the like), trained with
AdamW on one packed row of ``micro_batch_tokens`` tokens per micro-batch, optionally with
LoRA (peft), activation checkpointing, FSDP2 sharding and CPU offload. Notation:

* ``P`` parameters (``h`` hidden, ``i`` intermediate, ``L`` layers, ``V`` vocabulary,
  ``q = heads * head_dim``, ``kv = kv_heads * head_dim``); ``N`` tokens of the micro-batch.
* ``s`` bytes of a stored parameter, ``c`` bytes of the compute dtype: both the configured
  dtype, except FSDP2 on CUDA with a 16-bit dtype, where ``areal_agents.trainer.fsdp`` keeps float32
  master weights (``s = 4``) and computes in the 16-bit dtype (``c = 2``). LoRA adapters
  are float32 (peft casts them), their gradients and moments too.
* ``n`` ranks; sharded, every resident tensor below is divided by ``n``.

Resident memory (the ``parameters``, ``gradients`` and ``optimizer`` of the policy)::

    parameters = s * P / n                        (+ the gathered working set, sharded)
    gradients  = s * P_train / n                  (+ the gathered working set, sharded)
    optimizer  = 2 * s * P_train / n              (AdamW's exp_avg and exp_avg_sq)

with ``P_train = P`` for full fine-tuning and ``P_train = sum r * (in + out)`` over the
adapted linear modules with LoRA (base weights frozen: no gradient, no moments). Torch's
AdamW keeps its moments in the parameter's dtype: float32 for the sharded CUDA master
weights and for adapters, the configured dtype for an unsharded full fine-tune.

Sharded (FSDP2, ``areal_agents.trainer.fsdp``): the root module (embeddings, final norm, an untied
``lm_head``) stays all-gathered from its forward to the end of the backward, and decoder
layers are all-gathered one at a time with the next one prefetched, so each rank also
holds ``c * (P_root + 2 * P_layer)`` of unsharded parameters and ``c * (P_root_train +
P_layer_train)`` of unsharded gradients before their reduce-scatter.

Activations, in bytes per token of one micro-batch, as autograd saves them (transformers'
RMSNorm upcasts its input to float32; ``sdpa`` with a packed row repeats the key/value
heads and turns the block-diagonal mask into an additive ``N x N`` mask per layer)::

    norm(d)   = 4d + 4 + 2c*d                    input in float32, 1/rms, normalized, output
    qk_norm   = (4q + 4 heads + c*q) + (4kv + 4 kv_heads + c*kv)      (Qwen3 only)
    attention = 4c*q + 4 heads + c*N             q, k, v (repeated), output, lse, mask
    layer     = 2 norm(h) + qk_norm + attention + 4c*i
    logits    = V * (c + 16)                     logits, and four float32 N x V buffers

The last line is the trainer's loss over the vocabulary (``token_logprobs`` and the
entropies): the logits in the compute dtype, their float32 scaling kept for the backward,
the ``logsumexp``/entropy (forward) or gradient (backward) working set of three more float
N x V tensors. With LoRA the frozen norms keep only ``4d + 4 * units``, the frozen linears
keep no input, and each adapter keeps its float32 input (shared between adapters of one
input when ``c = 4``) and its rank-``r`` projection ``4r``; the MLP keeps ``3c*i``.
Without checkpointing everything is alive when the backward starts::

    backward  = N * (L * layer + norm(h) + 2c*head_dim + N + logits)

With activation checkpointing (non-reentrant) each layer keeps only its input and is
recomputed in the backward, after the loss over the vocabulary is done, while the
logits are still referenced::

    backward  = N * (L * c*h + 2c*head_dim + N) + N * max(norm(h) + logits, c*V + layer)

A full fine-tune ends its backward with the embeddings' gradient: a dense ``V x h``
tensor, and, with tied embeddings, lm_head's gradient and their sum too, while the logits
are still referenced (at few tokens per micro-batch this is the peak)::

    activations = max(backward, N*c*V + (3 if tied else 1) * c*V*h)

The optimizer step runs after the activations are freed, but while ``Policy.train_step``
still references the last micro-batch's logits; torch's AdamW makes one moment-sized
buffer on CUDA (foreach) and two of its largest tensor's size on the CPU::

    optimizer_step = N*c*V + (s_train * P_train / n  or  2 * s_train * P_largest / n)

Total per rank, an upper bound of the step's peak (a step accumulates gradients over its
micro-batches, so from the second one on the gradients are alive with the activations)::

    total = parameters + gradients + optimizer + reference + critic
            + max(activations, optimizer_step)

``reference``: a frozen full copy ``s * P / n`` when a KL penalty needs one (full
fine-tunes; with LoRA the base without the adapter is the reference). ``critic`` (PPO):
the backbone without ``lm_head`` plus a float32 scalar head (``h + 1``), its own
gradients and AdamW moments, trained like the policy (LoRA: adapters and head). The
critic's forward and backward do not overlap the policy's: activations are the larger of
the two (the critic has no vocabulary term). ``device_total`` with ``cpu_offload``: the
sharded parameters, gradients and moments (and the reference's and critic's) live in host
memory, and the device keeps the gathered working set and the activations.

The mask term is that of a flat packed row (``Policy``'s layout when sequences share no
prefix): the tree layout of shared prefixes passes one additive mask to every layer
(``(L - 1) * c * N^2`` less), and flash-attention kernels take none.

Left out: the CUDA context, communication buffers, allocator fragmentation and caching
(leave 10-20 % of headroom), LoRA dropout masks (the trainer's default dropout is 0),
mixture-of-experts models, the memory of the inference engine and of forward-only passes
(smaller than a training micro-batch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from areal_agents import model as models

__all__ = ["MemoryEstimate", "estimate_for_config", "estimate_memory"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one element of each weight dtype the trainer supports."""

LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The modules peft's ``"all-linear"`` adapts in a decoder (every linear but ``lm_head``)."""

_QKV = frozenset({"q_proj", "k_proj", "v_proj"})
_GATE_UP = frozenset({"gate_proj", "up_proj"})


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of one training step (see the module docstring for the formulas)."""

    parameters: int
    """The policy's parameters (its shard, plus the gathered working set when sharded)."""
    gradients: int
    """Gradients of the trained parameters (shard plus unsharded working set)."""
    optimizer: int
    """AdamW's two moments of the trained parameters."""
    activations: int
    """Peak activation memory of one micro-batch's forward and backward."""
    reference: int
    """The frozen reference copy of a KL penalty (0 without one, and with LoRA)."""
    critic: int
    """The PPO critic's parameters, gradients and moments (0 without a critic)."""
    total: int
    """The step's peak, an upper bound: the resident state above plus the larger of
    ``activations`` and ``optimizer_step``."""
    device_total: int
    """What stays on the device: ``total`` less what ``cpu_offload`` keeps in host memory."""
    logits: int = 0
    """The loss over the vocabulary of one micro-batch (the logits and four float32
    ``N x V`` buffers), part of the backward's peak."""
    optimizer_step: int = 0
    """Transient bytes of the optimizer step (its temporaries, the last logits); ``total``
    counts the larger of this and ``activations``."""
    num_params: int = 0
    """Parameters of the policy model (adapters included)."""
    trainable_params: int = 0
    """Parameters the policy's optimizer updates (the adapters with LoRA)."""
    nproc: int = 1
    sharded: bool = False
    cpu_offload: bool = False
    micro_batch_tokens: int = 0

    @property
    def host(self) -> int:
        """Bytes in host memory with ``cpu_offload`` (0 without)."""
        return self.total - self.device_total

    def format(self) -> str:
        """A few readable lines, e.g. ``per rank: params 1.2 GiB, grads 1.2 GiB, ...``."""
        layout = f"{self.nproc} rank{'s' if self.nproc != 1 else ''}"
        layout += ", FSDP2-sharded" if self.sharded else ", not sharded"
        lines = [
            f"model: {_count(self.num_params)} parameters, {_count(self.trainable_params)} "
            f"trained; micro-batch {self.micro_batch_tokens} tokens; {layout}"
        ]
        parts = [
            f"params {_size(self.parameters)}",
            f"grads {_size(self.gradients)}",
            f"optimizer {_size(self.optimizer)}",
            f"activations {_size(self.activations)} (logits {_size(self.logits)})",
        ]
        if self.optimizer_step > self.activations:
            parts.append(f"optimizer step {_size(self.optimizer_step)}")
        if self.reference:
            parts.append(f"reference {_size(self.reference)}")
        if self.critic:
            parts.append(f"critic {_size(self.critic)}")
        lines.append(f"per rank: {', '.join(parts)}, total {_size(self.total)}")
        if self.cpu_offload:
            lines.append(
                f"with cpu_offload: {_size(self.device_total)} on the device, "
                f"{_size(self.host)} in host memory"
            )
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB (from 1 GiB) or MiB, one decimal."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def _count(n: int) -> str:
    """A parameter count as ``7.6B``, ``123.4M`` or ``589.8K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class _Shapes:
    """What a Llama-style decoder's memory depends on, read from its config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """``(name, in, out, bias)`` of one decoder layer's linear modules."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        return [
            ("q_proj", h, q, self.qkv_bias),
            ("k_proj", h, kv, self.qkv_bias),
            ("v_proj", h, kv, self.qkv_bias),
            ("o_proj", q, h, self.o_bias),
            ("gate_proj", h, i, self.mlp_bias),
            ("up_proj", h, i, self.mlp_bias),
            ("down_proj", i, h, self.mlp_bias),
        ]

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linears (with biases) and RMSNorm weights."""
        n = sum(a * b + (b if bias else 0) for _, a, b, bias in self.linears())
        return n + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, untied lm_head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def _shapes(config: Any) -> _Shapes:
    """The shapes of ``config`` (a transformers ``PretrainedConfig`` of a causal LM)."""
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        raise ValueError(
            f"{type(config).__name__} is a mixture-of-experts model; the memory estimate "
            "covers dense decoders (Llama, Qwen2, Qwen3) only"
        )
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    model_type = str(getattr(config, "model_type", ""))
    attention_bias = bool(getattr(config, "attention_bias", False))
    return _Shapes(
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab=int(config.vocab_size),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2: q, k, v always biased
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )


# ---------------------------------------------------------------------------- LoRA
@dataclass(frozen=True)
class _Lora:
    """Which modules get adapters: per decoder layer, and the embeddings / lm_head."""

    r: int
    per_layer: tuple[frozenset[str], ...]
    embed: bool
    lm_head: bool

    def layer_params(self, shapes: _Shapes, layer: int) -> int:
        """Adapter parameters ``r * (in + out)`` of decoder layer ``layer``."""
        chosen = self.per_layer[layer]
        return sum(self.r * (a + b) for name, a, b, _ in shapes.linears() if name in chosen)

    def root_params(self, shapes: _Shapes, *, lm_head: bool = True) -> int:
        """Adapter parameters on the embeddings and (if ``lm_head``) the lm_head:
        ``r * (V + h)`` each."""
        return self.r * (shapes.vocab + shapes.hidden) * (self.embed + (lm_head and self.lm_head))

    def params(self, shapes: _Shapes, *, lm_head: bool = True) -> int:
        """All adapter parameters (those on the lm_head only if ``lm_head``)."""
        layers = sum(self.layer_params(shapes, k) for k in range(shapes.layers))
        return self.root_params(shapes, lm_head=lm_head) + layers


def _lora(lora: dict[str, Any] | None, shapes: _Shapes) -> _Lora | None:
    """The adapted modules of peft's ``LoraConfig(**lora)`` on a model of ``shapes``:
    ``target_modules`` as names matched at the end of a module's dotted path (``q_proj``,
    ``self_attn.q_proj``), ``"all-linear"`` (every linear but ``lm_head``), or one regular
    expression a whole path must match, as peft does."""
    if not lora:
        return None
    r = int(lora.get("r", 8))
    targets = lora.get("target_modules")
    if r < 1 or targets is None:
        raise ValueError(f"lora needs r >= 1 and target_modules, got r={r}, {targets!r}")
    layer_paths = [
        {n: f"model.layers.{k}.{_block(n)}.{n}" for n in LORA_ALL_LINEAR}
        for k in range(shapes.layers)
    ]
    paths = [p for layer in layer_paths for p in layer.values()]
    paths += ["model.embed_tokens", "lm_head"]
    if targets == "all-linear":
        chosen = {p for p in paths if p.rsplit(".", 1)[-1] in LORA_ALL_LINEAR}
    elif isinstance(targets, str):  # peft: one string is a pattern over the whole path
        chosen = {p for p in paths if re.fullmatch(targets, p)}
    else:
        names = [str(t) for t in targets]
        chosen = {p for p in paths if any(p == t or p.endswith("." + t) for t in names)}
    if not chosen:
        raise ValueError(
            f"lora target_modules {targets!r} match no module of this model; use names "
            f"among {', '.join(LORA_ALL_LINEAR)}, embed_tokens, lm_head, or 'all-linear'"
        )
    per_layer = tuple(
        frozenset(n for n, p in layer.items() if p in chosen) for layer in layer_paths
    )
    return _Lora(r, per_layer, "model.embed_tokens" in chosen, "lm_head" in chosen)


def _largest(shapes: _Shapes, lora: _Lora | None) -> int:
    """Elements of the largest trained tensor: the embeddings, or an adapter's matrix."""
    if lora is None:
        return max(shapes.vocab * shapes.hidden, *(a * b for _, a, b, _ in shapes.linears()))
    dims = [
        max(a, b)
        for k in range(shapes.layers)
        for n, a, b, _ in shapes.linears()
        if n in lora.per_layer[k]
    ]
    if lora.embed or lora.lm_head:
        dims.append(shapes.vocab)
    return lora.r * max(dims, default=0)


def _block(name: str) -> str:
    return "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


# ---------------------------------------------------------------------------- activations
def _norm(d: int, units: int, c: int, trained: bool, output_saved: bool = True) -> int:
    """Bytes per token an RMSNorm over ``d`` (``units`` rows of it) keeps for the backward:
    its input in float32 and 1/rms; trained, also the normalized input (for the weight's
    gradient) and the output the next linear reads (``output_saved``)."""
    n = 4 * d + 4 * units
    if trained:
        n += c * d * (2 if output_saved else 1)
    return n


def _layer_bytes(s: _Shapes, tokens: int, c: int, adapted: frozenset[str] | None, r: int) -> int:
    """Bytes per token one decoder layer keeps for the backward; ``adapted`` is None for a
    full fine-tune, else the names of its modules that carry LoRA adapters (rank ``r``)."""
    full = adapted is None
    h, i, q, kv = s.hidden, s.intermediate, s.q, s.kv
    n = 2 * _norm(h, 1, c, full)
    if s.qk_norm:  # the rotary embedding keeps only cos and sin, not the normed q and k
        n += _norm(q, s.heads, c, full, False) + _norm(kv, s.kv_heads, c, full, False)
    n += 4 * c * q + 4 * s.heads  # sdpa: q, repeated k and v, output; float32 logsumexp
    n += c * tokens  # sdpa's additive mask, made from the boolean one in each layer
    n += (4 if full else 3) * c * i  # gate, up, silu(gate), silu * up (down_proj's input)
    if adapted:
        n += 4 * r * len(adapted)  # lora_A's output, read by lora_B
        inputs = {name: a for name, a, _, _ in s.linears() if name in adapted}
        if c == 4:  # the inputs themselves, one per distinct input; o_proj's is sdpa's output
            n += 4 * h * (bool(adapted & _QKV) + bool(adapted & _GATE_UP))
            n += 4 * i * ("down_proj" in adapted)
        else:  # every adapter keeps its own float32 copy of its input
            n += sum(4 * a for a in inputs.values())
    return n


def _activations(
    s: _Shapes,
    tokens: int,
    c: int,
    lora: _Lora | None,
    checkpointing: bool,
    *,
    head: str,
) -> tuple[int, int]:
    """(peak activation bytes of one micro-batch, the part over the vocabulary) of the
    policy (``head="lm"``) or of the critic's backbone and scalar head (``"value"``): the
    larger of the backward's start (or, checkpointed, a layer's recomputation) and its end,
    the embeddings' gradient (see the module docstring)."""
    r = lora.r if lora else 0
    layers = [
        _layer_bytes(s, tokens, c, None if lora is None else lora.per_layer[k], r)
        for k in range(s.layers)
    ]
    shared = 2 * c * s.head_dim + tokens  # rotary cos and sin, the boolean packed mask
    final = _norm(s.hidden, 1, c, lora is None)
    if head == "lm":
        if lora is not None and lora.lm_head:
            final += 4 * s.hidden + 4 * r
        vocab = s.vocab * (c + 16)
        kept = s.vocab * c  # the logits, referenced until the step is over
    else:
        final += 4 * s.hidden  # the value head reads the final hidden state in float32
        vocab = kept = 0
    if checkpointing:
        per_token = s.layers * c * s.hidden + shared
        per_token += max(final + vocab, kept + max(layers, default=0))
    else:
        per_token = sum(layers) + shared + final + vocab
    peak = tokens * per_token
    if lora is None:  # the embeddings' gradient: dense, and added to lm_head's when tied
        tied = s.tied and head == "lm"
        peak = max(peak, tokens * kept + (3 if tied else 1) * c * s.vocab * s.hidden)
    return peak, tokens * vocab


# ---------------------------------------------------------------------------- the estimate
def estimate_memory(
    model_config: Any,
    *,
    lora: dict[str, Any] | None,
    param_dtype: str,
    micro_batch_tokens: int,
    nproc: int = 1,
    sharded: bool = False,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reference: bool = False,
    critic: bool = False,
    device: str = "cuda",
    critic_config: Any = None,
) -> MemoryEstimate:
    """Bytes per rank of one training step of a decoder-only causal LM.

    ``model_config``: the model's transformers ``PretrainedConfig`` (``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (default ``hidden_size / num_attention_heads``),
    ``vocab_size``, ``tie_word_embeddings``). ``lora``: peft ``LoraConfig`` keywords (``r``,
    ``target_modules``) or None for a full fine-tune. ``param_dtype``: the weight dtype
    the trainer loads (``float32``, ``bfloat16``, ``float16``). ``micro_batch_tokens``:
    tokens of one packed micro-batch, all of whose logits are computed. ``nproc`` ranks,
    ``sharded`` by FSDP2 (else every rank holds everything), ``cpu_offload`` of the sharded
    state to host memory. ``reference``: a KL penalty's reference model; ``critic``: PPO's
    value model (its backbone from ``critic_config``, default ``model_config``).
    ``device``: where the trainer runs; FSDP2 on CUDA keeps float32 master weights of a
    16-bit ``param_dtype``.

    With ``P`` parameters, ``P_train`` trained ones, stored in ``s`` bytes, over ``n``
    ranks (``n = 1`` unsharded), the resident state is::

        parameters = s * P / n,  gradients = s * P_train / n,  optimizer = 2 * s * P_train / n

    plus, sharded, the all-gathered root module and layers; LoRA's
    ``P_train = sum r * (in + out)`` over the adapted linears, stored in float32. The
    activation formulas, the total and what ``cpu_offload`` moves are in the module
    docstring.
    """
    if param_dtype not in DTYPE_BYTES:
        raise ValueError(
            f"param_dtype must be one of {', '.join(DTYPE_BYTES)}, got {param_dtype!r}"
        )
    if micro_batch_tokens < 1 or nproc < 1:
        raise ValueError("micro_batch_tokens and nproc must be >= 1")
    if cpu_offload and not sharded:
        raise ValueError("cpu_offload needs sharded=True (FSDP2 offloads the sharded state)")
    shapes = _shapes(model_config)
    adapters = _lora(lora, shapes)
    c = DTYPE_BYTES[param_dtype]
    mixed = sharded and device.startswith("cuda") and c < 4
    s = 4 if mixed else c  # bytes of a stored (sharded) parameter
    ranks = nproc if sharded else 1

    def shard(nbytes: int) -> int:
        return math.ceil(nbytes / ranks)

    base = shapes.root_params() + shapes.layers * shapes.layer_params()
    if adapters is None:  # everything trained, gradients and moments as the stored weights
        trained, trained_bytes, frozen = base, s, 0
        layer_trained, root_trained = shapes.layer_params(), shapes.root_params()
    else:  # float32 adapters on a frozen base
        trained, trained_bytes, frozen = adapters.params(shapes), 4, base
        layer_trained = max(adapters.layer_params(shapes, k) for k in range(shapes.layers))
        root_trained = adapters.root_params(shapes)
    num_params = frozen + trained

    params = shard(s * frozen + trained_bytes * trained)
    grads = shard(trained_bytes * trained)
    optim = shard(2 * trained_bytes * trained)
    gathered_params = gathered_grads = 0
    if sharded:  # the root stays gathered through the step; two layers at a time
        layer_all = shapes.layer_params() + (layer_trained if adapters else 0)
        root_all = shapes.root_params() + (root_trained if adapters else 0)
        gathered_params = c * (root_all + 2 * layer_all)
        gathered_grads = c * (root_trained + layer_trained)
    params += gathered_params
    grads += gathered_grads

    activations, logits = _activations(
        shapes, micro_batch_tokens, c, adapters, activation_checkpointing, head="lm"
    )
    ref = shard(s * base) if reference and adapters is None else 0

    critic_bytes = 0
    if critic:
        cs = _shapes(critic_config) if critic_config is not None else shapes
        c_lora = _lora(lora, cs)
        backbone = cs.root_params() - (0 if cs.tied else cs.vocab * cs.hidden)
        backbone += cs.layers * cs.layer_params()
        head = cs.hidden + 1  # float32
        if c_lora is None:  # parameters, gradients and two moments of the same size
            critic_bytes = 4 * shard(s * backbone + 4 * head)
        else:  # a frozen backbone; float32 adapters and head, their gradients and moments
            critic_bytes = shard(s * backbone) + 4 * shard(
                4 * (c_lora.params(cs, lm_head=False) + head)
            )
        c_act, _ = _activations(
            cs, micro_batch_tokens, c, c_lora, activation_checkpointing, head="value"
        )
        activations = max(activations, c_act)

    # AdamW's step: foreach (CUDA) makes one moment-sized buffer, the per-tensor loop (CPU)
    # two of the largest tensor's size; the last micro-batch's logits are still referenced
    if device.startswith("cuda"):
        step_temp = shard(trained_bytes * trained)
    else:
        step_temp = 2 * shard(trained_bytes * _largest(shapes, adapters))
    step = step_temp + micro_batch_tokens * shapes.vocab * c
    resident = params + grads + optim + ref + critic_bytes
    total = resident + max(activations, step)
    device_total = total
    if cpu_offload:
        device_total = gathered_params + gathered_grads + activations
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer=optim,
        activations=activations,
        reference=ref,
        critic=critic_bytes,
        total=total,
        device_total=device_total,
        logits=logits,
        optimizer_step=step,
        num_params=num_params,
        trainable_params=trained,
        nproc=nproc,
        sharded=sharded,
        cpu_offload=cpu_offload,
        micro_batch_tokens=micro_batch_tokens,
    )


def estimate_for_config(cfg: Any) -> MemoryEstimate:
    """:func:`estimate_memory` for a ``TrainConfig``: the model's ``config.json`` only (never
    its weights), the dtype the trainer would load (``model.dtype`` resolved as in
    ``areal_agents.trainer.loop``), LoRA, activation checkpointing, ``train.micro_batch_tokens``,
    ``train.nproc`` / ``sharded`` / ``cpu_offload``, a reference model when the KL weight
    (``loss.kl_coef``, else the algorithm's) is > 0 for a full fine-tune, and the critic of
    a critic algorithm (``critic.path``'s config, else the policy's)."""
    from areal_agents.hardware import default_device, resolve_dtype  # noqa: PLC0415  it imports torch; the estimate stays light

    device = default_device(cfg.model.device)
    lora_cfg = cfg.model.lora
    dtype = resolve_dtype(cfg.model.dtype, device, low_precision_ok=lora_cfg.enabled)
    lora = None
    if lora_cfg.enabled:
        lora = {"r": lora_cfg.r, "target_modules": list(lora_cfg.target_modules)}
    spec = cfg.algorithm_spec()
    kl, has_critic = spec.loss.kl_coef, spec.needs_critic
    critic_config = None
    if has_critic and cfg.critic.path is not None:
        critic_config = load_model_config(cfg.critic.path)
    return estimate_memory(
        load_model_config(cfg.model.path),
        lora=lora,
        param_dtype=dtype,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        nproc=cfg.train.nproc,
        sharded=cfg.train.sharded,
        activation_checkpointing=cfg.model.activation_checkpointing,
        cpu_offload=cfg.train.cpu_offload,
        reference=kl > 0,
        critic=has_critic,
        device=device,
        critic_config=critic_config,
    )


def load_model_config(path: str | None) -> Any:
    """The transformers config of the model at ``path`` (a directory or hub id, as
    ``areal_agents.model.resolve_model`` takes it), reading no weights. The default model
    (None) is read from its converted directory when it exists, else from the GGUF file's
    metadata, so a dry run never converts it."""
    from transformers import AutoConfig  # noqa: PLC0415  transformers loads only for an estimate

    if path is None or path in (models.DEFAULT_MODEL, "default"):
        target = models.cache_dir() / "models" / models.DEFAULT_MODEL
        if (target / "config.json").exists():
            return AutoConfig.from_pretrained(str(target))
        gguf = models._gguf_path()
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoConfig.from_pretrained(models.resolve_model(path, quiet=True))
