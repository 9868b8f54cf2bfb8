"""The worker client: run an agent in its own process (venv, machine), fed by a trainer.

The trainer serves the recording proxy and the worker API of :mod:`areal_agents.rollout.workers`.
An :class:`AgentWorker` long-polls it for tasks, runs the agent on each one (up to
``concurrency`` at once), heartbeats while the agent runs, and posts the final answer (or the
exception text). The agent calls the model itself through the task's session, so every call
is recorded on the episode, and calls the env's tools through the hub: ``task.tools`` are
:class:`RemoteTool` objects with the interface of ``areal_agents.tools.tool.Tool`` (``name``,
``description``, ``parameters``, ``schema``, ``await acall(arguments)``, ``call(arguments)``),
so the agent code written for the in-process ``AgentTask`` runs here unchanged. The tools
call the hub with their task's tool key, not the worker token: nothing the agent is handed
(the task, its tools, the session key) can post a reward or end an episode, and the trainer
refuses the worker token on those routes anyway (the env scores). Agent code runs in the
worker's process, so this keeps the token out of its objects, not out of its reach::

    from areal_agents.client import AgentWorker

    async def agent(task):                     # a WorkerTask
        client = task.openai_client()          # openai.AsyncOpenAI on the session
        reply = await client.chat.completions.create(
            model=task.model, messages=task.messages, tools=[t.schema for t in task.tools]
        )
        ...                                    # await task.tools[0].acall(arguments)
        return reply.choices[0].message.content

    AgentWorker("http://trainer:8000", token).serve_sync(agent)

or from the shell: ``areal-agent worker --connect URL --token T --agent module:factory``.

An agent is an (async) callable taking a :class:`WorkerTask`, or an object with
``async run(task)``; a plain function runs on a thread so that heartbeats go on. The worker
keeps polling through connection errors (the trainer may restart) with backoff, honours the
hub's ``429 Retry-After`` (no task: the trainer's staleness gate is full), stops an agent
whose task the hub declared lost or withdrew, and raises :class:`WorkerError` only for what
retrying cannot fix (a wrong token or URL).

This module imports only the standard library, ``httpx`` and ``tenacity`` (its retries;
``openai`` when a worker starts serving, if it is installed), so a worker needs neither torch
nor the proxy's dependencies::

    pip install --no-deps areal-agents
    pip install httpx openai tenacity

(``requirements/make_venv.sh client DIR`` builds such an environment with pinned versions.)
It sets ``OPENAI_AGENTS_DISABLE_TRACING=1`` when it starts serving: the Agents SDK's tracing
exporter would otherwise send the session key to a public endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from areal_agents.errors import ArealError, UserError

__all__ = [
    "AgentWorker",
    "RemoteTool",
    "RemoteToolResult",
    "TaskGone",
    "TrainerSession",
    "TrainerSessions",
    "WorkerError",
    "WorkerTask",
]

_log = logging.getLogger("areal_agents.client")
_TRACING_ENV = "OPENAI_AGENTS_DISABLE_TRACING"
_FIRST = asyncio.FIRST_COMPLETED
_TOOL_TIMEOUT_S = 900.0  # a tool may run long (a sandbox); the hub counts it as alive


class WorkerError(UserError):
    """The trainer refused the worker in a way retrying cannot fix (token, URL)."""


class TaskGone(ArealError):
    """The hub no longer has this task (declared lost, withdrawn, or the trainer restarted)."""


class _Stop(Protocol):
    def is_set(self) -> bool: ...


# ---------------------------------------------------------------------- the HTTP link
class _Link:
    """The worker's connection to the hub; usable from the worker's loop, other loops and
    threads (the agent's tools may be called from any of them). ``key`` is the bearer it
    sends: the worker token, or for one task's tools only that task's tool key
    (:meth:`for_tools`)."""

    def __init__(self, url: str, key: str, timeout_s: float) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {key}"}
        self.timeout_s = timeout_s
        self.client: httpx.AsyncClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def for_tools(self, tool_key: str | None) -> _Link:
        """The link a task's tools get: a new one with the task's ``tool_key`` (it calls that
        task's tools and nothing else), sharing nothing with this one, so no object the
        agent is handed holds the worker token. Without a tool key (a trainer of an older
        version sends none) the tools use this link."""
        if not tool_key:
            return self
        return _Link(self.url, tool_key, self.timeout_s)

    async def post(
        self, path: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> httpx.Response:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.client is not None and _running_loop() is self.loop:
            return await self.client.post(
                self.url + path, json=body, headers=self._headers, timeout=timeout
            )
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await client.post(self.url + path, json=body, headers=self._headers)

    def post_sync(
        self, path: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> httpx.Response:
        with httpx.Client(timeout=self.timeout_s if timeout_s is None else timeout_s) as client:
            return client.post(self.url + path, json=body, headers=self._headers)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _error_of(response: httpx.Response) -> tuple[str, str | None]:
    """(message, code) of an OpenAI-format error response."""
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text), error.get("code")
    except (ValueError, AttributeError):
        return response.text or f"HTTP {response.status_code}", None


# ---------------------------------------------------------------------- tasks and tools
@dataclass(frozen=True)
class RemoteToolResult:
    """What a tool call returned (``areal_agents.tools.tool.ToolResult``'s fields)."""

    content: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RemoteTool:
    """An env tool of one task, run by the hub (duck-types ``areal_agents.tools.tool.Tool``).

    A model mistake (bad arguments, an unknown tool) is a result with ``error`` set, as with
    a local tool; :class:`TaskGone` is raised when the task is over.
    """

    def __init__(self, schema: dict[str, Any], task_id: str, link: _Link) -> None:
        function = schema.get("function") or {}
        self.name: str = str(function.get("name", ""))
        self.description: str = str(function.get("description") or "")
        self.parameters: dict[str, Any] = dict(
            function.get("parameters") or {"type": "object", "properties": {}}
        )
        self._schema = schema
        self._path = f"/workers/tasks/{task_id}/tools/{self.name}"
        self._link = link

    def __repr__(self) -> str:
        params = list(self.parameters.get("properties", {}))
        return f"RemoteTool(name={self.name!r}, parameters={params})"

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema (as ``Tool.schema``)."""
        return self._schema

    async def acall(self, arguments: str | dict[str, Any] | None = None) -> RemoteToolResult:
        """Run the tool on the model's arguments (a JSON string or a dict)."""
        post = AsyncRetrying(  # a request that was never sent is safe to repeat
            retry=retry_if_exception_type((httpx.ConnectError, httpx.ConnectTimeout)),
            stop=stop_after_attempt(4),
            wait=wait_exponential(multiplier=0.5),  # 0.5, 1, 2 s
            reraise=True,
        )
        body = {"arguments": arguments}
        try:
            response: httpx.Response = await post(
                self._link.post, self._path, body, timeout_s=_TOOL_TIMEOUT_S
            )
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        return self._result(response)

    def call(self, arguments: str | dict[str, Any] | None = None) -> RemoteToolResult:
        """Blocking :meth:`acall`, for agents that call tools synchronously (from a thread)."""
        try:
            response = self._link.post_sync(
                self._path, {"arguments": arguments}, timeout_s=_TOOL_TIMEOUT_S
            )
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        return self._result(response)

    def _unreachable(self, exc: Exception) -> TaskGone:
        return TaskGone(f"tool {self.name!r}: the trainer did not answer ({exc!r})")

    def _result(self, response: httpx.Response) -> RemoteToolResult:
        if response.status_code == 200:
            data = response.json()
            return RemoteToolResult(str(data.get("content", "")), data.get("error"))
        message, code = _error_of(response)
        if code == "unknown_tool":
            return RemoteToolResult(f"Error: {message}", "unknown_tool")
        if response.status_code == 400:  # a body the hub cannot read: the model's arguments
            return RemoteToolResult(f"Error: {message}", "bad_arguments")
        raise TaskGone(message)


@dataclass
class WorkerTask:
    """One episode's task, as a worker gets it (the fields of ``runner.AgentTask``)."""

    id: str
    """The hub's handle of this task (not the env's ``task_id``)."""
    session_id: str
    api_key: str
    """The session's key: model calls with it are recorded on the episode."""
    base_url: str
    """The proxy's OpenAI ``/v1`` URL."""
    model: str
    messages: list[dict[str, Any]]
    tools: list[RemoteTool]
    task_id: str | None = None
    group_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """The env's reset info, without the tools."""
    heartbeat_s: float = 10.0
    episode_timeout_s: float | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        return self.info

    def openai_client(self, **kwargs: Any) -> Any:
        """``openai.AsyncOpenAI`` on this task's session."""
        from openai import AsyncOpenAI  # noqa: PLC0415  openai is optional for a worker

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    @classmethod
    def from_json(cls, data: dict[str, Any], link: _Link) -> WorkerTask:
        """The task the hub sent; its tools call the hub with the task's ``tool_key``."""
        session = data["session"]
        tools_link = link.for_tools(data.get("tool_key"))
        return cls(
            id=data["id"],
            session_id=session["id"],
            api_key=session["api_key"],
            base_url=session["base_url"],
            model=data.get("model") or "",
            messages=list(data.get("messages") or []),
            tools=[RemoteTool(s, data["id"], tools_link) for s in data.get("tools") or []],
            task_id=data.get("task_id"),
            group_id=data.get("group_id"),
            info=dict(data.get("metadata") or {}),
            heartbeat_s=float(data.get("heartbeat_s") or 10.0),
            episode_timeout_s=data.get("episode_timeout_s"),
        )


# ---------------------------------------------------------------------- the worker
class AgentWorker:
    """Pulls tasks from a trainer's worker API and runs an agent on them.

    Args:
        url: The trainer's proxy URL (``http://host:port``; a trailing ``/v1`` is dropped).
        token: The worker token the trainer was started with.
        concurrency: Tasks run at once.
        wait_s: How long one poll waits for a task (the hub caps it).
        worker_id: A name for the trainer's logs (default: host-pid-random).
        request_timeout_s: Timeout of heartbeats, tool calls and results.
        max_backoff_s: The longest pause between retries while the trainer is unreachable.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        concurrency: int = 1,
        wait_s: float = 20.0,
        worker_id: str | None = None,
        request_timeout_s: float = 60.0,
        max_backoff_s: float = 10.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if not token:
            raise ValueError("AgentWorker needs the trainer's worker token")
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.concurrency = concurrency
        self.wait_s = wait_s
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.max_backoff_s = max_backoff_s
        self.counters: Counter[str] = Counter()
        """polls, polls_429, tasks, results, agent_errors, gone, connect_errors."""
        self._link = _Link(self.url, token, request_timeout_s)

    def serve_sync(
        self, fn: Any, *, max_tasks: int | None = None, stop: _Stop | None = None
    ) -> int:
        """:meth:`serve` on a new event loop; returns the number of results posted."""
        return asyncio.run(self.serve(fn, max_tasks=max_tasks, stop=stop))

    async def serve(
        self, fn: Any, *, max_tasks: int | None = None, stop: _Stop | None = None
    ) -> int:
        """Run tasks until ``stop.is_set()`` (a ``threading.Event`` or ``asyncio.Event``) or
        ``max_tasks`` tasks were taken, then wait for the running ones; returns the number of
        results posted. Raises :class:`WorkerError` for a wrong token or URL."""
        os.environ.setdefault(_TRACING_ENV, "1")
        _preload_openai()
        run = getattr(fn, "run", fn)
        if not callable(run):
            raise TypeError(f"an agent is a callable or has run(task), got {type(fn).__name__}")
        stopped = asyncio.Event()
        watcher = asyncio.create_task(_watch(stop, stopped))
        stop_wait = asyncio.create_task(stopped.wait())
        running: set[asyncio.Task[bool]] = set()
        taken, before = 0, self.counters["results"]
        async with httpx.AsyncClient(timeout=self._link.timeout_s) as client:
            self._link.client, self._link.loop = client, asyncio.get_running_loop()
            try:
                while not stopped.is_set() and (max_tasks is None or taken < max_tasks):
                    if len(running) >= self.concurrency:
                        await asyncio.wait({*running, stop_wait}, return_when=_FIRST)
                        continue
                    task = await self._next_or_stop(stop_wait)
                    if task is None:
                        continue
                    taken += 1
                    job = asyncio.create_task(self._run_task(run, task))
                    running.add(job)
                    job.add_done_callback(running.discard)
                await asyncio.gather(*running)
            except BaseException:
                for job in running:
                    job.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                raise
            finally:
                self._link.client = self._link.loop = None
                for helper in (watcher, stop_wait):
                    helper.cancel()
                await asyncio.gather(watcher, stop_wait, return_exceptions=True)
        return self.counters["results"] - before

    # ------------------------------------------------------------------ polling
    async def _next_or_stop(self, stop_wait: asyncio.Task[Any]) -> WorkerTask | None:
        poll = asyncio.create_task(self._next_task())
        try:
            await asyncio.wait({poll, stop_wait}, return_when=_FIRST)
        finally:  # stopped, or serve() itself cancelled: the poll ends with it
            if not poll.done():
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll
        if poll.cancelled():
            return None
        return poll.result()

    async def _next_task(self) -> WorkerTask:
        """The next task; retries until one comes (raises WorkerError if it never can)."""
        polls = AsyncRetrying(  # for ever: the trainer may restart
            retry=retry_if_exception_type(httpx.TransportError)
            | retry_if_result(lambda r: r.status_code == 429 or r.status_code >= 500),
            wait=_Backoff(self.max_backoff_s),
            before_sleep=self._before_next_poll,
        )
        r: httpx.Response = await polls(self._poll)
        if r.status_code == 200:
            task = WorkerTask.from_json(r.json(), self._link)
            self.counters["tasks"] += 1
            return task
        message, _ = _error_of(r)
        if r.status_code in (401, 403):
            raise WorkerError(f"the trainer at {self.url} refused the worker token: {message}")
        if r.status_code == 404:
            raise WorkerError(
                f"{self.url} has no worker API (POST /workers/tasks/next answered 404): "
                "connect to the URL of the trainer's proxy"
            )
        raise WorkerError(f"the trainer refused the poll ({r.status_code}): {message}")

    async def _poll(self) -> httpx.Response:
        self.counters["polls"] += 1
        body = {"worker_id": self.worker_id, "wait_s": self.wait_s}
        timeout_s = self.wait_s + self._link.timeout_s
        return await self._link.post("/workers/tasks/next", body, timeout_s=timeout_s)

    def _before_next_poll(self, state: RetryCallState) -> None:
        outcome, pause = state.outcome, state.next_action.sleep if state.next_action else 0.0
        assert outcome is not None
        if outcome.failed:
            self.counters["connect_errors"] += 1
            _log.warning(
                "cannot reach %s (%s); retrying in %.1f s", self.url, outcome.exception(), pause
            )
        elif (r := outcome.result()).status_code == 429:
            self.counters["polls_429"] += 1
        else:
            _log.warning("the trainer answered %s (%s); retrying", r.status_code, _error_of(r)[0])

    # ------------------------------------------------------------------ one task
    async def _run_task(self, run: Any, task: WorkerTask) -> bool:
        """Run the agent on ``task`` with heartbeats; True when its result was accepted."""
        work = asyncio.ensure_future(_call_agent(run, task))
        beat = asyncio.create_task(self._heartbeats(task))
        try:
            await asyncio.wait({work, beat}, return_when=_FIRST)
        except asyncio.CancelledError:
            for t in (work, beat):
                t.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(
                    self._post(task, None, "the worker stopped before the agent finished"), 2.0
                )
            raise
        if not work.done():  # the hub no longer has the task: stop the agent
            self.counters["gone"] += 1
            work.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await work
            return False
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        try:
            answer = work.result()
        except TaskGone as exc:
            self.counters["gone"] += 1
            _log.warning("task %s is over: %s", task.id, exc)
            return False
        except Exception as exc:
            self.counters["agent_errors"] += 1
            _log.warning("the agent raised on task %s: %r", task.id, exc)
            return await self._post(task, None, f"{type(exc).__name__}: {exc}")
        return await self._post(task, answer, None)

    async def _heartbeats(self, task: WorkerTask) -> None:
        """Heartbeat until cancelled; returns when the hub says the task is over."""
        path = f"/workers/tasks/{task.id}/heartbeat"
        while True:
            await asyncio.sleep(task.heartbeat_s)
            try:
                r = await self._link.post(path, {})
            except httpx.TransportError as exc:
                _log.warning("heartbeat of task %s failed (%s)", task.id, exc)
                continue
            if r.status_code in (404, 409):
                _log.warning("the hub stopped task %s: %s", task.id, _error_of(r)[0])
                return

    async def _post(self, task: WorkerTask, answer: str | None, error: str | None) -> bool:
        """Post the result, retrying connection errors while the hub may still wait for it."""
        post = AsyncRetrying(
            retry=retry_if_exception_type(httpx.TransportError),
            stop=stop_after_delay(max(10.0, 3 * task.heartbeat_s)),
            wait=_Backoff(self.max_backoff_s),
            reraise=True,
        )
        body = {"final_answer": answer, "error": error}
        try:
            r: httpx.Response = await post(
                self._link.post, f"/workers/tasks/{task.id}/result", body
            )
        except httpx.TransportError as exc:
            _log.error("cannot post the result of task %s: %s", task.id, exc)
            return False
        if r.status_code == 200:
            self.counters["results"] += 1
            return True
        _log.warning("the result of task %s was refused: %s", task.id, _error_of(r)[0])
        return False


# ---------------------------------------------------------------------- helpers
async def _call_agent(run: Any, task: WorkerTask) -> str | None:
    """Await an async agent; run a plain one on a thread (the loop keeps heartbeating)."""
    if _is_async(run):
        result = await run(task)
    else:
        result = await _in_thread(run, task)
        if inspect.isawaitable(result):
            result = await result
    if result is None or isinstance(result, str):
        return result
    return str(result)


async def _in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a daemon thread: an agent that hangs never blocks the exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="areal-agent-task", daemon=True).start()
    return await future


def _preload_openai() -> None:
    """Import openai now, before any task: a first import inside an agent would hold up the
    event loop (and so the heartbeats) for a second or more."""
    with contextlib.suppress(ImportError):
        import openai  # noqa: F401, PLC0415  openai is optional for a worker


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004  (an object with async __call__)
    )


async def _watch(stop: _Stop | None, stopped: asyncio.Event) -> None:
    if stop is None:
        return
    while not stop.is_set():
        await asyncio.sleep(0.05)
    stopped.set()


# ---------------------------------------------------------------------- self-rewarded
@dataclass(frozen=True)
class TrainerSession:
    """A session opened for a self-rewarded run: the agent calls the model with ``api_key``
    at ``base_url``; rewards and the end go through :class:`TrainerSessions`."""

    id: str
    api_key: str
    base_url: str
    group: str

    def openai_client(self, **kwargs: Any) -> Any:
        """``openai.AsyncOpenAI`` on this session (needs the ``openai`` package)."""
        from openai import AsyncOpenAI  # noqa: PLC0415  openai is optional for a worker

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


class TrainerSessions:
    """The service side of a self-rewarded run (``rollout.agents: self_rewarded``): open a
    session per episode under a ``group`` (the trainer trains on groups of
    ``rollout.group_size`` sessions that answer the same request), let the agent call the
    model with the session's key, post its rewards and end it::

        sessions = TrainerSessions("http://trainer:8000", token)
        s = await sessions.open(group="req-17", task_id="req-17")
        answer = await my_agent(s.openai_client(), request)
        await sessions.reward(s, score(answer), final=True)
        await sessions.end(s)

    :meth:`open` waits while the trainer has no room for a new group (429 + Retry-After:
    its staleness gate) up to ``wait_s``; other refusals raise :class:`WorkerError` (a wrong
    token) or :class:`TaskGone` (the group is full or finished; the session has ended).

    Args:
        url: The trainer's proxy URL (``http://host:port``; a trailing ``/v1`` is dropped).
        token: The worker token the trainer was started with.
        request_timeout_s: Timeout of one request.
    """

    def __init__(self, url: str, token: str, *, request_timeout_s: float = 60.0) -> None:
        if not token:
            raise ValueError("TrainerSessions needs the trainer's worker token")
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self._link = _Link(self.url, token, request_timeout_s)

    async def open(
        self,
        group: str,
        *,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        wait_s: float = 600.0,
    ) -> TrainerSession:
        """A new session in ``group``, once the trainer admits it (see the class)."""
        body: dict[str, Any] = {"group": group, "task_id": task_id, "metadata": metadata}
        deadline = time.monotonic() + wait_s
        while True:
            response = await self._link.post("/sessions", body)
            if response.status_code == 200:
                data = response.json()
                return TrainerSession(data["id"], data["api_key"], data["base_url"], group)
            message, _ = _error_of(response)
            left = deadline - time.monotonic()
            if response.status_code == 429 and left > 0:
                await asyncio.sleep(min(_retry_after(response, 30.0), left))
                continue
            raise self._refused(response, f"POST /sessions (group {group!r})", message)

    async def reward(
        self,
        session: TrainerSession | str,
        value: float,
        *,
        completion_id: str | None = None,
        final: bool = False,
    ) -> None:
        """Reward the session's latest completion, ``completion_id``, or (``final``) the
        whole episode."""
        body = {"value": value, "completion_id": completion_id, "final": final}
        await self._manage(session, "rewards", body)

    async def end(
        self,
        session: TrainerSession | str,
        *,
        final_reward: float | None = None,
        reason: str | None = None,
    ) -> None:
        """End the episode: the trainer takes it (no reward after this). ``reason`` other
        than terminated / truncated marks it failed (dropped from training, counted)."""
        await self._manage(session, "end", {"final_reward": final_reward, "reason": reason})

    async def _manage(self, session: TrainerSession | str, what: str, body: dict[str, Any]) -> None:
        sid = session if isinstance(session, str) else session.id
        payload = {k: v for k, v in body.items() if v is not None}
        response = await self._link.post(f"/sessions/{sid}/{what}", payload)
        if response.status_code != 200:
            message, _ = _error_of(response)
            raise self._refused(response, f"POST /sessions/{sid}/{what}", message)

    @staticmethod
    def _refused(response: httpx.Response, what: str, message: str) -> ArealError:
        if response.status_code in (404, 409):
            return TaskGone(f"{what}: {message}")
        return WorkerError(f"{what} answered {response.status_code}: {message}")


class _Backoff:
    """A tenacity wait: pauses doubling from 0.5 s up to ``cap`` while the trainer is
    unreachable or failing; a 429 (no task for now) waits its Retry-After and starts the
    doubling over."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.next = 0.5

    def __call__(self, state: RetryCallState) -> float:
        outcome = state.outcome
        if outcome is not None and not outcome.failed and outcome.result().status_code == 429:
            self.next = 0.5
            return _retry_after(outcome.result(), self.cap)
        pause, self.next = self.next, min(self.next * 2, self.cap)
        return pause


def _retry_after(response: httpx.Response, cap: float) -> float:
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.0), cap)
    except ValueError:
        return 1.0
