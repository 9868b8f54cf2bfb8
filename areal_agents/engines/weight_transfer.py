"""Weights over ``torch.distributed`` between a trainer and inference servers.

SGLang's ``/init_weights_update_group`` makes each of the server's GPU workers join a
process group of its own with the trainer: the trainer is rank 0 and hosts the rendezvous
(a TCP store at ``master_address:master_port``), worker ``k`` is rank ``rank_offset + k``.
``/update_weights_from_distributed`` then lists the tensors (names, dtypes, shapes) and
every rank receives them, in that order, from rank 0's broadcasts. The tensors go GPU to
GPU over NCCL, never through files or host memory.

:func:`init_group` builds such a group on either side, the way SGLang's workers build
theirs (a ``tcp://`` rendezvous, then ``torch.distributed``'s group constructor under the
group's own name, outside the default process group, so a trainer rank that is also an
FSDP rank keeps both); :func:`send` / :func:`receive` move the tensors. On a CPU the
backend is gloo (the fake SGLang server joins that way in the tests).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 300.0,
) -> Any:
    """Join (rank 0: host) the weight group ``group_name`` of ``world_size`` ranks; blocks
    until every rank has joined or ``timeout_s`` passes."""
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(rendezvous(url, rank, world_size, timeout=timeout))
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=GroupName(group_name),
        timeout=timeout,
    )
    # ranks of this group are its own (not the default group's): rank r is r
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def send(group: Any, tensors: Sequence[torch.Tensor], device: str | None = None) -> None:
    """Broadcast ``tensors`` from rank 0 of ``group``, in order; each is moved to ``device``
    first when given (NCCL sends from a GPU), one tensor at a time."""
    for t in tensors:
        dist.broadcast(t.to(device).contiguous() if device else t.contiguous(), src=0, group=group)


def receive(
    group: Any, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu"
) -> list[torch.Tensor]:
    """The tensors rank 0 of ``group`` broadcasts, given their dtypes (``"bfloat16"``) and
    shapes."""
    out = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        t = torch.empty(list(shape), dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src=0, group=group)
        out.append(t)
    return out


def destroy(group: Any) -> None:
    if group is not None:
        dist.destroy_process_group(group)


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes: equal digests, equal tensors."""
    c = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{c.dtype}{tuple(c.shape)}".encode())
    h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    """``torch.float32`` -> ``"float32"`` (SGLang's dtype names)."""
    return str(t.dtype).removeprefix("torch.")
