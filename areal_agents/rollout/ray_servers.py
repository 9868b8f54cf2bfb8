"""vLLM / SGLang servers held by Ray actors (``areal-agent train`` with ``scheduler: ray`` and
``engine.launch``).

Each server is started by a :class:`ServerHost` actor on the node Ray places it on, with the
resources the config declares (``engine.launch.gpus`` GPUs, else one CPU per core of its
share of ``rollout.engine_cpus``, else one CPU). The host binds the server to its node's
address and keeps its process; the trainer attaches to the URL over HTTP as to any server,
and :class:`RayServer` stands in for the local
:class:`~areal_agents.engines.launch.ServerProcess`, so a server that dies is restarted by
its host, on its node, with the same command (see :mod:`areal_agents.engines.remote`).
Ray sets ``CUDA_VISIBLE_DEVICES`` for a host that asks for GPUs, and the server inherits it.

Example (what :func:`areal_agents.trainer.engine_build.build_engine` does)::

    connect()
    launch = Launch(LaunchConfig(servers=2, gpus=1), starter=ray_starter())
    engine = start_server_engine("vllm", model_dir, launch=launch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray

from areal_agents.engines.launch import ServerProcess
from areal_agents.engines.remote import RemoteEngine
from areal_agents.rollout.cluster import connect


class ServerHost:
    """A Ray actor that starts one server on its node and keeps its process."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = None

    def start(self, cls: type[RemoteEngine], model: str, options: dict[str, Any]) -> list[str]:
        """Launch the server (``cls.launch``) bound to this node's address; its URL and log."""
        host = ray.util.get_node_ip_address()
        engine: Any = cls.launch(model, host=host, **options)  # type: ignore[attr-defined]
        self.server = engine.server
        assert self.server is not None
        return [engine.url, str(self.server.log_path)]

    def _server(self) -> ServerProcess:
        if self.server is None:
            raise RuntimeError("the server host has not started its server")
        return self.server

    def running(self) -> bool:
        return self._server().running

    def pid(self) -> int:
        """The server process's id on this node."""
        return int(self._server().popen.pid)

    def exit_code(self) -> int | None:
        return self._server().exit_code

    def restart(self, timeout_s: float) -> None:
        self._server().restart(timeout_s)

    def tail(self, lines: int) -> str:
        return self._server().tail(lines)

    def stop(self, grace_s: float) -> None:
        if self.server is not None:
            self.server.stop(grace_s)


class RayServer:
    """A server held by a :class:`ServerHost` actor, behind ``ServerProcess``'s interface."""

    def __init__(self, actor: Any, url: str, log_path: str) -> None:
        self.actor = actor
        self.url = url
        self.log_path = log_path
        """The log's path on the actor's node."""

    def _call(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)

    @property
    def running(self) -> bool:
        try:
            return bool(self._call("running"))
        except (ray.exceptions.RayError, TimeoutError):
            return False  # the host itself is gone: nothing serves

    @property
    def exit_code(self) -> int | None:
        try:
            return self._call("exit_code")  # type: ignore[no-any-return]
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def restart(self, timeout_s: float = 600.0) -> None:
        self._call("restart", timeout_s, timeout_s=timeout_s + 60.0)

    def tail(self, lines: int = 40) -> str:
        try:
            return str(self._call("tail", lines))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            return f"(the log on the server's node cannot be read: {exc!r})"

    def stop(self, grace_s: float = 20.0) -> None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            self._call("stop", grace_s, timeout_s=grace_s + 30.0)
        ray.kill(self.actor)


def ray_starter(cpus_per_server: float = 1.0, gpus_per_server: float = 0.0) -> Callable[..., Any]:
    """A ``Launch.starter``: each server in a :class:`ServerHost` actor asking for these
    resources (joins ``$RAY_ADDRESS`` or a ``ray start`` cluster, else starts a local one)."""
    connect()
    host_cls: Any = ray.remote(ServerHost)

    def start(cls: type[RemoteEngine], model: str, options: dict[str, Any]) -> RemoteEngine:
        decode = options.pop("decode", None)
        actor = host_cls.options(num_cpus=cpus_per_server, num_gpus=gpus_per_server).remote()
        url, log_path = ray.get(actor.start.remote(cls, model, options))
        try:
            engine = cls.connect(url, model_dir=model, decode=decode)  # type: ignore[attr-defined]
        except BaseException:
            RayServer(actor, url, log_path).stop(grace_s=5.0)
            raise
        engine.server = RayServer(actor, url, log_path)
        return engine  # type: ignore[no-any-return]

    return start
