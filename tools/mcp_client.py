"""Tools from an MCP server, as :class:`tools.Tool` objects an env or an agent calls.

An MCP server (a command speaking MCP over its stdin/stdout, or a streamable HTTP URL) is
described by a mapping, the same in a training config (``env.kwargs.mcp``), in
``--env-kwargs`` and in code::

    {"command": ["python", "my_server.py"],   # stdio: the server's command line
     "url": "http://127.0.0.1:8000/mcp",      # or streamable HTTP (give one of the two)
     "env": {"TOKEN": "..."},                 # stdio only: extra environment variables
     "cwd": "path/to/dir",                    # stdio only: the server's working directory
     "timeout_s": 30,                         # limit of one tool call
     "connect_timeout_s": 30,                 # limit of starting and listing the tools
     "tools": ["search", "fetch"],            # only these tools (default: all listed)
     "prefix": "fs_",                         # prepended to every tool name the model sees
     "scope": "process"}                      # or "env": see below

Its tools are listed once when the connection opens and become :class:`MCPTool` objects:
the tool schema the model sees is the server's (name, description, ``inputSchema`` as the
JSON-schema parameters), and a call is validated against that schema like any
:class:`~areal_agents.tools.tool.Tool` (a model mistake is an ``"Error: ..."`` result naming
the expected arguments), then sent as ``tools/call``. The result's text content (and the text
of embedded text resources) becomes the tool message; a result with only structured content
gives its JSON; images, audio and binary resources are named, not inlined. ``isError`` gives
an ``"Error: ..."`` result of kind ``"tool_exception"``; a call past ``timeout_s`` one of kind
``"timeout"`` (the call never hangs the episode); a server that crashed or closed the
connection one of kind ``"mcp_error"``, and the next call reconnects (restarting a stdio
server), so the run goes on.

A server that cannot start, answer the handshake or list its tools within
``connect_timeout_s`` raises :class:`~areal_agents.errors.ConfigError` when the connection
opens, which for an env is when it is made: before the run's first episode.

Connection lifetime (``scope``):

- ``"process"`` (default): one connection per distinct server config per process, shared by
  every env and agent of that process (a worker's concurrent episodes send their calls over
  it; MCP multiplexes them). Right for stateless servers (search, fetch, a calculator).
- ``"env"``: one connection per env instance, so one stdio server process per episode,
  opened when the env is made and closed by ``env.close()``. Right for servers whose state
  is the episode's (a scratch file system, a database an agent edits).

The connection runs on its own event loop in a background thread, so a tool can be called
from sync code (an env's ``step`` on the runner's thread pool) and from any event loop (an
agent's ``await tool.acall(...)``) alike.

For an agent without an env::

    tools = mcp_tools({"command": ["python", "server.py"]})
    schemas = [t.schema for t in tools]          # offer these to the model
    result = await tools[0].acall('{"a": 2}')    # run a call it made: result.content

Needs the ``mcp`` package (2.x): ``pip install 'areal-agents[mcp]'``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import math
import os
import re
import shlex
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.tools.tool import Tool, ToolResult, _BadArguments

__all__ = ["MCPConnection", "MCPServerConfig", "MCPTool", "connect", "mcp_tools"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KEYS = (
    "command",
    "url",
    "env",
    "cwd",
    "timeout_s",
    "connect_timeout_s",
    "tools",
    "prefix",
    "scope",
    "name",
)
_SCOPES = ("process", "env")
_GRACE_S = 2.0  # past a call's own limit, how long the caller waits for the MCP timeout


@dataclass(frozen=True)
class MCPServerConfig:
    """Where an MCP server is and how its tools are used (see the module docstring)."""

    command: tuple[str, ...] | None = None
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    timeout_s: float = 30.0
    connect_timeout_s: float = 30.0
    tools: tuple[str, ...] | None = None
    prefix: str = ""
    scope: str = "process"
    name: str | None = None

    @property
    def label(self) -> str:
        """How messages name the server: ``name``, else its URL or its command line."""
        if self.name:
            return self.name
        if self.url:
            return self.url
        head, *rest = self.command or ("",)
        return shlex.join([os.path.basename(head), *rest])

    @classmethod
    def parse(cls, value: Any, where: str = "mcp") -> MCPServerConfig:
        """A config from a mapping (or a config); a bad one is a :class:`ConfigError`
        whose message starts with ``where`` and names the fix."""
        if isinstance(value, MCPServerConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping such as {{command: [python, server.py]}} or "
                f"{{url: http://127.0.0.1:8000/mcp}}, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; the keys are {list(_KEYS)}")
        command, url = value.get("command"), value.get("url")
        if (command is None) == (url is None):
            raise ConfigError(
                f"{where}: give exactly one of 'command' (a stdio server's command line, e.g. "
                "[python, server.py]) and 'url' (a streamable HTTP endpoint, e.g. "
                "http://127.0.0.1:8000/mcp)"
            )
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None and (
            not isinstance(command, Sequence)
            or not command
            or not all(isinstance(part, str) and part for part in command)
        ):
            raise ConfigError(
                f"{where}.command: expected a non-empty list of strings (the executable "
                f"first), got {command!r}"
            )
        if url is not None and (
            not isinstance(url, str) or not url.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"{where}.url: expected an http:// or https:// URL of a streamable HTTP MCP "
                f"endpoint (often ending in /mcp), got {url!r}"
            )
        env = value.get("env") or {}
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError(f"{where}.env: expected a mapping of strings to strings")
        if url is not None and (env or value.get("cwd") is not None):
            raise ConfigError(f"{where}: 'env' and 'cwd' apply to a stdio server ('command')")
        cwd = value.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ConfigError(f"{where}.cwd: expected a directory path, got {cwd!r}")
        tools = value.get("tools")
        if tools is not None and (
            isinstance(tools, str)
            or not isinstance(tools, Sequence)
            or not all(isinstance(t, str) for t in tools)
        ):
            raise ConfigError(f"{where}.tools: expected a list of tool names, got {tools!r}")
        prefix = value.get("prefix") or ""
        if not isinstance(prefix, str) or (prefix and not re.fullmatch(r"[A-Za-z0-9_-]+", prefix)):
            raise ConfigError(
                f"{where}.prefix: expected letters, digits, '_' or '-', got {prefix!r}"
            )
        scope = value.get("scope", "process")
        if scope not in _SCOPES:
            raise ConfigError(
                f"{where}.scope: expected 'process' (one connection shared by the process) or "
                f"'env' (one per env instance), got {scope!r}"
            )
        name = value.get("name")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"{where}.name: expected a string, got {name!r}")
        return cls(
            command=None if command is None else tuple(command),
            url=url,
            env=tuple(sorted(env.items())),
            cwd=cwd,
            timeout_s=_seconds(value.get("timeout_s", 30.0), f"{where}.timeout_s"),
            connect_timeout_s=_seconds(
                value.get("connect_timeout_s", 30.0), f"{where}.connect_timeout_s"
            ),
            tools=None if tools is None else tuple(tools),
            prefix=prefix,
            scope=scope,
            name=name,
        )


def _seconds(value: Any, where: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _require_mcp() -> Any:
    try:
        import mcp  # noqa: PLC0415  mcp is an optional extra (areal-agents[mcp])
        from mcp.client.client import Client  # noqa: F401, PLC0415  the 2.x API of that extra
    except ImportError as exc:
        raise ConfigError(
            f"MCP tools need the mcp package, 2.x ({exc}); install it with "
            "pip install 'areal-agents[mcp]'"
        ) from None
    return mcp


# ---------------------------------------------------------------------------- the connection


class MCPConnection:
    """One client connection to an MCP server, on a background event loop.

    :meth:`open` connects and lists the tools (raising :class:`ConfigError` when the server
    cannot be reached); :meth:`tools` gives them as :class:`MCPTool` objects; :meth:`close`
    ends the connection (a stdio server's process with it). Calls from any thread or event
    loop go to the background loop.
    """

    def __init__(self, config: MCPServerConfig | Mapping[str, Any]) -> None:
        self.config = MCPServerConfig.parse(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._listed: list[Any] = []
        self._tools: list[MCPTool] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"MCPConnection({self.config.label!r}, tools={[t.name for t in self._tools]})"

    # ------------------------------------------------------------------ lifetime

    def open(self) -> MCPConnection:
        """Start the server (stdio) or reach it (HTTP), handshake, list its tools."""
        _require_mcp()
        if self._loop is not None:
            return self
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"areal-mcp {self.config.label}"[:60], daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            future = asyncio.run_coroutine_threadsafe(self._connect(), loop)
            try:
                future.result(self.config.connect_timeout_s + _GRACE_S)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise TimeoutError(f"no answer within {self.config.connect_timeout_s} s") from None
            self._tools = self._make_tools(self._listed)
        except ConfigError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise ConfigError(
                f"MCP server {self.config.label!r} did not start: {_describe(exc)}; check "
                + (
                    "that the command runs and speaks MCP on stdio (try it in a shell)"
                    if self.config.command
                    else "that the server is up at that URL (the path is often /mcp)"
                )
                + f", or raise connect_timeout_s ({self.config.connect_timeout_s} s)"
            ) from None
        _OPEN.add(self)
        return self

    def close(self) -> None:
        """End the connection and the background loop; idempotent."""
        self._closed = True
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        if not loop.is_closed():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._disconnect(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)
        with contextlib.suppress(Exception):
            loop.close()
        _OPEN.discard(self)

    def tools(self) -> list[MCPTool]:
        """The server's tools (as filtered and named by the config)."""
        return list(self._tools)

    # ------------------------------------------------------------------ calls

    def call(self, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
        """Call the MCP tool ``name`` (the server's own name); blocks this thread."""
        future = self._submit(name, arguments)
        if isinstance(future, ToolResult):
            return future
        try:
            return future.result(self.config.timeout_s + _GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return _timeout(name, self.config.timeout_s)

    async def acall(self, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
        """:meth:`call` for the caller's event loop (it does not block that loop)."""
        future = self._submit(name, arguments)
        if isinstance(future, ToolResult):
            return future
        try:
            wait = asyncio.wrap_future(future)
            return await asyncio.wait_for(wait, self.config.timeout_s + _GRACE_S)
        except TimeoutError:
            future.cancel()
            return _timeout(name, self.config.timeout_s)

    def _submit(
        self, name: str, arguments: Mapping[str, Any] | None
    ) -> concurrent.futures.Future[ToolResult] | ToolResult:
        """The call scheduled on the connection's loop, or the error when it is closed."""
        loop = self._loop
        if loop is None or self._closed:
            return _mcp_error(self.config, name, "the connection is closed")
        call = self._call(name, arguments, self.config.timeout_s)
        return asyncio.run_coroutine_threadsafe(call, loop)

    # ------------------------------------------------------------------ on the loop

    async def _connect(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        ready: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._holder = asyncio.create_task(self._hold(ready, self._stop))
        try:
            self._listed = await asyncio.wait_for(
                asyncio.shield(ready), self.config.connect_timeout_s
            )
        except BaseException:
            await self._disconnect()
            raise

    async def _hold(self, ready: asyncio.Future[list[Any]], stop: asyncio.Event) -> None:
        """Keep the client open (its anyio scopes live in this one task) until ``stop``."""
        from mcp import Client  # noqa: PLC0415  mcp is an optional extra, checked on connect

        try:
            async with Client(self._server(), mode="auto") as client:
                listed = await _list_all(client)
                self._client = client
                if not ready.done():
                    ready.set_result(listed)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._client = None

    def _server(self) -> Any:
        from mcp import StdioServerParameters  # noqa: PLC0415  mcp is an optional extra

        if self.config.url is not None:
            return self.config.url
        assert self.config.command is not None
        return StdioServerParameters(
            command=self.config.command[0],
            args=list(self.config.command[1:]),
            env=dict(self.config.env) or None,
            cwd=self.config.cwd,
        )

    async def _disconnect(self) -> None:
        holder, stop = self._holder, self._stop
        self._holder = None
        if stop is not None:
            stop.set()
        if holder is not None:
            try:
                await asyncio.wait_for(holder, 10)
            except BaseException:
                holder.cancel()
                with contextlib.suppress(BaseException):
                    await holder
        self._client = None

    async def _call(
        self, name: str, arguments: Mapping[str, Any] | None, timeout: float
    ) -> ToolResult:
        from mcp import MCPError  # noqa: PLC0415  mcp is an optional extra
        from mcp_types import (  # noqa: PLC0415  part of the optional mcp extra
            CONNECTION_CLOSED,
            REQUEST_TIMEOUT,
        )

        assert self._lock is not None
        client = self._client
        if client is None or self._holder is None or self._holder.done():
            async with self._lock:  # one reconnection for the calls that find it down
                if self._client is None or self._holder is None or self._holder.done():
                    try:
                        await self._disconnect()
                        await self._connect()
                    except Exception as exc:
                        return _mcp_error(
                            self.config, name, f"reconnecting failed: {_describe(exc)}"
                        )
                client = self._client
        try:
            result = await asyncio.wait_for(
                client.call_tool(name, dict(arguments or {}), read_timeout_seconds=timeout),
                timeout,
            )
        except TimeoutError:
            return _timeout(name, timeout)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                return _timeout(name, timeout)
            if exc.code == CONNECTION_CLOSED:
                await self._drop(client)
                return _mcp_error(self.config, name, f"the connection closed ({exc})")
            return ToolResult(f"Error: {exc}", error="tool_exception")
        except Exception as exc:  # the transport broke: the server crashed or went away
            await self._drop(client)
            return _mcp_error(self.config, name, _describe(exc))
        return result_to_tool_result(result)

    async def _drop(self, client: Any) -> None:
        """Forget a broken client, so that the next call reconnects."""
        assert self._lock is not None
        async with self._lock:
            if self._client is client:
                await self._disconnect()

    # ------------------------------------------------------------------ tools

    def _make_tools(self, listed: list[Any]) -> list[MCPTool]:
        cfg = self.config
        by_name = {t.name: t for t in listed}
        if cfg.tools is not None:
            missing = [n for n in cfg.tools if n not in by_name]
            if missing:
                raise ConfigError(
                    f"MCP server {cfg.label!r} has no tool(s) {missing}; it lists "
                    f"{sorted(by_name)}: fix 'tools' in its config"
                )
            listed = [by_name[n] for n in cfg.tools]
        out: list[MCPTool] = []
        seen: dict[str, str] = {}
        for item in listed:
            name = cfg.prefix + item.name
            if not _NAME_RE.match(name):
                raise ConfigError(
                    f"MCP server {cfg.label!r}: tool name {name!r} is not a valid OpenAI tool "
                    "name (letters, digits, '_' and '-', at most 64); leave it out with "
                    "'tools' in the server's config, or shorten 'prefix'"
                )
            if name in seen:
                raise ConfigError(f"MCP server {cfg.label!r} lists tool {name!r} twice")
            seen[name] = item.name
            schema = dict(item.input_schema or {})
            schema.setdefault("type", "object")
            if schema.get("type") != "object":
                raise ConfigError(
                    f"MCP server {cfg.label!r}: tool {item.name!r} takes a {schema['type']!r}, "
                    "not an object of arguments, which an OpenAI tool cannot; leave it out "
                    "with 'tools' in the server's config"
                )
            out.append(
                MCPTool(
                    name,
                    item.description or item.title or item.name,
                    schema,
                    connection=self,
                    mcp_name=item.name,
                    timeout_s=cfg.timeout_s,
                )
            )
        return out


async def _list_all(client: Any) -> list[Any]:
    """Every tool the server lists, following pagination (at most 100 pages)."""
    tools: list[Any] = []
    cursor = None
    for _ in range(100):
        page = await client.list_tools(cursor=cursor)
        tools += list(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _describe(exc: BaseException) -> str:
    """An exception as one line; an exception group by its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _timeout(name: str, timeout: float) -> ToolResult:
    return ToolResult(f"Error: MCP tool {name!r} timed out after {timeout:g} s", error="timeout")


def _mcp_error(config: MCPServerConfig, name: str, why: str) -> ToolResult:
    return ToolResult(
        f"Error: MCP tool {name!r} failed: server {config.label!r} is unreachable ({why})",
        error="mcp_error",
    )


def result_to_tool_result(result: Any) -> ToolResult:
    """An MCP ``CallToolResult`` as the :class:`ToolResult` the model reads.

    Text content (and embedded text resources) joined by newlines; with no text, the
    structured content as JSON; other blocks named in brackets. ``isError`` makes it an
    ``"Error: ..."`` result of kind ``"tool_exception"``."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[binary resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
        else:
            parts.append(f"[{kind} content]")
    text = "\n".join(parts)
    structured = getattr(result, "structured_content", None)
    if not text and structured is not None:
        text = json.dumps(structured, default=str)
    if getattr(result, "is_error", False):
        text = text or "the tool reported an error"
        if not text.startswith("Error:"):
            text = f"Error: {text}"
        return ToolResult(text, error="tool_exception")
    return ToolResult(text)


# ---------------------------------------------------------------------------- the tool


class MCPTool(Tool):
    """A :class:`Tool` whose call is a ``tools/call`` on an MCP server.

    The model sees ``name`` (the server's name with the config's ``prefix``); the server is
    called with ``mcp_name``. Arguments are validated against the server's input schema
    first, so a model mistake costs no round trip."""

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        *,
        connection: MCPConnection,
        mcp_name: str,
        timeout_s: float | None = None,
        bound: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            name, description, parameters, self._unreachable, timeout_s=timeout_s, bound=bound
        )
        self.connection = connection
        self.mcp_name = mcp_name

    @staticmethod
    def _unreachable(**_: Any) -> Any:
        raise AssertionError("MCPTool calls go through call()/acall()")

    def __repr__(self) -> str:
        return f"MCPTool(name={self.name!r}, server={self.connection.config.label!r})"

    def bind(self, **fixed: Any) -> MCPTool:
        """A copy that always sends these argument values (they leave the schema)."""
        plain = super().bind(**fixed)
        return MCPTool(
            self.name,
            self.description,
            plain.parameters,
            connection=self.connection,
            mcp_name=self.mcp_name,
            timeout_s=self.timeout_s,
            bound=plain._bound,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the server's tool with these keyword arguments; returns its text."""
        if args:
            raise TypeError(f"MCP tool {self.name!r} takes keyword arguments only")
        return self.connection.call(self.mcp_name, {**self._bound, **kwargs}).content

    def call(self, arguments: str | Mapping[str, Any] | None = None) -> ToolResult:
        try:
            kwargs = self._prepare(arguments)
        except _BadArguments as exc:  # a model mistake
            return ToolResult(f"Error: {exc}", error="bad_arguments")
        return self.connection.call(self.mcp_name, kwargs)

    async def acall(self, arguments: str | Mapping[str, Any] | None = None) -> ToolResult:
        try:
            kwargs = self._prepare(arguments)
        except _BadArguments as exc:
            return ToolResult(f"Error: {exc}", error="bad_arguments")
        return await self.connection.acall(self.mcp_name, kwargs)


# ---------------------------------------------------------------------------- sharing

_OPEN: weakref.WeakSet[MCPConnection] = weakref.WeakSet()
_SHARED: dict[MCPServerConfig, MCPConnection] = {}
_SHARED_LOCK = threading.Lock()


def connect(config: MCPServerConfig | Mapping[str, Any], where: str = "mcp") -> MCPConnection:
    """An open connection for ``config``: with ``scope: process`` the process's shared one
    (opened on first use), with ``scope: env`` a new one the caller closes."""
    cfg = MCPServerConfig.parse(config, where)
    if cfg.scope == "env":
        return MCPConnection(cfg).open()
    with _SHARED_LOCK:
        conn = _SHARED.get(cfg)
        if conn is None or conn._closed:
            conn = MCPConnection(cfg).open()
            _SHARED[cfg] = conn
        return conn


def mcp_tools(config: MCPServerConfig | Mapping[str, Any], where: str = "mcp") -> list[Tool]:
    """The tools of the MCP server ``config`` describes (see :func:`connect`).

    For an agent: ``[t.schema for t in tools]`` are the OpenAI tool schemas to offer the
    model, and ``await tool.acall(arguments)`` runs a call the model made."""
    return list(connect(config, where).tools())


def close_shared() -> None:
    """Close the process's shared connections (done at exit too)."""
    with _SHARED_LOCK:
        conns = list(_SHARED.values())
        _SHARED.clear()
    for conn in conns:
        conn.close()


def _close_all() -> None:
    close_shared()
    for conn in list(_OPEN):
        conn.close()


atexit.register(_close_all)
