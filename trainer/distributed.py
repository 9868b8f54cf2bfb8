"""Trainer ranks: ``train.nproc`` FSDP2 processes that train one policy (and critic).

How a run is laid out:

* :func:`launch` (:func:`run_ranks`) starts the ranks the way ``torchrun`` does, through
  ``torch.distributed``'s elastic agent (``elastic_launch``: c10d rendezvous on this
  machine, no restarts), each rank ``python -m areal_agents.trainer.rank CONFIG``
  (:mod:`areal_agents.trainer.rank`). It waits for them and turns a failed rank into
  :class:`RankFailed`, naming the rank and its error.
* Rank 0 runs the whole :class:`~areal_agents.trainer.loop.Trainer`: the engine, the proxy,
  the group source, the metrics and the checkpoints' run state. Its policy and critic are
  :class:`DistributedPolicy` / :class:`DistributedCritic`: the same methods as
  ``Policy`` / ``Critic``, each sent to every rank as a command with that rank's part of
  the data (:class:`Ranks`). The other ranks only :func:`serve` commands: they never touch
  the proxy or an engine.
* A training step's sequences are split by whole groups (:func:`group_parts`): contiguous
  runs of groups with about equal tokens per rank. The loss weights and advantages were
  computed over the whole batch before the split (``BatchLoss.select``), and gradients are
  summed over ranks (:mod:`areal_agents.trainer.fsdp`), so the step is the one a single
  process takes. Forward-only passes (proximal and reference logprobs, values) are split
  into contiguous runs of sequences of about equal tokens. A policy step whose loss records
  its tokens (``BatchLoss(record=True)``) returns each rank's records with its result, and
  rank 0 puts them back under the whole batch's sample indices.
* Failures end the run in bounded time: a rank that raises exits, the agent stops the
  others; a rank blocked in a collective gives up after ``train.collective_timeout_s``;
  every rank dies with its launcher (``PR_SET_PDEATHSIG``), so none outlives a
  ``kill -9`` of it.
* Checkpoints: every rank writes its shards (``dcp/``) and its random state
  (``rng-rank{r}.pt``; rank 0's is the checkpoint's ``rng.pt``); they load on any number of
  ranks. A rank without a saved random state (more ranks than wrote it) starts from
  ``train.seed + rank``.

* ``scheduler: ray``: the ranks are Ray actors (:class:`RayRanks`, one GPU each where the
  cluster has GPUs), and the driver, which keeps the loop, the group source, the proxy and
  the worker API, sends them the same commands through Ray. The run's output directory
  must be on a file system every rank's node sees (checkpoints are written by all ranks).

Left out: several machines under one ``torch.distributed`` launch without Ray, tensor and
pipeline parallelism.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from areal_agents.engines.launch import free_port
from areal_agents.engines.protocol import WeightUpdate
from areal_agents.errors import ArealError, ConfigError
from areal_agents.hardware import default_device
from areal_agents.trainer import fsdp
from areal_agents.trainer.config_io import dump_yaml
from areal_agents.trainer.critic import Critic
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.protocols import CriticLoss, PolicyLoss, Temperature

_PARENT_ENV = "AREAL_TRAINER_LAUNCHER_PID"
log = logging.getLogger(__name__)


class RankFailed(ArealError):
    """A trainer rank raised or was killed; the message names it and its error."""


# ---------------------------------------------------------------------------- the split
def group_parts(groups: Sequence[Any], lengths: Sequence[int], n: int) -> list[list[int]]:
    """Sample indices per rank: whole groups, in their order, in ``n`` contiguous runs of
    about equal tokens. Group j, with ``T_<j`` tokens before it and ``T_j`` of its own out
    of ``T``, goes to rank ``floor(n * (T_<j + T_j / 2) / T)`` (its midpoint's share), so
    ranks may differ by up to a group's tokens, and a rank may get no group at all."""
    order = list(dict.fromkeys(groups))
    tokens = dict.fromkeys(order, 0)
    for g, n_tok in zip(groups, lengths, strict=True):
        tokens[g] += n_tok
    total = sum(tokens.values()) or 1
    rank_of, before = {}, 0
    for g in order:
        rank_of[g] = min(n - 1, int(n * (before + tokens[g] / 2) / total))
        before += tokens[g]
    parts: list[list[int]] = [[] for _ in range(n)]
    for i, g in enumerate(groups):
        parts[rank_of[g]].append(i)
    return parts


def _pick(xs: Any, idx: list[int]) -> Any:
    """``xs`` at ``idx`` when it is per sequence (a list or tuple); else as it is."""
    return [xs[i] for i in idx] if isinstance(xs, list | tuple) else xs


# ---------------------------------------------------------------------------- commands
class Ranks:
    """Rank 0's side of the command channel: each call scatters one command (the
    target object, a method and each rank's arguments) and runs rank 0's part itself."""

    def __init__(self, seed: int) -> None:
        """``seed``: ``train.seed`` (a rank without a saved random state starts from
        ``seed + rank``)."""
        self.size, self.seed = fsdp.world_size(), seed
        self.local: dict[str, Any] = {}

    def call(
        self,
        target: str,
        method: str,
        args: Sequence[tuple[Any, ...]] | tuple[Any, ...] = (),
        *,
        per_rank: bool = False,
        gather: bool = False,
    ) -> Any:
        """``target.method(*args)`` on every rank (``per_rank``: ``args[r]`` on rank r);
        returns rank 0's result, or with ``gather`` all ranks' results in rank order."""
        each: list[Any] = list(args) if per_rank else [args] * self.size
        objs: list[Any] = [(target, method, a) for a in each]
        dist.scatter_object_list([None], objs, src=0, group=fsdp.cpu_group())
        result = _run(self.local, target, method, each[0])
        if not gather:
            return result
        out: list[Any] = [None] * self.size
        dist.gather_object(result, out, dst=0, group=fsdp.cpu_group())
        return out

    def build(self, target: str, kind: str, kwargs: dict[str, Any], lock: Any = None) -> Any:
        """Every rank builds ``kind`` (``policy`` | ``critic``) with ``kwargs``; rank 0's
        shares the engine's compute ``lock``."""
        objs: list[Any] = [(target, "__build__", (kind, kwargs))] * self.size
        dist.scatter_object_list([None], objs, src=0, group=fsdp.cpu_group())
        self.local[target] = _build(kind, {**kwargs, "compute_lock": lock})
        return self.local[target]

    def stop(self) -> None:
        objs: list[Any] = [("", "__stop__", ())] * self.size
        dist.scatter_object_list([None], objs, src=0, group=fsdp.cpu_group())


def _build(kind: str, kwargs: dict[str, Any]) -> Any:
    return (Policy if kind == "policy" else Critic)(**kwargs, sharded=True)


def _run(objects: dict[str, Any], target: str, method: str, args: tuple[Any, ...]) -> Any:
    if method == "__rng_save__":
        return _save_rng(*args)
    if method == "__rng_load__":
        return _load_rng(*args)
    if method == "__seed__":  # seed every rank's torch generator with args[0]
        torch.manual_seed(int(args[0]))
        return None
    if method == "__train_recorded__":  # train_step, then its loss's token records
        stats = objects[target].train_step(*args)
        return stats, args[1].records
    return getattr(objects[target], method)(*args)


def serve(seed: int) -> None:
    """A rank other than 0: run rank 0's commands until it says stop."""
    torch.manual_seed(seed + fsdp.rank())
    objects: dict[str, Any] = {}
    while True:
        box: list[Any] = [None]
        dist.scatter_object_list(box, None, src=0, group=fsdp.cpu_group())
        target, method, args = box[0]
        if method == "__stop__":
            return
        if method == "__build__":
            kind, kwargs = args
            objects[target] = _build(kind, kwargs)
            continue
        result = _run(objects, target, method, args)
        if method in _GATHERED:
            dist.gather_object(result, None, dst=0, group=fsdp.cpu_group())


_GATHERED = frozenset({"logprobs", "ref_logprobs", "values", "__train_recorded__"})
"""The methods whose results rank 0 collects (``Ranks.call(..., gather=True)``)."""


def _save_rng(directory: str) -> None:
    """Ranks but 0 write their random state (rank 0's is the checkpoint's ``rng.pt``);
    then all wait until every rank's files are written."""
    if fsdp.rank() > 0:
        torch.save(fsdp.rng_state(), Path(directory) / f"rng-rank{fsdp.rank()}.pt")
    dist.barrier(group=fsdp.cpu_group())


def _load_rng(directory: str, seed: int) -> None:
    r = fsdp.rank()
    if r == 0:
        return  # restore_checkpoint restores rank 0's
    path = Path(directory) / f"rng-rank{r}.pt"
    if path.exists():
        fsdp.set_rng_state(torch.load(path, weights_only=False))
    else:
        torch.manual_seed(seed + r)


class _RankActor:
    """One trainer rank as a Ray actor (``scheduler: ray``; see :class:`RayRanks`)."""

    def __init__(self, rank: int, world: int, seed: int) -> None:
        self.rank, self.world, self.seed = rank, world, seed
        self.objects: dict[str, Any] = {}

    def address(self) -> tuple[str, int]:
        """Where the ranks meet: this actor's node and a free port on it (rank 0 only)."""
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int, timeout_s: float) -> None:
        os.environ.update(
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",  # Ray shows each actor only its own GPU
        )
        fsdp.init_process_group(timeout_s)
        torch.manual_seed(self.seed + self.rank)

    def build(self, target: str, kind: str, kwargs: dict[str, Any]) -> None:
        self.objects[target] = _build(kind, kwargs)

    def run(self, target: str, method: str, args: tuple[Any, ...]) -> Any:
        return _run(self.objects, target, method, args)

    def attribute(self, target: str, name: str) -> Any:
        return getattr(self.objects[target], name)

    def leave(self) -> None:
        self.objects.clear()
        fsdp.destroy_process_group()


