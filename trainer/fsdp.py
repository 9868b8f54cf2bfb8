"""Data-parallel FSDP2 sharding of the policy and the critic: what both need on every rank.

The step that N ranks compute is the step that one process computes:

* Rank r holds a disjoint part S_r of the step's sequences (whole groups; see
  :mod:`areal_agents.trainer.distributed`). The loss weights w_t are computed over the *whole* batch
  before the split, so the objective is one sum, ``L = sum_r sum_{t in S_r} w_t l_t``, and
  its gradient is the sum of the ranks' gradients, ``grad L = sum_r grad L_r``. FSDP2's
  reduce-scatter therefore sums (gradient divide factor 1, sum-only collectives), where
  data-parallel training usually averages.
* The clipping norm is the norm of that summed gradient, ``||g|| = sqrt(sum_p ||g_p||^2)``
  over all shards of all parameters (``clip_grad_norm_`` on the sharded ``DTensor``
  gradients reduces over the ranks). AdamW is elementwise, so each rank updating its own
  shard gives the unsharded update exactly.
* Every collective must be entered by every rank: a rank with fewer micro-batches than the
  others (its groups are shorter, or it has none) runs zero-loss dummy micro-batches of two
  tokens until all ranks have run ``max_r n_r`` (:func:`max_over_ranks`).
* Per-step statistics are token-weighted sums on each rank; :func:`sum_over_ranks` adds them.

Each decoder layer (the model's ``_no_split_modules``) and the root get ``fully_shard``. On
CUDA with a bfloat16 ``model.dtype`` the sharded parameters are kept in float32 and
computed in bfloat16, with gradients reduced in float32 (``MixedPrecisionPolicy``); on the
CPU they stay in the configured dtype. ``cpu_offload`` keeps parameters, gradients and the
optimizer state in host memory (``CPUOffloadPolicy``).

Checkpoints (:func:`save_state` / :func:`load_state`) use ``torch.distributed.checkpoint``
with the parameters' own names, so a checkpoint written by N ranks loads on M ranks, and on
one unsharded process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

_CPU_GROUP: Any = None
"""A gloo group over all ranks for Python objects and small counters (commands, stats):
without a timeout that matters, since ranks wait on it while rank 0 collects episodes."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def init_process_group(timeout_s: float) -> None:
    """Join the process group the launcher described (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA (each rank on GPU ``LOCAL_RANK``), else
    gloo; plus the CPU group for objects."""
    global _CPU_GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    else:
        dist.init_process_group("gloo", timeout=timeout)
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))


def cpu_group() -> Any:
    return _CPU_GROUP


def destroy_process_group() -> None:
    global _CPU_GROUP
    if initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


# ---------------------------------------------------------------------------- sharding
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class is in a ``_no_split_modules`` of the
    model or of a module inside it (peft wraps the transformers model)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layers (_no_split_modules) for FSDP2 "
            "to shard; train it with train.nproc=1 and train.fsdp=false"
        )
    return layers


def shard(
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` each decoder layer, then the root, in place (see the module
    docstring); ``compute_dtype``: the dtype parameters are gathered in for compute
    (None: their own), with float32 gradient reduction."""
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks, do not average
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite ``tensors`` with rank 0's values (before sharding: randomly initialised
    adapters and heads must start equal on every rank)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


# ---------------------------------------------------------------------------- collectives
def max_over_ranks(n: int) -> int:
    """The largest ``n`` of all ranks."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
    return int(t.item())


def sum_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """Per key, the sum of ``stats`` over the ranks (a key missing on a rank counts 0)."""
    if world_size() == 1:
        return stats
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, stats, group=_CPU_GROUP)
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def full_value(x: Any) -> Any:
    """A ``DTensor`` as the whole tensor (a collective); anything else as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


GATHER_BUCKET_BYTES = 256 << 20
"""The bucket size of :func:`gather_state` (whole tensors gathered before a host copy)."""


def gather_state(
    state: dict[str, torch.Tensor], bucket_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """Whole copies on rank 0's host of ``state``'s (sharded) tensors; {} on other ranks.

    Tensors are gathered a bucket at a time, at most ``bucket_bytes`` of whole tensors (or
    one tensor, if larger), and each bucket is copied to the host and freed before the
    next: no rank ever holds more than one bucket of unsharded tensors on its device."""
    bucket_bytes = GATHER_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    out: dict[str, torch.Tensor] = {}
    me = rank()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        full = [(k, full_value(v.detach())) for k, v in bucket]
        if me == 0:
            for k, v in full:
                out[k] = v.to("cpu", copy=True)
        bucket.clear()
        size = 0

    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
        bucket.append((k, v))
        size += nbytes
    if bucket:
        flush()
    return out


# ---------------------------------------------------------------------------- checkpoints
class CheckpointMismatch(ValueError):
    """A checkpoint's tensors are not the model's (another model, or LoRA against full)."""


def _options(trainable_only: bool) -> Any:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    trainable_only: bool,
) -> None:
    """The model's tensors (only the trained ones with ``trainable_only``: LoRA adapters)
    and the optimizer state as a DCP checkpoint in ``directory`` (every rank writes its
    shards). An optimizer that has not stepped yet is left out rather than initialised
    (initialising it would count a step in AdamW's bias correction)."""
    opts = _options(trainable_only)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=opts)}
    if optimizer.state:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=opts)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(directory))


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    trainable_only: bool,
) -> None:
    """Load :func:`save_state`'s checkpoint into ``model`` and ``optimizer``, whatever the
    number of ranks that wrote it. A checkpoint without optimizer state leaves the
    optimizer fresh."""
    opts = _options(trainable_only)
    with _single_process_quiet():
        saved = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
        has_optim = any(k.startswith("optim.") for k in saved)
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=opts)}
        want = {f"model.{k}" for k in state["model"]}
        have = {k for k in saved if k.startswith("model.")}
        if want != have:
            missing = sorted(k[6:] for k in want - have)
            extra = sorted(k[6:] for k in have - want)
            raise CheckpointMismatch(f"missing {missing[:3]}, unexpected {extra[:3]}")
        if has_optim:
            optimizer.state.clear()
            state["optim"] = get_optimizer_state_dict(model, optimizer, options=opts)
        dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"], options=opts)
    if has_optim:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)
    else:
        optimizer.state.clear()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group; here that is intended (one rank)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
