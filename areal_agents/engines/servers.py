"""Server engines from one description: launch N vLLM / SGLang servers, or attach to some.

``areal-agent train`` (its ``engine`` section), ``serve`` and ``eval`` (``--backend``,
``--engine-url``, ``--engine-python``, ``--engine-args``) all build their server engine
here, so the two spellings mean the same thing.

* **Launched** (:class:`~areal_agents.engines.server_launch.Launch`): ``servers``
  processes started from the engine's own Python
  (``python -m vllm.entrypoints.openai.api_server`` or ``sglang.launch_server``), started
  side by side. Placement: ``cpus`` are split evenly between the servers (each process and
  its children run on their share; vLLM's CPU build binds its OpenMP threads to it through
  ``VLLM_CPU_OMP_THREADS_BIND``), or each server sees ``gpus`` GPUs of its own
  (``CUDA_VISIBLE_DEVICES``). Port ``port + i`` for server i (0: free ports); logs
  ``<log_dir>/<backend>-<i>.log``. A server that dies is restarted (``max_restarts``; see
  :mod:`areal_agents.engines.remote`).
* **Attached** (``urls``): servers started by someone else; nothing is restarted.

Several servers become one :class:`~areal_agents.engines.router.RoutedEngine` (a session
sticks to one server, a weight update reaches all). Weight updates are written to
``weights_dir`` (a directory every server can read; a temporary one by default) and the
servers load them from there.

LoRA on vLLM: ``--max-lora-rank`` must be one of :data:`VLLM_LORA_RANKS`
(:func:`vllm_lora_rank` picks the smallest that holds the adapter).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from areal_agents.engines.remote import DecodeFn, RemoteEngine
from areal_agents.engines.router import RoutedEngine
from areal_agents.engines.server_launch import Launch, LaunchConfig, split_args
from areal_agents.engines.sglang import SGLangEngine
from areal_agents.engines.vllm import VLLMEngine
from areal_agents.engines.weight_files import StagingArea
from areal_agents.errors import ConfigError, UserError

BACKENDS = ("vllm", "sglang")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank`` (vLLM 0.32, ``LoRAConfig``)."""

SERVER_MODULES = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}


def vllm_lora_rank(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ConfigError(
        f"model.lora.r: {r} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
        "lower it"
    )


def split_cores(cpus: Sequence[int], servers: int) -> list[list[int]]:
    """``cpus`` in ``servers`` contiguous, equal shares (the remainder to the first ones)."""
    if len(cpus) < servers:
        raise ConfigError(
            f"rollout.engine_cpus: {len(cpus)} core(s) for {servers} servers; give each "
            "server at least one core, or launch fewer servers (engine.launch.servers)"
        )
    per, extra = divmod(len(cpus), servers)
    out, at = [], 0
    for i in range(servers):
        n = per + (1 if i < extra else 0)
        out.append(list(cpus[at : at + n]))
        at += n
    return out


def server_env(backend: str, launch: Launch, index: int) -> tuple[dict[str, str], list[int] | None]:
    """Server ``index``'s added environment variables and cores (None: not pinned)."""
    env = dict(launch.env)
    cores = None
    if launch.gpus and launch.starter is None:  # Ray gives an actor its GPUs itself
        first = index * launch.gpus
        env.setdefault(
            "CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(first, first + launch.gpus))
        )
    elif launch.cpus:
        cores = split_cores(launch.cpus, launch.servers)[index]
        if backend == "vllm":
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    elif backend == "vllm":
        # vLLM's automatic binding keeps cores back for other processes; unpinned, the
        # server's threads go where the OS puts them.
        env.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        )
    return env, cores


