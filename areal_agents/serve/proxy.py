"""The recording OpenAI-compatible proxy.

Agents call ``POST /v1/chat/completions`` with a per-session API key; the proxy applies the
model's chat template itself, sends the prompt token ids to the engine (token in, token out),
parses tool calls out of the generated text, answers in the OpenAI format (optionally as
server-sent events), and records the call as a :class:`~areal_agents.trajectory.Completion`
of that session's episode. Text is never re-tokenized for training.

HTTP API::

    GET  /health                        engine health, session count (no auth)
    GET  /metrics                       call and error counters (no auth)
    GET  /v1/models                     the served model
    POST /v1/chat/completions           session key (recorded) or admin key (not recorded)
    POST /v1/responses                  the Responses API, recorded the same way (responses.py)
    POST /sessions                      -> {id, api_key, base_url}; admin key if configured
    GET  /sessions/{id}                 summary;            session key or admin key
    POST /sessions/{id}/rewards         {value, completion_id | tool_call_id | final}
    POST /sessions/{id}/end             {final_reward?, reason?, error?}
    GET  /sessions/{id}/trajectory?gamma=G[&prompts=delta][&offset=O&limit=L]
                                        the episode with returns (and, whole and full,
                                        its training samples); ``prompts=delta`` is
                                        O(tokens) for long episodes (Episode.to_dict)
    DELETE /sessions/{id}               forget the session (a store keeps it, marked deleted)

A missing key, or a key that reaches nothing, is the same 401 whether or not the session it
names exists; a session's key asking for another session (existing or not) is a 403; the
admin and privileged keys get a 404 for an unknown session; a malformed body is a 400 whose
message names the field; nothing a client sends produces a 500. Before anything is parsed or
stored, every JSON body is checked against :class:`RequestLimits`: over the size limit a
413; nested deeper than 64 levels, a lone UTF-16 surrogate in any string or key, ``NaN`` or
``Infinity``, or an integer outside 64 bits, a 400 naming the field. FastAPI's own
validation errors (a query parameter of the wrong type) are 400s with the same error body,
and ``/openapi.json`` documents each route's body and error answers.

Durability (``store``, an :class:`~areal_agents.serve.store.EpisodeStore`): every session,
completion, reward and end is written through to the store, and each request waits until its
records are committed before it is answered (for a stream, before ``[DONE]``), so nothing a
client was told survives only in memory. With ``restore=True`` a session this process does
not hold (a restart, or one evicted after it ended) is loaded from the store on first use of
its key or id: its key works, its trajectory is complete, rewards can still be posted.
``session_idle_s`` ends sessions idle that long as ``expired`` (they stay in the store).

Context that outgrows the window (``context_policy``, a
:class:`~areal_agents.serve.context.ContextPolicy`): by default a prompt of ``max_context`` tokens
or more is a 400 ``context_length_exceeded``; ``truncate_tool_results`` replaces the oldest
tool results by a marker and ``summarize`` has the model summarize the older turns, once a
prompt would not leave ``reserve_tokens`` free. The completion keeps the client's messages
(for its parent link), the edits sent instead and the tokens actually sampled from; see
:mod:`areal_agents.serve.context`.

Calls that do not finish normally:

* A client that disconnects before its answer is ready cancels the call: the engine drops the
  generation and nothing is recorded (``abandoned_calls``). A stream's events go out only
  once it is generated; it is recorded just before ``[DONE]``, so a stream dropped while its
  events are written is not recorded, and one the server finished writing is (as far as
  the server can tell, it was delivered).
* A call still in flight when its session ends (``POST /end``) is answered 409
  (``code: "session_ended"``) and not recorded: what ended an episode is never changed after.

Key permissions: with ``self_rewarding=True`` (the default, ``areal-agent serve``) a session's
own key may also post rewards to, end and delete its session. With ``self_rewarding=False``
(training, where the environment scores the episode) a session key may only call the model
and read its session and trajectory; ``/rewards``, ``/end`` and ``DELETE`` then need the admin
key or a privileged key (``privileged_keys``; the worker hub registers its token there), and a
session key gets a 403 saying so, so an agent cannot post itself a reward. Privileged keys
reach every session's endpoints, like the admin key, but do not call the model.

Sessions from outside (``session_hooks``): a trainer that trains on whole sessions opened by
a service (self-rewarded training: the service opens a session per episode with a ``group``,
posts its rewards and ends it) plugs a :class:`SessionHooks` in. ``POST /sessions`` then needs
the admin key or a privileged key, the hooks may refuse it (429 with ``Retry-After`` while
the trainer has no room for a new group, 409 for a group that is full), and they see each
session when it opens and when it ends (``/end``, or ``DELETE`` before ``/end``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from areal_agents.engines.protocol import Engine, GenerateResult, SamplingParams, accepts_route_key
from areal_agents.errors import ArealError, BackendError, ContextOverflow, SessionError
from areal_agents.serve import context as ctx
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.context import ContextPolicy
from areal_agents.serve.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    EndIn,
    ErrorBody,
    RewardIn,
    SessionCreate,
    json_text_depth,
)
from areal_agents.serve.session import Session, SessionStore
from areal_agents.serve.toolcall import parse_tool_calls
from areal_agents.trajectory import SUMMARY_CALL, Completion, apply_edits, find_parent

if TYPE_CHECKING:
    from areal_agents.serve.store import EpisodeStore

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


AGENT_HEADER = "X-Areal-Agent"
"""Request header naming the agent that makes a model call (URL-quoted UTF-8)."""


def agent_name(request: Request) -> str | None:
    """The calling agent's name from :data:`AGENT_HEADER`, or None; a 400 when unusable."""
    raw = request.headers.get(AGENT_HEADER)
    if raw is None:
        return None
    from urllib.parse import unquote

    try:
        name = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        name = ""
    if not name.strip() or len(name) > 256 or not name.isprintable():
        raise ApiError(
            400,
            f"header {AGENT_HEADER}: expected an agent name (1-256 printable characters, "
            f"URL-quoted UTF-8), got {raw[:80]!r}",
            param=AGENT_HEADER,
        )
    return name