class RayRanks:
    """Trainer ranks as Ray actors (``scheduler: ray``), behind :class:`Ranks`'s interface.

    The driver keeps the loop, the group source, the proxy and the worker API; it sends each
    command to every actor through Ray and takes rank 0's answer. The actors form their
    process group by a rendezvous at rank 0's actor (its node's address, a free port). With
    GPUs in the cluster each actor takes one (NCCL); otherwise they take no CPU slot of
    their own (gloo), so that the engine and rollout workers keep theirs."""

    def __init__(self, nproc: int, seed: int, timeout_s: float) -> None:
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        from areal_agents.rollout.cluster import check_room, connect  # noqa: PLC0415  it imports ray, an optional extra

        connect()
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= nproc else 0.0
        each = {"CPU": 1.0 if gpus else 0.0, "GPU": gpus}
        check_room("trainer rank", nproc, each, "train.nproc")
        actor = ray.remote(num_cpus=each["CPU"], num_gpus=gpus, max_restarts=0)(_RankActor)
        self.actors: list[Any] = [actor.remote(r, nproc, seed) for r in range(nproc)]
        self.size, self.seed = nproc, seed
        host, port = ray.get(self.actors[0].address.remote())
        ray.get([a.join.remote(host, port, timeout_s) for a in self.actors])

    def call(
        self,
        target: str,
        method: str,
        args: Sequence[tuple[Any, ...]] | tuple[Any, ...] = (),
        *,
        per_rank: bool = False,
        gather: bool = False,
    ) -> Any:
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        each: list[Any] = list(args) if per_rank else [args] * self.size
        refs = [a.run.remote(target, method, each[r]) for r, a in enumerate(self.actors)]
        results = ray.get(refs)
        return results if gather else results[0]

    def build(self, target: str, kind: str, kwargs: dict[str, Any], lock: Any = None) -> Any:
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        ray.get([a.build.remote(target, kind, kwargs) for a in self.actors])
        return _RemoteAttributes(self, target)

    def stop(self) -> None:
        """End the actors' process group and the actors."""
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        try:
            ray.get([a.leave.remote() for a in self.actors], timeout=60)
        except Exception as exc:  # a dead or hung rank: the actors are killed anyway
            log.warning("trainer ranks did not leave cleanly: %r", exc)
        for a in self.actors:
            ray.kill(a)


