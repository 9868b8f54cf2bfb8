"""The run's inference engine, from its ``engine`` section.

The section is :mod:`areal_agents.trainer.config_engine`.

:func:`build_engine` makes the embedded engine, or starts / attaches to vLLM or SGLang servers
(:mod:`areal_agents.engines.servers`) and checks before the first episode what would
otherwise fail on the first weight update: a LoRA rank and target modules the server can
serve, dev mode for full weight updates on an attached vLLM. :func:`first_sync` loads the
initial weights, turning a server that cannot read ``engine.weights_dir`` into a
``ConfigError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from areal_agents.engines.embedded import EmbeddedEngine
from areal_agents.engines.servers import Launch, start_server_engine, vllm_lora_rank
from areal_agents.errors import BackendError, ConfigError, UserError
from areal_agents.hardware import default_device, resolve_dtype
from areal_agents.trainer.config import TrainConfig


def weights_dir(cfg: TrainConfig, out: Path) -> Path:
    """Where the trainer writes the weights the servers load (``engine.weights_dir``)."""
    return Path(cfg.engine.weights_dir) if cfg.engine.weights_dir else out / "weights"


def build_engine(
    cfg: TrainConfig,
    *,
    model_path: str,
    tokenizer: Any,
    compute_lock: Any,
    out: Path,
    quiet: bool = False,
) -> Any:
    """The engine ``cfg.engine`` names (see the module docstring)."""
    device = default_device(cfg.model.device)
    if not cfg.engine.server:
        return EmbeddedEngine.from_pretrained(
            model_path,
            dtype=resolve_dtype(cfg.model.dtype, device),
            device=cfg.model.device,
            decode=tokenizer.decode,
            max_batch_size=max(cfg.rollout.concurrency, 1),
            max_context=cfg.model.max_context,  # the proxy refuses longer prompts (400)
            compute_lock=compute_lock,
            kv_on_update=cfg.rollout.kv_on_update,
        )
    backend, lora = cfg.engine.backend, cfg.model.lora
    launch = None
    if not cfg.engine.urls:
        launch = Launch(  # the engine.launch section whole, and what this run derives
            cfg.engine.launch,
            log_dir=cfg.engine.launch.log or str(out / "engine"),
            cpus=cfg.rollout.engine_cpus,
            starter=_ray_starter(cfg) if cfg.scheduler == "ray" else None,
        )
    merged = lora.enabled and cfg.engine.lora_updates == "merged"
    rank = 0
    if lora.enabled and not merged:
        rank = vllm_lora_rank(lora.r) if backend == "vllm" else lora.r
    # The trainer's dtype: the servers' logprobs are compared with its own (mismatch/*).
    # A merged adapter is served in float32: in bfloat16 a small update would round away.
    dtype = str(resolve_dtype(cfg.model.dtype, device, low_precision_ok=lora.enabled))
    if merged:
        dtype = "float32"
    if launch is not None:
        stop_leftover_servers(out)
    engine = start_server_engine(
        backend,
        model_path,
        launch=launch,
        urls=cfg.engine.urls,
        dtype=dtype.removeprefix("torch."),
        lora_rank=rank,
        max_num_seqs=max(cfg.rollout.concurrency, 1),
        max_model_len=cfg.model.max_context,
        weights_dir=str(weights_dir(cfg, out)),
        decode=tokenizer.decode,
        say=None if quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
        merge_lora=merged,
    )
    try:
        _check_attached(cfg, engine)
    except BaseException:
        _close_now(engine)
        raise
    if launch is not None:
        _record_servers(engine, out)
    return engine


SERVERS_FILE = "engine/servers.json"
"""The run's launched server processes (pid = process group, and the command), so that a
run resumed after its trainer was killed stops the servers that outlived it."""


def _record_servers(engine: Any, out: Path) -> None:
    rows = []
    for e in _replicas(engine):
        popen = getattr(e.server, "popen", None)  # None: held by a Ray actor (Ray stops it)
        if popen is not None:
            rows.append({"pgid": popen.pid, "argv": list(e.server.argv), "url": e.url})
    path = out / SERVERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


def stop_leftover_servers(out: Path) -> list[int]:
    """Stop the process groups of servers an earlier start of this run launched and did not
    stop (its trainer was killed): each one still running the recorded command gets SIGKILL.
    Returns the process groups stopped."""
    path = out / SERVERS_FILE
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    stopped = []
    for row in rows:
        pgid, argv = int(row["pgid"]), [str(a) for a in row["argv"]]
        try:
            cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            cmdline = []
        if [c.decode(errors="replace") for c in cmdline if c] != argv:
            continue  # gone, or the pid now belongs to another program
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            stopped.append(pgid)
            print(f"stopped a server left by an earlier start: {row['url']}", file=sys.stderr)
    path.unlink(missing_ok=True)
    return stopped


def _ray_starter(cfg: TrainConfig) -> Any:
    """``scheduler: ray``: each launched server in a Ray actor with its declared resources."""
    from areal_agents.rollout.ray_servers import ray_starter  # noqa: PLC0415  it imports ray, an optional extra

    spec, cores = cfg.engine.launch, cfg.rollout.engine_cpus
    cpus = len(cores) / spec.servers if cores else 1.0
    return ray_starter(cpus_per_server=cpus, gpus_per_server=float(spec.gpus))


def _replicas(engine: Any) -> list[Any]:
    return list(getattr(engine, "engines", [engine]))


def _check_attached(cfg: TrainConfig, engine: Any) -> None:
    """What attached servers must offer for training: vLLM's development endpoints
    (pause, the version label, the prefix-cache reset, full reloads)."""
    if cfg.engine.backend != "vllm":
        return
    missing = [e.url for e in _replicas(engine) if not getattr(e, "dev_mode", True)]
    if missing:
        raise ConfigError(
            f"engine.urls: the vLLM server(s) {', '.join(missing)} run without "
            "VLLM_SERVER_DEV_MODE=1; training needs its endpoints (pause, the weight version "
            "label each token carries, the prefix-cache reset and full weight reloads): "
            "restart them with VLLM_SERVER_DEV_MODE=1"
        )


def check_lora_targets(model: Any, cfg: TrainConfig) -> None:
    """vLLM serves LoRA on linear and embedding layers only: a target module of another
    kind (a norm, a convolution, a whole block) is a ``ConfigError``."""
    if cfg.engine.backend != "vllm" or not cfg.model.lora.enabled:
        return
    if cfg.engine.lora_updates == "merged":  # vLLM serves plain weights: peft merges any layer
        return
    bad = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if hasattr(module, "base_layer") and not _vllm_lora_layer(module.base_layer)
        }
    )
    if bad:
        raise ConfigError(
            f"model.lora.target_modules: vLLM serves LoRA adapters on linear and embedding "
            f"layers only, and {', '.join(bad)} is not one; target linear layers (e.g. "
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
        )


def _vllm_lora_layer(layer: Any) -> bool:
    """A layer vLLM can serve an adapter on: linear (transformers' ``Conv1D`` is GPT-2's
    linear layer) or an embedding."""
    return isinstance(layer, torch.nn.Linear | torch.nn.Embedding) or (
        type(layer).__name__ == "Conv1D" and type(layer).__module__.startswith("transformers")
    )


async def first_sync(cfg: TrainConfig, engine: Any, update: Any, out: Path) -> None:
    """Load the run's initial weights into the engine; with servers, a failure is a
    ``ConfigError`` naming ``engine.weights_dir`` (the servers read their weights there)."""
    if not cfg.engine.server:
        await engine.update_weights(update)
        return
    try:
        await engine.update_weights(update)
    except (UserError, BackendError, ValueError, OSError) as exc:
        where = weights_dir(cfg, out)
        raise ConfigError(
            f"engine.weights_dir: the {cfg.engine.backend} server(s) could not load the "
            f"initial weights from {where}: {exc}\nEvery server must read what the trainer "
            "writes there: set engine.weights_dir to a directory they share (e.g. a shared "
            "filesystem mounted at the same path)"
        ) from None


def _close_now(engine: Any) -> None:
    for e in _replicas(engine):
        server = getattr(e, "server", None)
        if server is not None:
            server.stop()