class SessionHooks(Protocol):
    """What takes sessions opened from outside (see the module docstring). Called in the
    proxy's event loop; ``admit`` refuses a session by raising :class:`ApiError`."""

    def admit(self, body: SessionCreate) -> None: ...

    def opened(self, session: Session) -> None: ...

    def ended(self, session: Session) -> None: ...


class ApiError(ArealError):
    """An error answered to the client in the OpenAI error format (``status`` is its HTTP
    status; raised by :meth:`Proxy.complete` to in-process callers too)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = (
            status,
            message,
            kind,
            code,
            param,
        )
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


@dataclass
class Reply:
    """A generated answer (``body``, the OpenAI response) and its completions, recorded into
    ``session`` by :meth:`Proxy.record` once the answer is on its way."""

    session: Session | None
    body: dict[str, Any]
    pending: list[Completion] = field(default_factory=list)


class Proxy:
    """The proxy: an engine, a tokenizer, the session store and the FastAPI app.

    Example::

        proxy = Proxy(engine, ChatTokenizer.from_dir(model_dir))
        session = proxy.sessions.create()
        # serve proxy.app with uvicorn, then point any OpenAI client at
        # base_url=f"{url}/v1", api_key=session.api_key
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: ChatTokenizer,
        *,
        admin_key: str | None = None,
        model_name: str | None = None,
        public_url: str | None = None,
        default_max_tokens: int = 1024,
        self_rewarding: bool = True,
        privileged_keys: Iterable[str] = (),
        session_hooks: SessionHooks | None = None,
        open_sessions: bool = True,
        store: EpisodeStore | None = None,
        restore: bool = True,
        session_idle_s: float | None = None,
        context_policy: ContextPolicy | dict[str, Any] | str | None = None,
    ) -> None:
        if session_idle_s is not None and not session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0 or None, got {session_idle_s}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.admin_key = admin_key
        self.self_rewarding = self_rewarding
        self.privileged_keys: set[str] = {k for k in privileged_keys if k}
        """Keys that may manage any session (rewards, end, delete), like the admin key."""
        self.session_hooks = session_hooks
        self.open_sessions = open_sessions
        """Whether ``POST /sessions`` is open to any caller (without an admin key); else it
        needs the admin key or a privileged key (training: the trainer opens the sessions).
        With session hooks it is never open."""
        self.model_name = model_name or engine.model_name
        self.public_url = public_url.rstrip("/") if public_url else None
        self.default_max_tokens = default_max_tokens
        context = getattr(engine, "max_context", None) or tokenizer.model_max_length or 32768
        self.max_context = int(context)
        self.context_policy = ContextPolicy.of(context_policy)
        """What a request that would outgrow ``max_context`` gets (:mod:`areal_agents.serve.context`):
        the default ``fail`` answers 400 ``context_length_exceeded``."""
        if bad := self.context_policy.problems(self.max_context):
            raise ValueError("invalid context policy: " + "; ".join(bad))
        self.store = store
        """The durable episode store (None: sessions live in this process only)."""
        self.sessions = SessionStore(store, restore=restore)
        self.session_idle_s = session_idle_s
        """Open sessions idle (no call, reward or read) this long are ended as ``expired``
        (kept in the store); None: never."""
        self._swept = time.monotonic()
        self._routes = accepts_route_key(engine)
        self.counters: Counter[str] = Counter()
        self.app = self._build_app()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="areal-agents proxy", docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, exc: ApiError) -> Response:
            self.counters[f"http_{exc.status}"] += 1
            return exc.response()

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> Response:  # last resort
            self.counters["internal_error"] += 1
            return ApiError(500, f"internal error: {exc!r}", kind="server_error").response()

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> Response:
            self.counters["http_400"] += 1
            return _validation_error(exc.errors()).response()

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, exc: StarletteHTTPException) -> Response:
            self.counters[f"http_{exc.status_code}"] += 1
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            headers = dict(exc.headers or {})
            error = ApiError(exc.status_code, str(exc.detail), kind=kind, headers=headers)
            return error.response()

        self.limits: RequestLimits = getattr(self, "limits", None) or RequestLimits()
        """What a request body may hold (size, nesting); see :class:`RequestLimits`."""
        app.state.request_limits = self.limits
        app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]
        model_call = error_responses(400, 401, 409, 413, 502, 503)
        manage = error_responses(400, 401, 403, 404, 409, 413, 503)
        read = error_responses(400, 401, 403, 404, 503)
        summary = error_responses(401, 403, 404, 503)

        def route(path: str, endpoint: Callable[..., Any], method: str, **kw: Any) -> None:
            app.add_api_route(path, endpoint, methods=[method], **kw)

        route("/health", self.health, "GET")
        route("/metrics", self.metrics, "GET")
        route("/v1/models", self.models, "GET")
        body = json_body(app, ChatCompletionRequest)
        route("/v1/chat/completions", self.chat_completions, "POST", responses=model_call, **body)
        body = json_body(app, "ResponsesRequest")
        route("/v1/responses", self.responses, "POST", responses=model_call | read, **body)
        body = json_body(app, SessionCreate, required=False)
        opened = error_responses(400, 401, 409, 413, 429, 503)
        route("/sessions", self.create_session, "POST", responses=opened, **body)
        route("/sessions/{session_id}", self.get_session, "GET", responses=summary)
        deleted = error_responses(401, 403, 404, 503)
        route("/sessions/{session_id}", self.delete_session, "DELETE", responses=deleted)
        body = json_body(app, RewardIn)
        route("/sessions/{session_id}/rewards", self.add_reward, "POST", responses=manage, **body)
        body = json_body(app, EndIn, required=False)
        route("/sessions/{session_id}/end", self.end_session, "POST", responses=manage, **body)
        route("/sessions/{session_id}/trajectory", self.trajectory, "GET", responses=read)
        return app

    # ------------------------------------------------------------------ auth
    @staticmethod
    def _bearer(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    def _is_admin(self, key: str | None) -> bool:
        return bool(
            self.admin_key and key and hmac.compare_digest(key.encode(), self.admin_key.encode())
        )

    async def _model_caller(self, request: Request) -> Session | None:
        key = self._bearer(request)
        if key is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <session key>' "
                "(create a session with POST /sessions)",
                kind="authentication_error",
            )
        if self._is_admin(key):
            return None
        session = await self._session_of_key(key)
        if session is None:
            raise self._bad_key()
        return session

    def _bad_key(self) -> ApiError:
        """The one answer to every key that reaches nothing (whatever session it names)."""
        hint = "use the api_key returned by POST /sessions"
        if self.store is None:
            hint += " (this proxy keeps sessions in memory: a restart forgets them)"
        else:
            hint += " (the session may have been deleted)"
        return ApiError(401, f"invalid API key: {hint}", kind="authentication_error")

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

    def _is_privileged(self, key: str) -> bool:
        given = key.encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.privileged_keys)

    async def _session_for(
        self, request: Request, session_id: str, *, manage: bool = False
    ) -> Session:
        """The session ``request`` may reach; ``manage``: rewards, end, delete.

        A key that reaches nothing is the same 401 whether or not ``session_id`` exists (a
        key tells nothing about other sessions); a 404 only for the admin and privileged
        keys, and a 403 for the key of another session."""
        key = self._bearer(request)
        if key is None:
            raise ApiError(
                401,
                "missing API key: send the session's key or the admin key",
                kind="authentication_error",
            )
        if self._is_admin(key) or self._is_privileged(key):
            target = await self._session_by_id(session_id)
            self._sweep()
            return target
        session = await self._session_of_key(key)
        if session is None:
            raise self._bad_key()
        if session.id != session_id:
            raise ApiError(403, "this key belongs to another session", kind="permission_error")
        if manage and not self.self_rewarding:
            raise ApiError(
                403,
                "rewards come from the environment in this run: a session key may call "
                "the model and read its session, but posting rewards, ending or deleting "
                "a session needs the admin key (or start the proxy with "
                "self_rewarding=True)",
                kind="permission_error",
            )
        self.sessions.touch(session)
        return session

    # ------------------------------------------------------------------ small endpoints
    async def health(self) -> dict[str, Any]:
        return {"engine": await self.engine.health(), "sessions": len(self.sessions)}

    async def metrics(self) -> dict[str, Any]:
        return dict(self.counters)

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "areal-agents"}
            ],
        }

    async def create_session(self, request: Request) -> dict[str, Any]:
        hooks, key = self.session_hooks, self._bearer(request)
        trusted = bool(key) and (self._is_admin(key or "") or self._is_privileged(key or ""))
        closed = not self.open_sessions or hooks is not None  # hooks may be attached later
        if not trusted and (closed or self.admin_key):  # who may open a session
            if hooks is not None:
                why = "the worker token in this run (its sessions are trained on): send "
                why += "'Authorization: Bearer <worker token>'"
            elif not self.open_sessions:
                why = "the admin key or worker token: this proxy opens its sessions itself"
            else:
                why = "the proxy's admin key"
            raise ApiError(401, f"POST /sessions needs {why}", kind="authentication_error")
        body = await _parse(request, SessionCreate, allow_empty=True)
        if hooks is not None:
            hooks.admit(body)  # may refuse: no room for a new group, a full group
        session = self.sessions.create(
            group_id=body.group_id, task_id=body.task_id, metadata=body.metadata
        )
        if hooks is not None:
            hooks.opened(session)
        await self._sync_store()
        base = self.public_url or str(request.base_url).rstrip("/")
        return {"id": session.id, "api_key": session.api_key, "base_url": f"{base}/v1"}

    async def get_session(self, session_id: str, request: Request) -> dict[str, Any]:
        ep = (await self._session_for(request, session_id)).episode
        return {
            "id": ep.session_id,
            "group_id": ep.group_id,
            "task_id": ep.task_id,
            "ended": ep.ended,
            "end_reason": ep.end_reason,
            "completions": len(ep.completions),
            "final_reward": ep.final_reward,
        }

    async def delete_session(self, session_id: str, request: Request) -> dict[str, Any]:
        session = await self._session_for(request, session_id, manage=True)
        if self.session_hooks is not None and not session.closed:
            self.sessions.end(session, reason="deleted")
            self.session_hooks.ended(session)
        self.sessions.remove(session_id)
        await self._sync_store()
        return {"id": session_id, "deleted": True}

    async def add_reward(self, session_id: str, request: Request) -> dict[str, Any]:
        session = await self._session_for(request, session_id, manage=True)
        self._check_open_for_hooks(session, "rewards")
        body = await _parse(request, RewardIn)
        try:
            target = self.sessions.add_reward(
                session,
                body.value,
                completion_id=body.completion_id,
                tool_call_id=body.tool_call_id,
                final=body.final,
            )
        except ArealError as exc:
            raise ApiError(400 if not isinstance(exc, SessionError) else 404, str(exc)) from None
        await self._sync_store()
        return {"session_id": session.id, "completion_id": target, "final": body.final}

    def _check_open_for_hooks(self, session: Session, what: str) -> None:
        """Sessions from outside go to training when they end: nothing changes them after."""
        if self.session_hooks is not None and session.closed:
            raise ApiError(
                409,
                f"session {session.id} has ended and its episode went to training; post "
                f"{what} before POST /sessions/{{id}}/end",
                kind="conflict_error",
            )

    async def end_session(self, session_id: str, request: Request) -> dict[str, Any]:
        session = await self._session_for(request, session_id, manage=True)
        self._check_open_for_hooks(session, "an end")
        body = await _parse(request, EndIn, allow_empty=True)
        was_open = not session.closed
        self.sessions.end(
            session, final_reward=body.final_reward, reason=body.reason, error=body.error
        )
        if self.session_hooks is not None and was_open:
            self.session_hooks.ended(session)
        await self._sync_store()
        return {"id": session.id, "ended": True, "end_reason": session.episode.end_reason}

    async def trajectory(
        self,
        session_id: str,
        request: Request,
        gamma: float = 1.0,
        prompts: str = "full",
        offset: int = 0,
        limit: int | None = None,
    ) -> Response:
        """The episode (``Episode.to_dict``): ``prompts=delta`` for O(tokens) reads of long
        episodes, ``offset``/``limit`` to page through its completions. Serialized off the
        event loop, from a snapshot (calls recorded meanwhile are not in it)."""
        session = await self._session_for(request, session_id)
        if not 0.0 <= gamma <= 1.0:
            raise ApiError(400, f"gamma must be in [0, 1], got {gamma}", param="gamma")
        if prompts not in ("full", "delta"):
            raise ApiError(
                400, f"prompts must be 'full' or 'delta', got {prompts!r}", param="prompts"
            )
        if offset < 0 or (limit is not None and limit < 1):
            raise ApiError(400, "offset must be >= 0 and limit >= 1", param="offset")
        snapshot = session.episode.snapshot()

        def encode() -> bytes:
            data = snapshot.to_dict(gamma, prompts=prompts, offset=offset, limit=limit)
            try:
                return json.dumps(data, ensure_ascii=False).encode()
            except UnicodeEncodeError:  # a lone surrogate: escape it rather than fail
                return json.dumps(data).encode()

        return Response(await asyncio.to_thread(encode), media_type="application/json")

    # ------------------------------------------------------------------ chat completions
    async def chat_completions(self, request: Request) -> Response:
        session = await self._model_caller(request)
        req = await _parse(request, ChatCompletionRequest)
        reply = await self.until_disconnect(
            request, self.reply(session, req, agent=agent_name(request))
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = _sse(
                reply.body, include_usage, before_done=lambda: self._commit_before_done(reply)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        self.record(reply)
        answer = JSONResponse(reply.body)  # encoded while the store commits
        await self._sync_store()
        return answer

    async def responses(self, request: Request) -> Response:
        from areal_agents.serve.responses import (  # responses.py builds on this module
            ResponsesRequest,
            respond,
        )

        session = await self._model_caller(request)
        req = await _parse(request, ResponsesRequest)
        return await respond(self, session, req, agent=agent_name(request), request=request)

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
        if session is not None and session.closed:
            raise ApiError(
                409, f"session {session.id} has ended; open a new session", kind="conflict_error"
            )
        req = request if isinstance(request, ChatCompletionRequest) else _validate(request)
        messages = [_message_dict(m) for m in req.messages]
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
        409 and the call is not recorded: what ended an episode is never changed after."""
        session = reply.session
        if session is None or not reply.pending:
            return
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

    async def _encode(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
    ) -> list[int]:
        """The prompt's token ids; a 400 ``context_length_exceeded`` when it cannot fit the
        model's context (see :meth:`_tokens`)."""
        try:
            return await self._tokens(messages, tools, req, self.max_context)
        except _PromptTooLong as exc:
            raise self._overflow(str(exc)) from None

    async def _tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        limit: int,
    ) -> list[int]:
        """The prompt's token ids, or :class:`_PromptTooLong` when it has ``limit`` tokens or
        more. The template and the tokenizer run in a worker thread (a long prompt does not
        stall the event loop); a prompt that surely reaches ``limit`` is refused before it
        is tokenized (:meth:`ChatTokenizer.min_tokens`)."""
        tokenizer = self.tokenizer
        kwargs = req.chat_template_kwargs or {}

        def encode() -> list[int]:
            text = tokenizer.render(messages, tools=tools, **kwargs)
            if len(text) >= limit:  # could be too long: a cheap lower bound first
                at_least = tokenizer.min_tokens(text)
                if at_least >= limit:
                    raise _PromptTooLong(f"at least {at_least}")
            ids = tokenizer.encode(text)
            if len(ids) >= limit:
                raise _PromptTooLong(str(len(ids)))
            return ids

        try:
            if _payload_chars(messages, tools) < INLINE_ENCODE_CHARS:
                return encode()  # a short prompt: cheaper here than a trip to a thread
            return await asyncio.to_thread(encode)
        except _PromptTooLong:
            raise
        except Exception as exc:  # template errors name the offending message
            raise ApiError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from None

    def _overflow(self, size: str, hint: str = "shorten the conversation") -> ApiError:
        """The 400 for a prompt of ``size`` tokens that cannot fit (``context_overflow``)."""
        self.counters["context_overflow"] += 1
        return ApiError(
            400,
            f"the prompt has {size} tokens but the model's context is {self.max_context}; {hint}",
            code="context_length_exceeded",
            param="messages",
        )

    # ------------------------------------------------------------------ context policy
    async def _fit(
        self,
        session: Session | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        agent: str | None,
    ) -> _Fitted:
        """The prompt to send for ``messages``, rewritten by :attr:`context_policy` when it
        would not leave ``reserve_tokens`` free (:mod:`areal_agents.serve.context`)."""
        policy = self.context_policy
        if policy.policy == "fail":
            return _Fitted(await self._encode(messages, tools, req))
        limit = self._limit(policy.reserve_tokens)
        try:
            return _Fitted(await self._tokens(messages, tools, req, limit))
        except _PromptTooLong:
            pass
        summaries: list[Completion] = []
        if policy.policy == "summarize":
            fitted, summaries = await self._summarized(session, messages, tools, req, agent)
            if fitted is not None:
                self.counters["context_rewrites"] += 1
                self.counters["context_summarized"] += 1
                fitted.summaries = summaries
                return fitted
            self.counters["context_summary_fallbacks"] += 1
        fitted = await self._truncated(messages, tools, req)
        fitted.summaries = summaries
        return fitted

    def _limit(self, reserve: int) -> int:
        """The prompt length (exclusive) that leaves ``reserve`` tokens (at least 1) free."""
        return self.max_context - max(reserve, 1) + 1

    async def _fewest_truncations(
        self,
        messages: list[dict[str, Any]],
        candidates: list[int],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        limit: int,
    ) -> tuple[list[dict[str, Any]], list[int]] | None:
        """The edits truncating the fewest of ``candidates`` (oldest first) that bring the
        prompt under ``limit`` tokens, and its ids; None when truncating all does not."""

        async def attempt(k: int) -> list[int] | None:
            sent = apply_edits(messages, ctx.truncation_edits(messages, candidates[:k]))
            try:
                return await self._tokens(sent, tools, req, limit)
            except _PromptTooLong:
                return None

        if not candidates or (ids := await attempt(len(candidates))) is None:
            return None
        best, low, high = (len(candidates), ids), 1, len(candidates)
        while low < high:  # the prompt shortens with every result truncated
            mid = (low + high) // 2
            if (ids := await attempt(mid)) is not None:
                best, high = (mid, ids), mid
            else:
                low = mid + 1
        return ctx.truncation_edits(messages, candidates[: best[0]]), best[1]

    async def _truncated(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
    ) -> _Fitted:
        """``truncate_tool_results``: the fewest old tool results truncated that leave
        ``reserve_tokens`` free; else all of them, if that fits the context at all; else a
        400 ``context_length_exceeded``."""
        policy = self.context_policy
        head, kept = ctx.turn_bounds(messages, policy.keep_last_turns)
        candidates = ctx.truncatable(messages, head, kept)
        found = await self._fewest_truncations(
            messages, candidates, tools, req, self._limit(policy.reserve_tokens)
        )
        edits = found[0] if found else ctx.truncation_edits(messages, candidates) or None
        if found is not None:
            ids = found[1]
        else:
            try:  # with less than reserve_tokens to answer in, as `fail` would send it
                ids = await self._tokens(apply_edits(messages, edits), tools, req, self.max_context)
            except _PromptTooLong as exc:
                hint = (
                    f"context.policy={policy.policy} truncated {len(candidates)} tool results "
                    f"and keeps the last {policy.keep_last_turns} turns whole; shorten the "
                    "conversation (or lower keep_last_turns)"
                )
                raise self._overflow(str(exc), hint) from None
        if edits is None:
            return _Fitted(ids)
        self.counters["context_rewrites"] += 1
        self.counters["context_truncated"] += 1
        return _Fitted(ids, edits, "truncated")

    async def _summarized(
        self,
        session: Session | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        agent: str | None,
    ) -> tuple[_Fitted | None, list[Completion]]:
        """``summarize``: the older turns replaced by a summary (an earlier one of this
        session that still applies, else a new summary call), if that leaves
        ``reserve_tokens`` free; and the summary calls made (None: fall back)."""
        policy = self.context_policy
        limit = self._limit(policy.reserve_tokens)
        head, kept = ctx.turn_bounds(messages, policy.keep_last_turns)
        earlier = session.episode.completions if session is not None else []
        previous = ctx.previous_summary(earlier, messages, head)
        if previous is not None and previous[0] > kept:
            previous = None
        if previous is not None:
            cut, message = previous
            edits = [{"start": head, "end": cut, "messages": [message]}]
            try:
                ids = await self._tokens(apply_edits(messages, edits), tools, req, limit)
                return _Fitted(ids, edits, "summarized"), []
            except _PromptTooLong:
                pass
        if kept <= (previous[0] if previous is not None else head):
            return None, []  # nothing (more) to summarize
        request = ctx.summary_request(messages, head, kept, previous)
        summary = await self._summary_call(session, request, head, req, agent)
        if summary is None:
            return None, []
        parent_id = find_parent(earlier, messages)
        parent = session.episode.by_id(parent_id) if session and parent_id else None
        summary.segment = (parent.segment if parent is not None else 0) + 1  # the one it opens
        message = ctx.summary_message(ctx.summary_text(summary.message))
        edits = [{"start": head, "end": kept, "messages": [message]}]
        try:
            ids = await self._tokens(apply_edits(messages, edits), tools, req, limit)
        except _PromptTooLong:
            return None, [summary]
        return _Fitted(ids, edits, "summarized"), [summary]

    async def _summary_call(
        self,
        session: Session | None,
        request: list[dict[str, Any]],
        head: int,
        req: ChatCompletionRequest,
        agent: str | None,
    ) -> Completion | None:
        """Have the model summarize: ``request`` (from :func:`~areal_agents.serve.context.
        summary_request`, its tool results truncated when it cannot leave
        ``summary_max_tokens`` free itself) sampled greedily, or as ``req`` asks when
        summaries are trained. The call as a completion (``context_rewrite:
        "summary_call"``, not yet recorded; its segment: the one it opens), or None when
        its request cannot fit."""
        policy = self.context_policy
        limit = self._limit(policy.summary_max_tokens)
        edits: list[dict[str, Any]] | None = None
        try:
            ids = await self._tokens(request, None, req, limit)
        except _PromptTooLong:
            candidates = ctx.truncatable(request, head, len(request) - 1)
            found = await self._fewest_truncations(request, candidates, None, req, limit)
            if found is None:
                return None
            edits, ids = found
        params = self._sampling(req, len(ids), session).replace(
            max_new_tokens=min(policy.summary_max_tokens, self.max_context - len(ids)),
            stop=(),
            top_logprobs=0,
        )
        if not policy.summary_trained:
            params = params.replace(temperature=0.0, top_p=1.0, top_k=0)
        self.counters["context_summary_calls"] += 1
        started = time.time()
        (result,) = await self._generate(session, ids, params, 1)
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        plain = req.model_copy(update={"logprobs": False, "tool_choice": "none"})
        _, summary = self._choice(0, cid, result, plain, request, None, [], ids, params, started)
        summary.agent = agent
        summary.context_rewrite, summary.context_edits = SUMMARY_CALL, edits
        summary.trained = policy.summary_trained
        return summary

    def _sampling(
        self, req: ChatCompletionRequest, prompt_len: int, session: Session | None = None
    ) -> SamplingParams:
        """The request's sampling; what it leaves unset comes from the session's defaults
        (:attr:`Session.sampling`), then the server's (temperature 1, no top-p/top-k cut,
        ``default_max_tokens``)."""
        defaults = session.sampling if session is not None else {}
        room = self.max_context - prompt_len
        asked = (
            req.max_completion_tokens
            or req.max_tokens
            or defaults.get("max_tokens")
            or self.default_max_tokens
        )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        asked_for: dict[str, Any] = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
        given = {k: defaults.get(k) if v is None else v for k, v in asked_for.items()}
        try:
            return SamplingParams(
                temperature=1.0 if given["temperature"] is None else float(given["temperature"]),
                top_p=1.0 if given["top_p"] is None else float(given["top_p"]),
                top_k=max(0, int(given["top_k"] or 0)),
                max_new_tokens=max(1, min(asked, room)),
                stop_token_ids=tuple(self.tokenizer.eos_token_ids),
                stop=stop,
                seed=req.seed,
                top_logprobs=req.top_logprobs or 0,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    async def _generate(
        self, session: Session | None, prompt_ids: list[int], params: SamplingParams, n: int
    ) -> list[GenerateResult]:
        seeds = [None if params.seed is None else params.seed + i for i in range(n)]
        # Several replicas: a session's calls go to one replica (its prefix cache).
        route = {"route_key": session.id} if session is not None and self._routes else {}
        try:
            return list(
                await asyncio.gather(
                    *[
                        self.engine.generate(prompt_ids, params.replace(seed=s), **route)
                        for s in seeds
                    ]
                )
            )
        except ContextOverflow as exc:
            self.counters["context_overflow"] += 1
            raise ApiError(400, str(exc), code="context_length_exceeded") from None
        except (BackendError, OSError, RuntimeError, ValueError) as exc:  # engine refused
            self.counters["backend_error"] += 1
            if session is not None:  # recorded here, once (callers do not record it again)
                self.sessions.note_error(session, {"kind": "backend_error", "message": str(exc)})
            raise ApiError(
                502,
                f"the inference engine failed: {exc}",
                kind="server_error",
                code="backend_error",
            ) from None

    def _choice(
        self,
        index: int,
        cid: str,
        result: GenerateResult,
        req: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_names: list[str],
        prompt_ids: list[int],
        params: SamplingParams,
        started: float,
    ) -> tuple[dict[str, Any], Completion]:
        text = self._text(result)
        parse_errors: list[str] = []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tools and req.tool_choice != "none":
            parsed = parse_tool_calls(text, tool_names=tool_names)
            parse_errors = list(parsed.errors)
            if parsed.tool_calls or parsed.reasoning is not None:
                message = parsed.to_message()
        elif "<think>" in text:
            parsed = parse_tool_calls(text, tool_names=[])
            if parsed.reasoning is not None:
                message = {
                    "role": "assistant",
                    "content": parsed.content,
                    "reasoning_content": parsed.reasoning,
                }
        if parse_errors:
            self.counters["tool_call_parse_errors"] += 1
        finish: str = result.finish_reason
        if message.get("tool_calls"):
            finish = "tool_calls"
        elif finish == "abort":
            finish = "stop"
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
            "completion_id": cid,
        }
        if req.logprobs:
            choice["logprobs"] = {"content": self._logprobs(result)}
        completion = Completion(
            id=cid,
            messages=messages,
            prompt_ids=prompt_ids,
            output_ids=result.output_ids,
            output_logprobs=result.output_logprobs,
            output_versions=result.output_versions,
            message=message,
            finish_reason=finish,
            tools=tools,
            parse_errors=parse_errors,
            sampling={
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens,
                "seed": params.seed,
            },
            created_at=started,
            latency_s=result.latency_s,
            queue_s=result.queue_s,
        )
        return choice, completion

    def _content_ids(self, result: GenerateResult) -> list[int]:
        ids = result.output_ids
        if result.finish_reason == "stop" and isinstance(result.stop_reason, int) and ids:
            return ids[:-1]
        return ids

    def _text(self, result: GenerateResult) -> str:
        text = self.tokenizer.decode(self._content_ids(result))
        if isinstance(result.stop_reason, str) and result.stop_reason in text:
            text = text[: text.index(result.stop_reason)]
        return text

    def _logprobs(self, result: GenerateResult) -> list[dict[str, Any]]:
        ids = self._content_ids(result)
        strings = self.tokenizer.token_strings(ids)
        raw = self.tokenizer.token_bytes(ids)
        out = []
        for i, (tok, lp) in enumerate(zip(strings, result.output_logprobs, strict=False)):
            top = []
            if result.top_logprobs and i < len(result.top_logprobs):
                alt = result.top_logprobs[i]
                alt_ids = [a for a, _ in alt]
                top = [
                    {"token": s, "logprob": v, "bytes": list(b)}
                    for s, b, (_, v) in zip(
                        self.tokenizer.token_strings(alt_ids),
                        self.tokenizer.token_bytes(alt_ids),
                        alt,
                        strict=True,
                    )
                ]
            out.append({"token": tok, "logprob": lp, "bytes": list(raw[i]), "top_logprobs": top})
        return out


# ---------------------------------------------------------------------- helpers
async def _parse(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    """The request's JSON body as ``model``; a 413 or a 400 naming the field for anything
    the proxy does not take (see :class:`RequestLimits` and :func:`check_json`)."""
    limits = request_limits(request)
    raw = await _read_body(request, limits.max_body_bytes)
    if not raw.strip():
        if allow_empty:
            return model()
        raise ApiError(400, "the request body is empty; send a JSON object")
    data = load_json(raw, max_depth=limits.max_depth)
    if not isinstance(data, dict):
        raise ApiError(400, f"expected a JSON object, got {type(data).__name__}")
    return _validate(data, model)


def _validate(data: dict[str, Any], model: type[M] = ChatCompletionRequest) -> M:  # type: ignore[assignment]
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors(include_url=False)) from None
    except RecursionError:  # an in-process caller's value nested too deeply
        raise ApiError(
            400, f"the request nests deeper than {MAX_JSON_DEPTH} levels; send flatter data"
        ) from None


def _message_dict(message: BaseModel) -> dict[str, Any]:
    d = message.model_dump(exclude_none=True)
    content = d.get("content")
    if isinstance(content, list):
        d["content"] = "".join(p.get("text", "") for p in content)
    for tc in d.get("tool_calls") or []:
        args = tc["function"].get("arguments")
        if not isinstance(args, str):
            tc["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
    if d["role"] == "developer":
        d["role"] = "system"
    return d


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` (its body already read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse(
    body: dict[str, Any],
    include_usage: bool,
    before_done: Callable[[], Awaitable[dict[str, Any] | None]] | None = None,
) -> AsyncIterator[str]:
    """Replay a finished completion as OpenAI chat.completion.chunk events; ``before_done``
    runs before ``[DONE]`` (the call is recorded there) and may return an error event
    instead (then the stream ends without ``[DONE]``)."""
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

    for ch in body["choices"]:
        i, msg = ch["index"], ch["message"]
        yield event(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if msg.get("reasoning_content"):
            yield event(
                [
                    {
                        "index": i,
                        "delta": {"reasoning_content": msg["reasoning_content"]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        if msg.get("content"):
            yield event(
                [
                    {
                        "index": i,
                        "delta": {"content": msg["content"]},
                        "logprobs": ch["logprobs"],
                        "finish_reason": None,
                    }
                ]
            )
        for k, tc in enumerate(msg.get("tool_calls") or []):
            delta = {
                "tool_calls": [
                    {"index": k, "id": tc["id"], "type": "function", "function": tc["function"]}
                ]
            }
            yield event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        yield event(
            [{"index": i, "delta": {}, "logprobs": None, "finish_reason": ch["finish_reason"]}]
        )
    if include_usage:
        yield event([], usage=body["usage"])
    if before_done is not None:
        failed = await before_done()
        if failed is not None:
            yield "data: " + json.dumps(failed) + "\n\n"
            return
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- request limits
class _PromptTooLong(Exception):
    """The prompt cannot fit the model's context (the message says how many tokens)."""


@dataclass
class _Fitted:
    """The prompt a request is sent as (:meth:`Proxy._fit`): its ids, the edits that made
    it from the request's messages and their kind (None: as sent), and the summary calls
    made for it."""

    ids: list[int]
    edits: list[dict[str, Any]] | None = None
    rewrite: str | None = None
    summaries: list[Completion] = field(default_factory=list)


@dataclass
class RequestLimits:
    """What a request body may be, checked before anything is parsed into a model or
    stored: beyond ``max_body_bytes`` a 413; nested deeper than ``max_depth``, a lone UTF-16
    surrogate in any string or key, a non-finite number (``NaN``, ``Infinity``, ``1e999``)
    or an integer outside the signed 64-bit range, a 400 naming the field. Change them on
    a proxy as ``proxy.limits.max_body_bytes = ...``."""

    max_body_bytes: int = 8 * 2**20
    max_depth: int = MAX_JSON_DEPTH


def request_limits(request: Request) -> RequestLimits:
    """The limits of the app serving ``request`` (the defaults if it has none)."""
    limits = getattr(request.app.state, "request_limits", None)
    return limits if isinstance(limits, RequestLimits) else RequestLimits()


INLINE_ENCODE_CHARS = 8192
"""Prompts whose text is shorter than this are tokenized on the event loop (well under a
millisecond); longer ones in a worker thread."""


def _payload_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """About how many characters ``messages`` and ``tools`` render to (a cheap upper bound
    on the template's own text is not needed: long prompts are far over the cut)."""
    size = sum(
        len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages
    )
    return size + (len(str(tools)) if tools else 0)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise ApiError(499, "the client closed the connection", code="client_closed") from None
    raw = b"".join(chunks)
    request._body = raw  # what Request.body() returns from now on
    return raw


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size}+ bytes, over this proxy's limit of {limit} bytes; "
        "send a shorter conversation (or raise Proxy.limits.max_body_bytes)",
        code="request_too_large",
    )


def _refuse_constant(name: str) -> Any:
    raise ApiError(
        400,
        f"the request body holds {name}, which is not a JSON number; send a finite number "
        "(or null)",
    )


_PARSE_DEPTH = 400
"""The deepest body that is parsed before its depth is checked (with its field's name)."""


def load_json(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body, checked by :func:`check_json`; a 400 saying what is wrong."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}") from None
    # Far too deep for json.loads, which recurses once per level: refused unparsed. Less
    # deep bodies are parsed, and check_json names the field that nests too deeply.
    scan = max(max_depth, _PARSE_DEPTH)
    if text.count("[") + text.count("{") > scan and (depth := json_text_depth(text)) > scan:
        raise ApiError(
            400,
            f"the request body nests objects and arrays {depth} levels deep, over the limit "
            f"of {max_depth}; send flatter data",
            code="too_deep",
        )
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests deeper than {max_depth} levels; send flatter data"
        ) from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    check_json(data, max_depth=max_depth)
    return data


def check_json(value: Any, *, max_depth: int = MAX_JSON_DEPTH, where: str = "") -> None:
    """Refuse (a 400 naming the field) what cannot be stored and read back as JSON: nesting
    deeper than ``max_depth``, lone surrogates in strings and keys, non-finite floats and
    integers outside the signed 64-bit range. Iterative: any depth is safe to check."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(value, 0, ())]
    while stack:
        item, depth, path = stack.pop()
        kind = type(item)
        if kind is str:
            _check_text(item, path, where)
        elif kind is dict or kind is list:
            if depth >= max_depth:
                raise ApiError(
                    400,
                    f"{_field(path, where)}: nests objects and arrays deeper than {max_depth} "
                    "levels; send flatter data",
                    param=_field(path, where),
                    code="too_deep",
                )
            if kind is dict:
                for key, child in item.items():
                    _check_text(key, (*path, key), where, key=True)
                    if type(child) is not str or not child.isascii():
                        stack.append((child, depth + 1, (*path, key)))
            else:
                for index, child in enumerate(item):
                    if type(child) is not str or not child.isascii():
                        stack.append((child, depth + 1, (*path, index)))
        elif kind is int:
            if not INT64_MIN <= item <= INT64_MAX:
                raise ApiError(
                    400,
                    f"{_field(path, where)}: the integer {_short_int(item)} is out of range; "
                    "integers must fit in 64 bits (-2**63 to 2**63 - 1)",
                    param=_field(path, where),
                )
        elif kind is float and not math.isfinite(item):
            raise ApiError(
                400,
                f"{_field(path, where)}: {item} is not a finite number; send a finite number",
                param=_field(path, where),
            )


def _check_text(text: str, path: tuple[Any, ...], where: str, *, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        what = "key" if key else "string"
        bad = text[exc.start]
        raise ApiError(
            400,
            f"{_field(path, where)}: the {what} holds a lone UTF-16 surrogate "
            f"({bad.encode('unicode_escape').decode()!s} at character {exc.start}), which "
            "is not Unicode text; send valid UTF-8 (binary data as base64)",
            param=_field(path, where),
            code="invalid_unicode",
        ) from None


def _field(path: tuple[Any, ...], where: str) -> str:
    parts: list[str | int] = [where] if where else []
    parts += [
        p if isinstance(p, int) else p.encode("ascii", "backslashreplace").decode() for p in path
    ]
    return ".".join(str(p) for p in parts) or "body"


def _short_int(n: int) -> str:
    digits = len(str(abs(n))) if abs(n) < 10**4000 else 4000
    return str(n) if digits <= 30 else f"of {digits}+ digits"


def _validation_error(errors: Sequence[Any]) -> ApiError:
    """The 400 for pydantic's (or FastAPI's) validation errors, naming each field."""
    problems = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:] if loc[0] == "body" else loc
        problems.append((".".join(loc) or "body", str(e.get("msg", "invalid"))))
    message = "; ".join(f"{where}: {msg}" for where, msg in problems) or "invalid request"
    param = problems[0][0] if problems else None
    if param and param.split(".")[0] in ("query", "path", "header"):
        param = param.split(".", 1)[-1]
    return ApiError(400, f"invalid request: {message}", param=param)


# ---------------------------------------------------------------------- OpenAPI
_ERROR_TEXT = {
    400: "A malformed request: the message names the field and the fix",
    401: "A missing or wrong API key",
    403: "The key may not do this (another session's key; rewards in a run without self-rewarding)",
    404: "No such session (or task, or stored response)",
    409: "The session has ended, or the call conflicts with its state",
    413: "The request body is over the proxy's size limit",
    429: "No room for a new session (or no task) now: retry after Retry-After seconds",
    502: "The inference engine failed",
    503: "The episode store failed, or the service is shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` documenting these error statuses with :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": _ERROR_TEXT[s]} for s in statuses}


def json_body(
    app: FastAPI, model: type[BaseModel] | str, *, required: bool = True
) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON body as ``model`` (its name for a model
    defined in a module that imports this one: ``"ResponsesRequest"``), for routes that read
    the body raw (:func:`_parse`) to answer the proxy's own 400s."""
    models: dict[str, type[BaseModel] | str] = getattr(app.state, "body_models", None) or {}
    name = model if isinstance(model, str) else model.__name__
    models[name] = model
    app.state.body_models = models
    app.openapi_schema = None
    schema = {"$ref": f"#/components/schemas/{name}"}
    content = {"application/json": {"schema": schema}}
    return {"openapi_extra": {"requestBody": {"required": required, "content": content}}}


def _body_model(model: type[BaseModel] | str) -> type[BaseModel]:
    if not isinstance(model, str):
        return model
    from areal_agents.serve import responses

    found = getattr(responses, model, None)
    if not (isinstance(found, type) and issubclass(found, BaseModel)):
        raise LookupError(f"no request model {model!r}")
    return found


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, with the request bodies of :func:`json_body` and no 422
    answers (validation errors are 400s with :class:`ErrorBody`)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=__doc__, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    models = {name: _body_model(m) for name, m in (getattr(app.state, "body_models", {})).items()}
    refs, defs = models_json_schema(
        [(m, "validation") for m in models.values()],
        ref_template="#/components/schemas/{model}",
    )
    components.update(defs.get("$defs", {}))
    for name, m in models.items():
        ref = refs[(m, "validation")]
        if ref.get("$ref") != f"#/components/schemas/{name}":
            components[name] = ref
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    if not any("ValidationError" in str(op) for op in schema.get("paths", {}).values()):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
