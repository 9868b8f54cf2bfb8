"""The worker API: agents in other processes pull their episodes' tasks from the trainer.

A :class:`WorkerHub` sits next to the proxy (its routes go on ``proxy.app``) and is an agent
for the :class:`~areal_agents.rollout.runner.Runner`: ``runner.run_group(make_env, n,
agent=hub.remote_agent)``. ``await hub.remote_agent(task)`` queues the episode's
:class:`~areal_agents.rollout.runner.AgentTask`, waits until a worker (``areal_agents.client``,
``areal-agent worker``) has taken it and posted its result, and returns the final answer;
the runner then has the env score the recorded conversation. The trainer decides *when*
tasks are queued (its staleness gate admits a group), workers decide how many they run.

HTTP API (every route needs ``Authorization: Bearer <worker token>``, else a 401; a tool
call also takes its task's ``tool_key``)::

    POST /workers/tasks/next                {worker_id?, wait_s?}   long-poll for a task
         -> {id, session: {id, api_key, base_url}, model, messages, tools, tool_key,
             task_id, group_id, metadata, heartbeat_s, episode_timeout_s}
         or 429 + Retry-After when no task came within wait_s (default 20 s, at most
         max_wait_s): the trainer's staleness gate is full, or it is between steps
    POST /workers/tasks/{id}/heartbeat      -> {ok: true}
    POST /workers/tasks/{id}/tools/{name}   {arguments: str | object}
         -> {content, error}   runs the episode's env tool (error: None or its kind)
    POST /workers/tasks/{id}/result         {final_answer: str | null, error: str | null}

The worker calls the model itself, through the session's ``base_url`` and ``api_key`` (so
every call is recorded on the episode); the session key cannot post rewards (the proxy runs
with ``self_rewarding=False``), and neither can the worker token: the env scores the
episode, so the token reaches the ``/workers`` routes only, and any ``/sessions`` route
answers it 403 (rewards posted by a service are self-rewarded training's,
``rollout.agents: self_rewarded``).

The ``tool_key`` of a task (an HMAC of its id under the worker token, so it tells nothing
about the token) calls that task's tools and nothing else: the worker hands its agent tools
that hold the tool key, not the worker token. That keeps the token out of every object the
agent is given; it is not a boundary against agent code that reads the worker's memory (it
runs in the same process). What holds whatever the agent does is the server's side: no key
a worker holds can post a reward or end an episode of an env-scored run.

A task id the hub never handed out is a 404; a task that already has a result, was declared
lost or was withdrawn is a 409 (its episode is over: drop it). An unknown tool is a 404 that
names the task's tools (``code: "unknown_tool"``, the task itself ``"unknown_task"``).

Loss: a handed-out task with no heartbeat, tool call or result for ``heartbeat_timeout_s``
(a tool call running in the hub counts as alive), or without a result ``episode_timeout_s``
after it was handed out, is declared lost: ``remote_agent`` raises
:class:`~areal_agents.errors.AgentLost` (episode end reason ``"agent_lost"``) saying which and
how long. An ``error`` posted by the worker raises ``AgentError``
(``"agent_error"``). When the waiting ``remote_agent`` is cancelled (the runner's episode
timeout, the trainer dropping the episode) the task is withdrawn: taken out of the queue, or
refused (409) to the worker that holds it. :meth:`WorkerHub.close` ends every waiting call
with ``AgentLost`` and answers polls with a 503.

No background tasks: each waiting ``remote_agent`` call watches its own deadlines, and each
long-poll waits in its own request. The hub is thread-safe: the runner's event loop and the
proxy server's may differ (``ProxyServer`` runs uvicorn on its own thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import math
import numbers
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from areal_agents.errors import AgentError, AgentLost
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.bodies import parse_body as _parse
from areal_agents.serve.openapi import error_responses, json_body
from areal_agents.serve.proxy import Proxy

if TYPE_CHECKING:
    from areal_agents.rollout.runner import AgentTask

__all__ = ["WorkerHub"]

DEFAULT_WAIT_S = 20.0
_QUEUED, _RUNNING, _DONE, _LOST, _WITHDRAWN = "queued", "running", "done", "lost", "withdrawn"
_KEEP_GONE = 10_000  # finished task ids remembered, so late calls get a 409 and not a 404


# ---------------------------------------------------------------------- wire schemas
class NextIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker_id: str | None = None
    wait_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    arguments: str | dict[str, Any] | None = None


class ResultIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    final_answer: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------- the hub
@dataclass(eq=False)
class _Handle:
    """One queued or handed-out task, and the loop of the ``remote_agent`` call awaiting it."""

    id: str
    task: AgentTask
    loop: asyncio.AbstractEventLoop
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    state: str = _QUEUED
    worker_id: str | None = None
    handed_at: float = 0.0
    last_seen: float = 0.0
    busy: int = 0
    """Tool calls of this task running in the hub right now."""
    outcome: tuple[str, str | None] | None = None

    def notify(self) -> None:
        """Wake the awaiting ``remote_agent`` (from any thread)."""
        _call_soon(self.loop, self.changed.set)


class WorkerHub:
    """Hands the runner's agent tasks to workers over HTTP; see the module docstring.

    Args:
        proxy: The proxy whose app gets the ``/workers`` routes (added at construction) and
            a guard that answers the worker token 403 on every ``/sessions`` route.
        token: The worker token.
        heartbeat_timeout_s: A handed-out task silent for this long is lost. Workers are
            told to heartbeat every third of it.
        episode_timeout_s: A handed-out task without a result after this long is lost
            (None: only the runner's own episode timeout applies).
        max_wait_s: The longest long-poll a worker may ask for.
        retry_after_s: The ``Retry-After`` of a poll that found no task.
    """

    def __init__(
        self,
        proxy: Proxy,
        token: str,
        *,
        heartbeat_timeout_s: float = 30.0,
        episode_timeout_s: float | None = None,
        max_wait_s: float = 60.0,
        retry_after_s: float = 1.0,
    ) -> None:
        if not isinstance(token, str) or not token.strip():
            raise ValueError("WorkerHub needs a non-empty worker token (workers send it back)")
        if heartbeat_timeout_s <= 0 or max_wait_s < 0 or retry_after_s < 0:
            raise ValueError("heartbeat_timeout_s must be > 0, max_wait_s and retry_after_s >= 0")
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.proxy = proxy
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.episode_timeout_s = episode_timeout_s
        self.max_wait_s = float(max_wait_s)
        self.retry_after_s = retry_after_s
        self.counters: Counter[str] = Counter()
        """enqueued, handed_out, results, agent_errors, lost, withdrawn, polls, polls_429,
        heartbeats, tool_calls, requeued (a poller that left before its task was sent)."""
        self._token = token.strip()
        self._lock = threading.Lock()
        self._queue: OrderedDict[str, _Handle] = OrderedDict()
        self._running: dict[str, _Handle] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._pollers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False
        self._install()

    # ------------------------------------------------------------------ numbers
    @property
    def queued(self) -> int:
        """Tasks waiting for a worker."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Tasks handed out and not finished."""
        return len(self._running)

    # ------------------------------------------------------------------ the runner's side
    async def remote_agent(self, task: AgentTask) -> str | None:
        """The agent for ``Runner``: a worker runs ``task``; returns its final answer.

        Raises :class:`AgentLost` when the worker goes silent or runs out of time, and
        ``AgentError`` when the worker reports that its agent failed.
        """
        handle = self._enqueue(task)
        try:
            return await self._outcome(handle)
        finally:  # cancelled (or anything else): the worker must not keep the task
            self._finish(handle, _WITHDRAWN, "the trainer withdrew it (its episode was cancelled)")

    def close(self) -> None:
        """Refuse new tasks and polls; every waiting ``remote_agent`` raises ``AgentLost``."""
        with self._lock:
            self._closed = True
            handles = [*self._queue.values(), *self._running.values()]
        for handle in handles:
            self._finish(handle, _LOST, "the worker hub closed (the trainer is shutting down)")
        self._wake_pollers()

    def _enqueue(self, task: AgentTask) -> _Handle:
        if self._closed:
            raise AgentLost("the worker hub is closed: no worker can take this episode")
        handle = _Handle("wtask-" + uuid.uuid4().hex[:16], task, asyncio.get_running_loop())
        self._persist(
            handle,
            session_id=task.session_id,
            task_id=task.task_id,
            group_id=task.group_id,
            created_at=time.time(),
        )
        with self._lock:
            self._queue[handle.id] = handle
            self.counters["enqueued"] += 1
        self._wake_pollers()
        return handle

    async def _outcome(self, handle: _Handle) -> str | None:
        while True:
            handle.changed.clear()
            with self._lock:
                wait = self._check(handle, time.monotonic())
                outcome = handle.outcome
            if outcome is not None:
                kind, text = outcome
                if kind == _DONE:
                    return text
                if kind == "error":
                    raise AgentError(f"the agent raised in worker {handle.worker_id}: {text}")
                raise AgentLost(text or "the worker was lost")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.changed.wait(), wait)

    def _check(self, handle: _Handle, now: float) -> float | None:
        """Declare ``handle`` lost if a deadline passed (lock held); else seconds to wait."""
        if handle.state != _RUNNING:
            return None
        alive_until = (now if handle.busy else handle.last_seen) + self.heartbeat_timeout_s
        deadline = alive_until
        if self.episode_timeout_s is not None:
            ends = handle.handed_at + self.episode_timeout_s
            if now >= ends:
                self._finish_locked(
                    handle,
                    _LOST,
                    f"worker {handle.worker_id} took task {handle.id} {now - handle.handed_at:.1f}"
                    f" s ago and sent no result within episode_timeout_s="
                    f"{self.episode_timeout_s:g} s",
                )
                return None
            deadline = min(deadline, ends)
        if now >= alive_until:
            self._finish_locked(
                handle,
                _LOST,
                f"worker {handle.worker_id} sent no heartbeat, tool call or result for task "
                f"{handle.id} for {now - handle.last_seen:.1f} s (heartbeat_timeout_s="
                f"{self.heartbeat_timeout_s:g} s): it died or hangs",
            )
            return None
        return max(deadline - now, 0.001)

    def _finish(self, handle: _Handle, state: str, message: str | None) -> bool:
        with self._lock:
            return self._finish_locked(handle, state, message)

    def _finish_locked(self, handle: _Handle, state: str, message: str | None) -> bool:
        """Move a queued or running task to its final state; False if it already had one."""
        if handle.state not in (_QUEUED, _RUNNING):
            return False
        self._queue.pop(handle.id, None)
        self._running.pop(handle.id, None)
        if state in (_DONE, "error"):  # a result: the final answer, or the agent's error
            handle.state, handle.outcome = _DONE, (state, message)
            why = f"task {handle.id} already has a result"
            self.counters["results"] += 1
            if state == "error":
                self.counters["agent_errors"] += 1
        else:
            handle.state, handle.outcome = state, (state, message)
            why = f"task {handle.id} is over: {message}"
            self.counters[state] += 1
        self._persist(handle, finished_at=time.time(), message=message)
        self._gone[handle.id] = why
        while len(self._gone) > _KEEP_GONE:
            self._gone.popitem(last=False)
        handle.notify()
        return True

    def _persist(self, handle: _Handle, **values: Any) -> None:
        """Write the task's state to the proxy's episode store, if it has one."""
        store = self.proxy.store
        if store is not None:
            store.put_task(handle.id, state=handle.state, **values)

    # ------------------------------------------------------------------ routes
    def tool_key(self, task_id: str) -> str:
        """The key that calls task ``task_id``'s tools (and nothing else)."""
        digest = hmac.new(self._token.encode(), task_id.encode(), hashlib.sha256).hexdigest()
        return "wtool-" + digest[:48]

    def _install(self) -> None:
        app = self.proxy.app
        app.add_middleware(_SessionsGuard, token=self._token, counters=self.proxy.counters)
        polled = error_responses(400, 401, 413, 429, 503)
        task = error_responses(400, 401, 404, 409, 413)
        app.add_api_route(
            "/workers/tasks/next",
            self.next_task,
            methods=["POST"],
            responses=polled,
            **json_body(app, NextIn, required=False),
        )
        app.add_api_route(
            "/workers/tasks/{task_id}/heartbeat", self.heartbeat, methods=["POST"], responses=task
        )
        app.add_api_route(
            "/workers/tasks/{task_id}/tools/{tool_name}",
            self.call_tool,
            methods=["POST"],
            responses=task,
            **json_body(app, ToolCallIn, required=False),
        )
        app.add_api_route(
            "/workers/tasks/{task_id}/result",
            self.post_result,
            methods=["POST"],
            responses=task,
            **json_body(app, ResultIn),
        )

    def _auth(self, request: Request) -> None:
        key = Proxy._bearer(request) or ""
        if not hmac.compare_digest(key.encode(), self._token.encode()):
            raise ApiError(
                401,
                "the worker API needs 'Authorization: Bearer <worker token>': the token the "
                "trainer's WorkerHub was started with (areal-agent worker --token T, or "
                "$AREAL_WORKER_TOKEN)",
                kind="authentication_error",
            )

    async def next_task(self, request: Request) -> Response:
        self._auth(request)
        body = await _parse(request, NextIn, allow_empty=True)
        wait = min(DEFAULT_WAIT_S if body.wait_s is None else body.wait_s, self.max_wait_s)
        self.counters["polls"] += 1
        handle = await self._take(wait, body.worker_id or "anonymous", request)
        if handle is not None:
            return JSONResponse(self._payload(handle, request))
        if self._closed:
            raise ApiError(503, "the trainer is shutting down; no more tasks", kind="server_error")
        self.counters["polls_429"] += 1
        response = ApiError(
            429,
            f"no task within {wait:g} s: the trainer hands out tasks only while its staleness "
            "gate admits a group (it may be full, or between steps); poll again after "
            "Retry-After seconds",
            kind="rate_limit_error",
            code="no_task",
        ).response()
        response.headers["Retry-After"] = str(math.ceil(self.retry_after_s))
        return response

    async def _take(self, wait_s: float, worker_id: str, request: Request) -> _Handle | None:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                handle = self._pop(worker_id)
                remaining = deadline - time.monotonic()
                if handle is None and (self._closed or remaining <= 0):
                    return None
                if handle is None:
                    waiter: asyncio.Future[None] = loop.create_future()
                    self._pollers.append((loop, waiter))
            if handle is not None:
                if await request.is_disconnected():
                    self._requeue(handle)
                    return None
                handle.notify()
                return handle
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                with self._lock:
                    if (loop, waiter) in self._pollers:
                        self._pollers.remove((loop, waiter))

    def _pop(self, worker_id: str) -> _Handle | None:
        """The oldest queued task, marked handed out (lock held)."""
        if not self._queue:
            return None
        _, handle = self._queue.popitem(last=False)
        now = time.monotonic()
        handle.state, handle.worker_id = _RUNNING, worker_id
        handle.handed_at = handle.last_seen = now
        self._running[handle.id] = handle
        self.counters["handed_out"] += 1
        self._persist(handle, worker_id=worker_id, handed_at=time.time())
        return handle

    def _requeue(self, handle: _Handle) -> None:
        """Put back a task whose poller left before the answer was sent."""
        with self._lock:
            if handle.state != _RUNNING or handle.last_seen != handle.handed_at:
                return
            self._running.pop(handle.id, None)
            handle.state, handle.worker_id = _QUEUED, None
            self._persist(handle, worker_id=None, handed_at=None)
            self._queue[handle.id] = handle
            self._queue.move_to_end(handle.id, last=False)
            self.counters["handed_out"] -= 1
            self.counters["requeued"] += 1
        self._wake_pollers()

    def _wake_pollers(self) -> None:
        with self._lock:
            pollers, self._pollers = self._pollers, []
        for loop, waiter in pollers:
            _call_soon(loop, _resolve, waiter)

    def _payload(self, handle: _Handle, request: Request) -> dict[str, Any]:
        task = handle.task
        base_url = task.base_url
        if urlsplit(base_url).hostname in ("0.0.0.0", "::"):  # serving on every interface:
            base_url = f"{str(request.base_url).rstrip('/')}/v1"  # the address the worker reached
        return {
            "id": handle.id,
            "session": {"id": task.session_id, "api_key": task.api_key, "base_url": base_url},
            "model": task.model,
            "messages": _json_safe(list(task.messages)),
            "tools": [_json_safe(_schema(t)) for t in task.tools],
            "tool_key": self.tool_key(handle.id),
            "task_id": task.task_id,
            "group_id": task.group_id,
            "metadata": _json_safe({k: v for k, v in task.info.items() if k != "tools"}),
            "heartbeat_s": self.heartbeat_timeout_s / 3,
            "episode_timeout_s": self.episode_timeout_s,
        }

    def _live(self, task_id: str) -> _Handle:
        """The handed-out task ``task_id``, touched as alive (lock held); else 404 / 409."""
        handle = self._running.get(task_id)
        if handle is not None:
            handle.last_seen = time.monotonic()
            return handle
        if task_id in self._gone:
            raise ApiError(
                409,
                f"{self._gone[task_id]}; drop it and ask for the next task",
                kind="conflict_error",
                code="task_over",
            )
        raise ApiError(
            404,
            f"no task {task_id!r} was handed out here (the trainer may have restarted); "
            "ask for one with POST /workers/tasks/next",
            kind="not_found_error",
            code="unknown_task",
        )

    async def heartbeat(self, task_id: str, request: Request) -> dict[str, Any]:
        self._auth(request)
        with self._lock:
            self._live(task_id)
            self.counters["heartbeats"] += 1
        return {"ok": True, "id": task_id}

    async def call_tool(self, task_id: str, tool_name: str, request: Request) -> dict[str, Any]:
        key = (Proxy._bearer(request) or "").encode()
        if not hmac.compare_digest(key, self.tool_key(task_id).encode()):
            self._auth(request)
        body = await _parse(request, ToolCallIn, allow_empty=True)
        with self._lock:
            handle = self._live(task_id)
            tools = {getattr(t, "name", None): t for t in handle.task.tools}
            tool = tools.get(tool_name)
            if tool is None:
                names = ", ".join(sorted(str(n) for n in tools)) or "none"
                raise ApiError(
                    404,
                    f"task {task_id} has no tool {tool_name!r}; its tools: {names}",
                    kind="not_found_error",
                    code="unknown_tool",
                )
            handle.busy += 1
            self.counters["tool_calls"] += 1
        try:
            content, error = await _run_tool(tool, body.arguments)
        finally:
            with self._lock:
                handle.busy -= 1
                handle.last_seen = time.monotonic()
        return {"content": content, "error": error}

    async def post_result(self, task_id: str, request: Request) -> dict[str, Any]:
        self._auth(request)
        body = await _parse(request, ResultIn)
        with self._lock:
            handle = self._live(task_id)
            if body.error is not None:
                self._finish_locked(handle, "error", body.error)
            else:
                self._finish_locked(handle, _DONE, body.final_answer)
        return {"ok": True, "id": task_id}


