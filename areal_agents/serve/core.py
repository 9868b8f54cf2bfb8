"""The in-process proxy: a model call's life and its sessions'.

:class:`ProxyCore` (a layer of :class:`~areal_agents.serve.proxy.Proxy`, over the context
policy of :mod:`areal_agents.serve.fitting`) generates the answer to a chat completion
request (:meth:`~ProxyCore.reply`), records it into its session once the answer is on its
way (:meth:`~ProxyCore.record`; a session that ended or was deleted meanwhile gets a 409
and nothing is recorded) and waits for the store to commit it (:meth:`~ProxyCore.commit`); a
call whose client disconnects first is cancelled and not recorded
(:meth:`~ProxyCore.until_disconnect`).
In-process callers use :meth:`~ProxyCore.complete`, which does all of it.

Sessions: held in memory by the :class:`~areal_agents.serve.session.SessionStore`, written
through to the durable :class:`~areal_agents.serve.store.EpisodeStore` when there is one,
restored from it on first use of their key or id (``restore``), and ended as ``expired``
once idle past ``session_idle_s``. :class:`SessionHooks` see the sessions opened from
outside (self-rewarded training).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import Request

from areal_agents.errors import SessionError
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.bodies import validate
from areal_agents.serve.fitting import ContextFitting
from areal_agents.serve.generation import message_dict
from areal_agents.serve.schemas import ChatCompletionRequest, SessionCreate
from areal_agents.serve.session import Session
from areal_agents.trajectory import Completion

if TYPE_CHECKING:
    from areal_agents.serve.store import EpisodeStore

T = TypeVar("T")


class SessionHooks(Protocol):
    """What takes sessions opened from outside (see :mod:`areal_agents.serve.proxy`). Called
    in the proxy's event loop; ``admit`` refuses a session by raising :class:`ApiError`."""

    def admit(self, body: SessionCreate) -> None: ...

    def opened(self, session: Session) -> None: ...

    def ended(self, session: Session) -> None: ...


@dataclass
class Reply:
    """A generated answer (``body``, the OpenAI response) and its completions, recorded into
    ``session`` by :meth:`ProxyCore.record` once the answer is on its way."""

    session: Session | None
    body: dict[str, Any]
    pending: list[Completion] = field(default_factory=list)


