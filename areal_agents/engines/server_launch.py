"""How inference servers are started: :class:`LaunchConfig`, the settings a user writes (the
training config's ``engine.launch`` section, and what ``areal-agent serve`` / ``eval`` build
from their flags), and :class:`Launch`, those settings with what the caller derives (where the
logs go, the cores, a Ray starter). :mod:`areal_agents.engines.servers` starts the servers.

Light on purpose (no torch, no HTTP client): the training config imports it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LaunchConfig:
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

    def _problems(self) -> list[str]:
        """What is wrong with these values, each as ``"field: what is wrong"`` (the training
        config runs this on its ``engine.launch`` section)."""
        rules = (
            ("servers", self.servers >= 1, ">= 1"),
            ("port", 0 <= self.port < 65536, "a TCP port, or 0 (free ports)"),
            ("gpus", self.gpus >= 0, ">= 0"),
            ("start_timeout_s", self.start_timeout_s > 0, "> 0"),
            ("max_restarts", self.max_restarts >= 0, ">= 0"),
        )
        return [f"{n}: must be {r}, got {getattr(self, n)!r}" for n, ok, r in rules if not ok]


@dataclass(frozen=True)
class Launch:
    """How to start the servers: the user's :class:`LaunchConfig` and what the caller derives.

    Every setting of ``config`` reads as an attribute here too (``launch.servers``); ``args``
    as the flags split (``split_args``)."""

    config: LaunchConfig = field(default_factory=LaunchConfig)
    log_dir: str | None = None
    """Where the logs go (the caller resolves ``config.log``; None: no log files)."""
    log_name: str | None = None
    """The log's file name with one server (default ``<backend>-<i>.log``)."""
    cpus: tuple[int, ...] | None = None
    """The cores the servers share (split evenly between them); None: not pinned."""
    starter: Callable[..., Any] | None = None
    """``starter(cls, model, options) -> engine`` starts one server elsewhere (Ray:
    ``areal_agents.rollout.ray_servers.ray_starter``, where Ray sets the GPUs); None: a
    child process of this one (``cls.launch(model, **options)``)."""

    @property
    def servers(self) -> int:
        return self.config.servers

    @property
    def python(self) -> str | None:
        return self.config.python

    @property
    def module(self) -> str | None:
        return self.config.module

    @property
    def args(self) -> tuple[str, ...]:
        return split_args(self.config.args)

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def gpus(self) -> int:
        return self.config.gpus

    @property
    def env(self) -> Mapping[str, str]:
        return self.config.env

    @property
    def start_timeout_s(self) -> float:
        return self.config.start_timeout_s

    @property
    def max_restarts(self) -> int:
        return self.config.max_restarts


def split_args(args: str | Sequence[str]) -> tuple[str, ...]:
    """Flags given as one shell-quoted string or as a list."""
    return tuple(shlex.split(args)) if isinstance(args, str) else tuple(str(a) for a in args)