class _SessionsGuard:
    """ASGI middleware: the worker token on a ``/sessions`` route is a 403 (rewards, ends,
    deletes and reads of sessions are not the worker's in an env-scored run)."""

    def __init__(self, app: ASGIApp, token: str, counters: Counter[str]) -> None:
        self.app = app
        self.bearer = f"bearer {token}".encode()
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/sessions"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, rest = given.partition(b" ")
            if hmac.compare_digest(scheme.lower() + b" " + rest.strip(), self.bearer):
                self.counters["http_403"] += 1
                refusal = ApiError(
                    403,
                    "the worker token reaches the /workers routes only: in this run the "
                    "env scores each episode, so no worker posts rewards, ends or deletes "
                    "sessions; post the agent's answer to POST /workers/tasks/{id}/result "
                    "(a service that rewards its own sessions trains with rollout.agents: "
                    "self_rewarded)",
                    kind="permission_error",
                    code="env_scored",
                )
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------- helpers
async def _run_tool(tool: Any, arguments: str | dict[str, Any] | None) -> tuple[str, str | None]:
    """Run an env tool off the event loop (env tools may block); never raises."""
    try:
        fn = getattr(tool, "fn", None)
        if hasattr(tool, "call") and not inspect.iscoroutinefunction(fn):
            result = await asyncio.to_thread(tool.call, arguments)
        else:
            result = await tool.acall(arguments)
    except Exception as exc:
        return f"Error: tool {getattr(tool, 'name', '?')!r} raised {exc!r}", "tool_exception"
    return str(result.content), getattr(result, "error", None)


def _schema(tool: Any) -> Any:
    schema = tool.schema
    return schema() if callable(schema) else schema


def _json_safe(value: Any) -> Any:
    """``value`` as plain JSON (non-finite floats become None, unknown objects strings)."""
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return str(value)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there now
        loop.call_soon_threadsafe(fn, *args)