class ProxyCore(ContextFitting):
    """Model calls recorded into sessions, and the sessions' store (see the module
    docstring); the attributes below are set by :class:`~areal_agents.serve.proxy.Proxy`."""

    model_name: str
    store: EpisodeStore | None
    session_hooks: SessionHooks | None
    session_idle_s: float | None
    _swept: float
    """When :meth:`_sweep` last looked for idle sessions (``time.monotonic``)."""

    # ------------------------------------------------------------------ a model call
    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work`` unless the client disconnects first: then it is cancelled (the
        engine drops its generation) and nothing is recorded (``abandoned_calls``)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        self.counters["abandoned_calls"] += 1
        raise ApiError(499, "the client closed the connection", code="client_closed")

    async def complete(
        self,
        session: Session | None,
        request: ChatCompletionRequest | dict[str, Any],
        *,
        agent: str | None = None,
    ) -> dict[str, Any]:
        """One chat completion, recorded into ``session`` (None: not recorded); ``agent``
        names the agent that made the call (:attr:`Completion.agent`).

        In-process callers (the episode runner) use this; the HTTP endpoints use
        :meth:`reply` and :meth:`commit`, so that a call is recorded only once its answer
        is on its way. Raises :class:`ApiError` for anything the caller must fix.
        """
        reply = await self.reply(session, request, agent=agent)
        self.record(reply)
        return reply.body

    async def reply(
        self,
        session: Session | None,
        request: ChatCompletionRequest | dict[str, Any],
        *,
        agent: str | None = None,
    ) -> Reply:
        """Generate the answer to one chat completion request, not yet recorded."""
        if session is not None and session.deleted:
            raise ApiError(
                409,
                f"session {session.id} was deleted; open a new session",
                kind="conflict_error",
                code="session_deleted",
            )
        if session is not None and session.closed:
            raise ApiError(
                409, f"session {session.id} has ended; open a new session", kind="conflict_error"
            )
        req = request if isinstance(request, ChatCompletionRequest) else validate(request)
        messages = [message_dict(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        rendered = tools if req.tool_choice != "none" else None
        fitted = await self._fit(session, messages, rendered, req, agent)
        prompt_ids = fitted.ids
        params = self._sampling(req, len(prompt_ids), session)
        self.counters["chat_calls"] += 1
        started = time.time()
        results = await self._generate(session, prompt_ids, params, req.n)
        base_id = "chatcmpl-" + uuid.uuid4().hex[:24]
        tool_names = [t["function"]["name"] for t in tools or []]
        choices, pending = [], []
        for i, result in enumerate(results):
            cid = base_id if req.n == 1 else f"{base_id}-{i}"
            choice, completion = self._choice(
                i, cid, result, req, messages, tools, tool_names, prompt_ids, params, started
            )
            choices.append(choice)
            completion.agent = agent
            completion.context_rewrite, completion.context_edits = fitted.rewrite, fitted.edits
            pending.append(completion)
        pending[:0] = fitted.summaries  # recorded first: each one's completion follows it
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": sum(len(r.output_ids) for r in results),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {
            "id": base_id,
            "object": "chat.completion",
            "created": int(started),
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }
        return Reply(session, body, pending)

    def record(self, reply: Reply) -> None:
        """Record a reply's completions into its session.

        A session that ended while the call was in flight (``POST /end`` came first) gets a
        409 and the call is not recorded: what ended an episode is never changed after. A
        session deleted while the call was in flight (``DELETE`` came first) likewise gets a
        409 (``code: "session_deleted"``): a deleted session takes no records."""
        session = reply.session
        if session is None or not reply.pending:
            return
        if session.deleted:
            self.counters["deleted_in_flight"] += 1
            raise ApiError(
                409,
                f"session {session.id} was deleted while this call was in flight: its reply "
                "was not recorded (delete a session only after its last call returned)",
                kind="conflict_error",
                code="session_deleted",
            )
        if session.closed:
            self.counters["ended_in_flight"] += 1
            raise ApiError(
                409,
                f"session {session.id} ended while this call was in flight: its reply was not "
                "recorded (end a session only after its last call returned)",
                kind="conflict_error",
                code="session_ended",
            )
        for completion in reply.pending:
            self.sessions.record(session, completion)
            self.counters["recorded_completions"] += 1
        reply.pending = []

    async def commit(self, reply: Reply) -> None:
        """:meth:`record` and wait until the store has committed it."""
        self.record(reply)
        if reply.session is not None:
            await self._sync_store()

    async def _commit_before_done(self, reply: Reply) -> dict[str, Any] | None:
        """For a stream: commit just before ``[DONE]``; an error event if that fails."""
        try:
            await self.commit(reply)
        except ApiError as exc:
            return exc.body()
        return None

    # ------------------------------------------------------------------ sessions and the store
    async def _session_of_key(self, key: str) -> Session | None:
        """The session whose key is ``key``: held in memory, else restored from the store."""
        session = self.sessions.by_key(key)
        if session is None and self.sessions.restore:
            await self._sync_store()
            fetched = await asyncio.to_thread(self.sessions.fetch_key, key)
            session = None if fetched is None else self.sessions.adopt(fetched)
        if session is not None:
            self._sweep()
        return session

    async def _session_by_id(self, session_id: str) -> Session:
        try:
            return self.sessions.get(session_id)
        except SessionError as exc:
            if self.sessions.restore:
                await self._sync_store()
                fetched = await asyncio.to_thread(self.sessions.fetch, session_id)
                if fetched is not None:
                    return self.sessions.adopt(fetched)
            raise ApiError(404, str(exc), kind="not_found_error") from None

    async def _sync_store(self) -> None:
        """Wait for the store's queued writes (so that a read sees them); a 503 if it fails."""
        if self.store is None:
            return
        try:
            await self.store.flush()
        except Exception as exc:
            self.counters["store_errors"] += 1
            raise ApiError(
                503,
                f"the episode store failed to commit: {exc}; retry, and check the store "
                f"({self.store!r})",
                kind="server_error",
                code="store_error",
            ) from None

    def _sweep(self) -> None:
        """End sessions idle past ``session_idle_s`` (checked at most every 1/10 of it)."""
        idle = self.session_idle_s
        now = time.monotonic()
        if idle is None or now - self._swept < idle / 10:
            return
        self._swept = now
        for session in self.sessions.expire(idle):
            self.counters["sessions_expired"] += 1
            if self.session_hooks is not None:
                self.session_hooks.ended(session)
        if self.store is not None and self.sessions.restore:
            store = self.store

            def expire_stored() -> None:  # sessions of earlier processes, not held here
                self.counters["sessions_expired"] += len(store.expire(idle))

            asyncio.get_running_loop().run_in_executor(None, expire_stored)


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` (its body already read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
