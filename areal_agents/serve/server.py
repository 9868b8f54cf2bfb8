"""Running the proxy: in-process on a background thread (tests, notebooks, the trainer) or in
the foreground (``areal-agent serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

from areal_agents.engines.launch import free_port
from areal_agents.serve.proxy import Proxy

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
"""Hosts that listen on every interface: no client can connect to them by that name, so a
proxy serving on one takes its public URL from each request (what the client reached)."""


def _public_url(proxy: Proxy, host: str, port: int) -> None:
    if proxy.public_url is None and host not in WILDCARD_HOSTS:
        proxy.public_url = f"http://{host}:{port}"


class _Addressed:
    """``url`` and ``base_url`` of a server listening on ``host:port``."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url`` of this proxy."""
        return f"{self.url}/v1"


@dataclass
class ProxyServer(_Addressed):
    """A uvicorn server running a :class:`Proxy` on its own thread and event loop.

    Example::

        with ProxyServer.start(proxy) as server:
            print(server.url)            # http://127.0.0.1:PORT
            session = proxy.sessions.create()
    """

    proxy: Proxy
    host: str
    port: int
    _server: uvicorn.Server
    _thread: threading.Thread

    @classmethod
    def start(
        cls, proxy: Proxy, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0
    ) -> ProxyServer:
        port = port or free_port(host)
        _public_url(proxy, host, port)
        config = uvicorn.Config(
            proxy.app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="areal-proxy", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start on {host}:{port}")
            time.sleep(0.01)
        return cls(proxy, host, port, server, thread)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_forever(proxy: Proxy, host: str, port: int) -> None:
    """Serve in the foreground until interrupted (used by ``areal-agent serve``)."""
    _public_url(proxy, host, port)
    config = uvicorn.Config(proxy.app, host=host, port=port, log_level="info", access_log=False)
    server = uvicorn.Server(config)
    # uvicorn shuts down on SIGTERM and then raises the signal again; as SystemExit (not
    # the default action, which ends the process at once) it reaches the ``finally`` below,
    # so an engine that started a server process (vLLM, SGLang) stops it.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        asyncio.run(server.serve())
    finally:
        signal.signal(signal.SIGTERM, previous)
        asyncio.run(proxy.engine.close())
        if proxy.store is not None:
            proxy.store.close()


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class LoopServer(_Addressed):
    """A uvicorn server for a :class:`Proxy` on the *running* event loop, as a task of it
    (the trainer: its agents, the proxy's handlers and the worker API share one loop, so the
    session store is only ever touched from that loop). Signals are left to the program.

    Example::

        server = LoopServer(proxy)
        await server.start()          # answers on server.base_url from now on
        ...
        await server.stop()
    """

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.proxy = proxy
        self.host = host
        self.port = port or free_port(host)
        _public_url(proxy, host, self.port)
        config = uvicorn.Config(
            proxy.app,
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = _NoSignalServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        """Bind (an ``OSError`` names a taken port) and serve until :meth:`stop`."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(
                f"cannot serve on {self.host}:{self.port}: {exc.strerror}; "
                "choose another port (workers.port) or stop what holds it"
            ) from None
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the server's own error (e.g. the port is taken)
                raise RuntimeError(f"the proxy did not start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 10)
        except (TimeoutError, asyncio.CancelledError, SystemExit):
            self._task.cancel()
        self._task = None


class _NoSignalServer(uvicorn.Server):
    """uvicorn without its signal handlers: the program that embeds it handles Ctrl-C."""

    def capture_signals(self) -> Any:
        return contextlib.nullcontext()