def start_server_engine(
    backend: str,
    model_dir: str | None,
    *,
    launch: Launch | None = None,
    urls: Sequence[str] = (),
    dtype: str = "auto",
    lora_rank: int = 0,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    weights_dir: str | None = None,
    decode: DecodeFn | None = None,
    say: Callable[[str], None] | None = None,
    merge_lora: bool = False,
) -> Any:
    """One engine over the servers described (launched with ``launch``, else attached at
    ``urls``): a :class:`RemoteEngine`, or a :class:`RoutedEngine` over several.
    ``merge_lora``: LoRA updates are merged into full weights in this process
    (:class:`~areal_agents.engines.weights.LoraMerger`) and the servers load those."""
    if backend not in BACKENDS:
        raise ConfigError(f"engine.backend: {backend!r} is not a server backend ({BACKENDS})")
    cls: Any = VLLMEngine if backend == "vllm" else SGLangEngine
    note = say or (lambda _: None)
    if urls:
        note(f"attaching to {', '.join(urls)} ...")
        engines = [cls.connect(u, model_dir=model_dir, decode=decode) for u in urls]
    else:
        if model_dir is None:
            raise UserError("launching a server needs the model's directory")
        launch = launch or Launch()
        note(f"starting {launch.servers} {backend} server(s) for {model_dir} ...")
        engines = _launch_all(
            cls, backend, model_dir, launch, dtype, lora_rank, max_num_seqs, max_model_len, decode
        )
        for e in engines:
            log = e.server.log_path if e.server is not None else None
            note(f"{backend} server at {e.url} (log: {log})")
    if weights_dir is not None:
        Path(weights_dir).mkdir(parents=True, exist_ok=True)
        for e in engines:
            e._staging = StagingArea(weights_dir, prefix=f"areal-{backend}-")
    engine: RemoteEngine | RoutedEngine = (
        engines[0] if len(engines) == 1 else RoutedEngine(engines, staging_dir=weights_dir)
    )
    if merge_lora:
        if model_dir is None:
            raise UserError("merging LoRA updates needs the model's directory (its base weights)")
        from areal_agents.engines.weights import LoraMerger  # noqa: PLC0415  it loads torch

        engine.merger = LoraMerger(model_dir)
    return engine


def _launch_all(
    cls: Any,
    backend: str,
    model_dir: str,
    launch: Launch,
    dtype: str,
    lora_rank: int,
    max_num_seqs: int,
    max_model_len: int | None,
    decode: DecodeFn | None,
) -> list[RemoteEngine]:
    log_dir = Path(launch.log_dir) if launch.log_dir else None

    def log_path(i: int) -> str | None:
        if log_dir is None:
            return None
        name = launch.log_name if launch.log_name and launch.servers == 1 else None
        return str(log_dir / (name or f"{backend}-{i}.log"))

    def one(i: int) -> RemoteEngine:
        env, cores = server_env(backend, launch, i)
        options: dict[str, Any] = {
            "python": launch.python,
            "port": launch.port + i if launch.port else 0,
            "dtype": dtype,
            "lora_rank": lora_rank,
            "extra_args": list(launch.args),
            "env": env,
            "log_path": log_path(i),
            "start_timeout_s": launch.start_timeout_s,
            "decode": decode,
            "cpus": cores,
        }
        if backend == "vllm":
            options["max_num_seqs"] = max_num_seqs
            options["max_model_len"] = max_model_len
            if launch.module:
                options["server_module"] = launch.module
        else:
            options["context_length"] = max_model_len
            options["server_module"] = launch.module or SERVER_MODULES["sglang"]
        if launch.starter is not None:
            engine: RemoteEngine = launch.starter(cls, model_dir, options)
        else:
            engine = cls.launch(model_dir, **options)
        engine.max_restarts = launch.max_restarts
        engine.restart_timeout_s = launch.start_timeout_s
        return engine

    with ThreadPoolExecutor(max_workers=launch.servers) as pool:
        futures = [pool.submit(one, i) for i in range(launch.servers)]
        started, error = [], None
        for f in futures:
            try:
                started.append(f.result())
            except BaseException as exc:  # stop the others: no half-started fleet
                error = error or exc
    if error is not None:
        for e in started:
            if e.server is not None:
                e.server.stop()
        raise error
    return started


__all__ = [
    "BACKENDS",
    "SERVER_MODULES",
    "VLLM_LORA_RANKS",
    "Launch",
    "LaunchConfig",
    "server_env",
    "split_args",
    "split_cores",
    "start_server_engine",
    "vllm_lora_rank",
]