class _RemoteAttributes:
    """Rank 0's object's attributes (``lr``, ``is_lora``), read through Ray."""

    def __init__(self, ranks: RayRanks, target: str) -> None:
        self._ranks, self._target = ranks, target

    def __getattr__(self, name: str) -> Any:
        import ray  # noqa: PLC0415  ray is an optional extra (scheduler: ray)

        return ray.get(self._ranks.actors[0].attribute.remote(self._target, name))


# ---------------------------------------------------------------------------- proxies
class _Sharded:
    """Rank 0's handle on one object that lives on every rank."""

    target = ""

    def __init__(self, ranks: Ranks | RayRanks, local: Any) -> None:
        self.ranks, self.local = ranks, local

    def _all(self, method: str, *args: Any) -> Any:
        return self.ranks.call(self.target, method, args)

    def _forward(
        self,
        method: str,
        seqs: Sequence[Sequence[int]],
        args: Callable[[list[int]], tuple[Any, ...]],
    ) -> list[torch.Tensor]:
        """``method(*args(idx))`` on each rank with its contiguous run ``idx`` of
        ``seqs``, the results put back in order."""
        parts = group_parts(list(range(len(seqs))), [len(s) for s in seqs], self.ranks.size)
        each = [args(idx) for idx in parts]
        results = self.ranks.call(self.target, method, each, per_rank=True, gather=True)
        out: list[torch.Tensor] = [torch.zeros(0)] * len(seqs)
        for idx, res in zip(parts, results, strict=True):
            for i, x in zip(idx, res, strict=True):
                out[i] = x
        return out

    @property
    def lr(self) -> float:
        return float(self.local.lr)

    def step_schedule(self) -> None:
        self._all("step_schedule")

    def save(self, directory: str | Path) -> None:
        self._all("save", str(directory))

    def load(self, directory: str | Path) -> None:
        self._all("load", str(directory))


