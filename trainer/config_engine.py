"""The ``engine`` section of a training config: which inference engine generates the episodes.

``backend: embedded`` (the default) runs the transformers engine in this process (or a Ray
actor with ``scheduler: ray``). ``vllm`` and ``sglang`` generate on inference servers,
launched from the engine's own environment (``launch``) or already running (``urls``);
:mod:`areal_agents.engines.servers` builds them. The same vocabulary on the command line of
``areal-agent serve`` / ``eval``: ``--backend``, ``--engine-url`` (``urls``),
``--engine-python`` (``launch.python``), ``--engine-args`` (``launch.args``).

Which of the rollout section's placement keys apply to servers (each key lives in one
section only):

========================== ====================================================================
``rollout.engine_cpus``    the launched servers' cores, split evenly between them (vLLM's CPU
                           build binds its threads there: ``VLLM_CPU_OMP_THREADS_BIND``);
                           refused with ``launch.gpus`` or attached servers
``rollout.concurrency``    episodes in flight, and each launched vLLM's ``--max-num-seqs``
``rollout.kv_on_update``   ``recompute`` only: a server drops its requests' caches at an
                           update and they are sent again (``keep`` is the embedded engine's)
``rollout.idle_engine_cpus`` refused: an idle-priority replica is the embedded engine's; launch
                           more servers instead
``scheduler: ray``         the launched servers are held by Ray actors (one per server, with
                           ``launch.gpus`` GPUs or a CPU per core); the episodes run in this
                           process, so the checks about Ray rollout workers do not apply
========================== ====================================================================

:func:`engine_problems` holds the checks across sections; ``TrainConfig`` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_agents.trainer.config_checks import Checked


@dataclass(frozen=True)
class LaunchConfig(Checked):
    """Inference servers started by the run (ignored when ``engine.urls`` is set)."""

    servers: int = 1
    """How many servers: sessions are spread over them (a session sticks to one), every
    weight update reaches all."""
    python: str | None = None
    """The Python of the engine's own environment (vLLM: ``requirements/make_venv.sh vllm
    .venv-vllm``). None: ``$AREAL_VLLM_PYTHON`` / ``$AREAL_SGLANG_PYTHON``, else a
    ``.venv-vllm`` / ``.venv-sglang`` in the working directory, else this Python."""
    module: str | None = None
    """The server's Python module, run with ``python -m`` and the backend's flags. None:
    ``vllm.entrypoints.openai.api_server`` / ``sglang.launch_server``."""
    args: str = ""
    """More command-line flags for every server, as one shell-quoted string (e.g.
    ``"--tensor-parallel-size 2"``)."""
    port: int = 0
    """The first server's port (server i: port + i); 0 = free ports."""
    log: str | None = None
    """Directory of the servers' logs (``<backend>-<i>.log``). None: ``RUN_DIR/engine``."""
    gpus: int = 0
    """GPUs per server: server i sees GPUs ``i*gpus .. i*gpus + gpus - 1``
    (``CUDA_VISIBLE_DEVICES``); with ``scheduler: ray``, what each server's actor asks for.
    0 = no GPU (vLLM's CPU build)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every server (e.g. ``VLLM_CPU_KVCACHE_SPACE: "4"``)."""
    start_timeout_s: float = 900.0
    """How long a server may take to answer ``/health`` (vLLM compiles on its first start)."""
    max_restarts: int = 3
    """A server that dies is restarted, reloads the current weights and version, then takes
    requests (its episodes in flight end as ``backend_error``); after this many restarts
    the next death stops the run."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("servers", self.servers >= 1, ">= 1"),
            ("port", 0 <= self.port < 65536, "a TCP port, or 0 (free ports)"),
            ("gpus", self.gpus >= 0, ">= 0"),
            ("start_timeout_s", self.start_timeout_s > 0, "> 0"),
            ("max_restarts", self.max_restarts >= 0, ">= 0"),
        )


@dataclass(frozen=True)
class EngineConfig(Checked):
    """The inference engine that generates the episodes."""

    backend: Literal["embedded", "vllm", "sglang"] = "embedded"
    """``embedded``: the transformers engine in this process (or a Ray actor); ``vllm`` /
    ``sglang``: inference servers, launched (``launch``) or attached (``urls``)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How to start the servers (server backends, without ``urls``)."""
    urls: tuple[str, ...] = ()
    """Attach to these running servers instead of launching (each must serve
    ``model.path``, with LoRA enabled when ``model.lora`` is; vLLM also needs
    ``--enable-scale-out``, ``--logprobs-mode processed_logprobs`` and, for full weight
    updates, ``VLLM_SERVER_DEV_MODE=1``)."""
    weights_dir: str | None = None
    """Where the trainer writes the weights (or the LoRA adapter) after each step, for the
    servers to load: a directory every server can read. None: ``RUN_DIR/weights``. At the
    start the servers load the initial weights from it, so a server that cannot read it
    stops the run before the first episode."""

    @property
    def server(self) -> bool:
        """Whether the episodes are generated by inference servers."""
        return self.backend != "embedded"

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            (
                "urls",
                all(u.startswith(("http://", "https://")) for u in self.urls),
                "http(s) URLs of running servers",
            ),
        )

    def _problems(self) -> list[str]:
        out = super()._problems()
        if self.backend == "embedded":
            for name, default in (("urls", ()), ("weights_dir", None)):
                if getattr(self, name) != default:
                    out.append(
                        f"{name}: only server backends use it, but backend is 'embedded'; "
                        "set engine.backend=vllm|sglang or remove it"
                    )
            if self.launch != LaunchConfig():
                out.append(
                    "launch: starts inference servers, but backend is 'embedded'; set "
                    "engine.backend=vllm|sglang or remove engine.launch"
                )
        elif self.urls and self.launch != LaunchConfig():
            out.append(
                "launch: the run attaches to engine.urls and starts no server; remove "
                "engine.launch, or engine.urls to launch servers"
            )
        return out


def engine_problems(cfg: Any) -> list[str]:
    """The engine (``cfg``: a ``TrainConfig``) against the other sections, with full keys
    (see the module docstring)."""
    eng, ro, out = cfg.engine, cfg.rollout, []
    if not eng.server:
        if ro.engine_cpus is not None and cfg.scheduler != "ray":
            out.append(
                "rollout.engine_cpus: pins the engine's own process, which only "
                "scheduler=ray or a server backend (engine.backend=vllm) starts (with the "
                "embedded engine in this process, pin it with train.cpus); set one of them "
                "or remove rollout.engine_cpus"
            )
        if ro.idle_engine_cpus is not None and cfg.scheduler != "ray":
            out.append(
                "rollout.idle_engine_cpus: starts a second engine process, which only "
                "scheduler=ray does; set scheduler=ray or remove rollout.idle_engine_cpus"
            )
        return out
    backend = eng.backend
    if ro.idle_engine_cpus is not None:
        out.append(
            f"rollout.idle_engine_cpus: an idle-priority replica is the embedded engine's; "
            f"with engine.backend={backend} launch more servers (engine.launch.servers) on "
            "rollout.engine_cpus instead"
        )
    if ro.engine_cpus is not None and eng.urls:
        out.append(
            "rollout.engine_cpus: places the servers this run launches, but it attaches to "
            "engine.urls (whoever started them placed them); remove rollout.engine_cpus"
        )
    if ro.engine_cpus is not None and eng.launch.gpus:
        out.append(
            "rollout.engine_cpus: CPU cores for servers that run on engine.launch.gpus GPUs; "
            "set one of the two (cores for vLLM's CPU build, GPUs otherwise)"
        )
    if ro.engine_cpus is not None and len(ro.engine_cpus) < eng.launch.servers and not eng.urls:
        out.append(
            f"rollout.engine_cpus: {len(ro.engine_cpus)} core(s) for "
            f"engine.launch.servers={eng.launch.servers}; each server needs a core of its own"
        )
    if ro.kv_on_update == "keep":
        out.append(
            f"rollout.kv_on_update: 'keep' lets the embedded engine decode on from caches the "
            f"old weights computed; a {backend} server drops its requests' caches at an update "
            "and they are sent again; set rollout.kv_on_update=recompute"
        )
    if backend == "vllm":
        out.extend(_vllm_sampling_problems(cfg))
    if backend == "sglang" and not eng.urls and not eng.launch.gpus and eng.launch.module is None:
        out.append(
            "engine.launch.gpus: SGLang runs on GPUs only; set engine.launch.gpus (e.g. 1), "
            "or attach to running servers with engine.urls"
        )
    if cfg.scheduler == "ray" and eng.urls:
        out.append(
            "scheduler: ray places the servers this run launches on Ray actors; it attaches "
            "to engine.urls instead (nothing to place): set scheduler=local"
        )
    return out


def _vllm_sampling_problems(cfg: Any) -> list[str]:
    """vLLM reports logprobs renormalised over the tokens top-k / top-p keep: not the
    untruncated ones the trainer recomputes."""
    out = []
    fix = (
        "vLLM reports logprobs renormalised over the tokens top-k / top-p keep, which the "
        "trainer cannot recompute; set top_k=0 and top_p=1 (or use engine.backend=sglang or "
        "embedded, whose logprobs are untruncated)"
    )
    s = cfg.sampling
    if s.top_k or s.top_p < 1.0:
        out.append(f"sampling.top_k/top_p: {s.top_k}/{s.top_p}: {fix}")
    for kind, values in s.by_kind.items():
        if values.get("top_k") or float(values.get("top_p", 1.0)) < 1.0:
            out.append(f"sampling.by_kind.{kind}: sets top_k/top_p: {fix}")
    return out