class DistributedPolicy(_Sharded):
    """``Policy``'s interface over all trainer ranks (see the module docstring)."""

    target = "policy"

    @property
    def is_lora(self) -> bool:
        return bool(self.local.is_lora)

    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def vocab_size(self) -> int:
        return int(self.local.vocab_size)

    def reset_optimizer(self, lr: float) -> None:
        self._all("reset_optimizer", lr)

    def set_lr(self, lr: float) -> None:
        self._all("set_lr", lr)

    def save(self, directory: str | Path) -> None:
        """Every rank's shards, then its random state (the policy's checkpoint directory
        is the checkpoint's)."""
        self._all("save", str(directory))
        self.ranks.call("", "__rng_save__", (str(directory),))

    def load(self, directory: str | Path) -> None:
        self._all("load", str(directory))
        self.ranks.call("", "__rng_load__", (str(directory), self.ranks.seed))

    def _scored(
        self,
        method: str,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int,
        needed: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        """``method`` (``logprobs`` | ``ref_logprobs``) over the ranks."""

        def args(idx: list[int]) -> tuple[Any, ...]:
            return (
                _pick(seqs, idx),
                _pick(temperature, idx),
                micro_batch_tokens,
                _pick(needed, idx),
            )

        return self._forward(method, seqs, args)

    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        return self._scored("logprobs", seqs, temperature, micro_batch_tokens, needed)

    def ref_logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        return self._scored("ref_logprobs", seqs, temperature, micro_batch_tokens, needed)

    def train_step(
        self,
        seqs: Sequence[Sequence[int]],
        loss_fn: PolicyLoss,
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        """``loss_fn`` is split with the batch by its groups. When it records (the step's
        ``BatchLoss(record=True)``), the ranks' records are gathered into its ``records``,
        under the whole batch's sample indices (rank r's sample j is sample
        ``parts[r][j]``)."""
        parts = group_parts(loss_fn.group_ids, [len(s) for s in seqs], self.ranks.size)
        args = [
            (
                _pick(seqs, idx),
                loss_fn.select(idx),
                _pick(temperature, idx),
                micro_batch_tokens,
                _pick(needed, idx),
                entropy_grad,
            )
            for idx in parts
        ]
        into = getattr(loss_fn, "records", None) if getattr(loss_fn, "record", False) else None
        if into is None:
            return self.ranks.call(self.target, "train_step", args, per_rank=True)  # type: ignore[no-any-return]
        results = self.ranks.call(
            self.target, "__train_recorded__", args, per_rank=True, gather=True
        )
        for idx, (_, records) in zip(parts, results, strict=True):
            into.update({idx[j]: rec for j, rec in records.items()})
        return results[0][0]  # type: ignore[no-any-return]

    def weight_update(self, version: int) -> WeightUpdate:
        return self._all("weight_update", version)  # type: ignore[no-any-return]

    def export(
        self, directory: str | Path, tokenizer_dir: str | Path, merge_lora: bool = True
    ) -> Path:
        return self._all("export", str(directory), str(tokenizer_dir), merge_lora)  # type: ignore[no-any-return]


class DistributedCritic(_Sharded):
    """``Critic``'s interface over all trainer ranks."""

    target = "critic"

    def values(
        self, seqs: Sequence[Sequence[int]], micro_batch_tokens: int = 4096
    ) -> list[torch.Tensor]:
        return self._forward("values", seqs, lambda idx: (_pick(seqs, idx), micro_batch_tokens))

    def train_step(
        self, seqs: Sequence[Sequence[int]], loss_fn: CriticLoss, micro_batch_tokens: int = 4096
    ) -> dict[str, float]:
        """``loss_fn`` is split with the batch by its samples' groups."""
        parts = group_parts(loss_fn.group_ids, [len(s) for s in seqs], self.ranks.size)
        args = [(_pick(seqs, idx), loss_fn.select(idx), micro_batch_tokens) for idx in parts]
        return self.ranks.call(self.target, "train_step", args, per_rank=True)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- processes
def _die_with_parent() -> None:
    """Be killed (SIGKILL) when the launcher dies, even by ``kill -9``."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the collective timeout still ends an orphan
        return
    parent = os.environ.get(_PARENT_ENV)
    if parent and os.getppid() != int(parent):  # the launcher died before prctl
        os._exit(1)


def launch(cfg: Any, *, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.train.nproc`` ranks of this machine (blocking); returns rank 0's
    last-step metrics. A failed rank raises :class:`RankFailed`."""
    if cfg.train.cpu_offload and not default_device(cfg.model.device).startswith("cuda"):
        raise ConfigError(
            "train.cpu_offload: FSDP2 offloads shards from a GPU to host memory; this run "
            f"trains on {default_device(cfg.model.device)}: set train.cpu_offload=false"
        )
    with tempfile.TemporaryDirectory(prefix="areal-ranks-") as tmp:
        config, summary = Path(tmp) / "config.yaml", Path(tmp) / "summary.json"
        dump_yaml(cfg, config)
        args = ["-m", "areal_agents.trainer.rank", str(config), "--summary", str(summary)]
        run_ranks(cfg.train.nproc, args + ["--resume"] * resume + ["--quiet"] * quiet)
        return json.loads(summary.read_text())  # type: ignore[no-any-return]


def run_ranks(nproc: int, args: Sequence[str], *, monitor_interval_s: float = 0.5) -> None:
    """``python ARGS`` as ``nproc`` ranks on this machine, started and watched by
    ``torch.distributed``'s elastic agent as ``torchrun --standalone`` would (c10d
    rendezvous on loopback, no restarts). Returns when all exited 0; otherwise every rank
    is stopped and :class:`RankFailed` names the first that failed."""
    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"areal-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        local_addr="127.0.0.1",
    )
    os.environ[_PARENT_ENV] = str(os.getpid())
    # each rank's share of the cores (as torchrun does, unless the user chose)
    threads_set = "OMP_NUM_THREADS" in os.environ
    if not threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        elastic_launch(launch_cfg, sys.executable)(*args)
    except ChildFailedError as exc:
        raise RankFailed(_failure_message(exc)) from None
    finally:
        os.environ.pop(_PARENT_ENV, None)
        if not threads_set:
            os.environ.pop("OMP_NUM_THREADS", None)


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How a rank's own error reads when it only lost a peer (the peer's failure is the cause)."""


def _failure_message(exc: Any) -> str:
    """The rank whose failure caused the others', how it ended and its error: a rank that
    raised something other than a lost peer, else one killed by a signal other than the
    agent's SIGTERM, else the first failure."""

    def error(failure: Any) -> str:
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        return str(msg or "").strip()

    def cause_rank(item: tuple[int, Any]) -> tuple[int, float]:
        _, failure = item
        text = error(failure)
        if text and not text.startswith("To enable") and not any(p in text for p in _PEER_LOST):
            return (0, failure.timestamp)  # its own exception (it may since have been stopped)
        if failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
            return (1, failure.timestamp)
        return (2, failure.timestamp)

    rank, failure = min(exc.failures.items(), key=cause_rank)
    text = error(failure)
    if text and not text.startswith("To enable") and failure.exitcode < 0:
        how = "raised"  # then the agent stopped it
    elif failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    detail = text.splitlines()[-1] if text and not text.startswith("To enable") else ""
    return f"trainer rank {rank} {how}" + (f": {detail}" if detail else " (see its output above)")
