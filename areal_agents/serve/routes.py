"""The proxy's HTTP app: its routes, who may call them, and how errors are answered.

:class:`ProxyRoutes` (the top layer of :class:`~areal_agents.serve.proxy.Proxy`, over
:class:`~areal_agents.serve.core.ProxyCore`) builds the FastAPI app (``proxy.app``; the
routes are listed in :mod:`areal_agents.serve.proxy`), checks each request's key (a
session's key, the admin key or a privileged key; see :meth:`ProxyRoutes._session_for`),
reads its body through :func:`~areal_agents.serve.bodies.parse_body`, and answers every
error, FastAPI's own included, in the OpenAI error format (:class:`ApiError`). Session
summaries and trajectories are encoded by :func:`encode_json`, so a non-finite number that
reached a store (from an older version) still reads back as JSON.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_agents.errors import ArealError, SessionError
from areal_agents.serve.api_error import ApiError, validation_error
from areal_agents.serve.bodies import RequestLimits, parse_body
from areal_agents.serve.core import ProxyCore
from areal_agents.serve.openapi import error_responses, json_body, openapi_schema
from areal_agents.serve.responses import ResponsesRequest, respond
from areal_agents.serve.schemas import ChatCompletionRequest, EndIn, RewardIn, SessionCreate
from areal_agents.serve.session import RewardRangeError, Session
from areal_agents.serve.sse import chat_sse

AGENT_HEADER = "X-Areal-Agent"
"""Request header naming the agent that makes a model call (URL-quoted UTF-8)."""


def agent_name(request: Request) -> str | None:
    """The calling agent's name from :data:`AGENT_HEADER`, or None; a 400 when unusable."""
    raw = request.headers.get(AGENT_HEADER)
    if raw is None:
        return None
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


NON_FINITE = "non_finite"
"""The key, in a session summary or trajectory, that lists the numbers read as null because
they are not finite (see :func:`encode_json`)."""


def encode_json(data: dict[str, Any]) -> bytes:
    """``data`` as JSON (UTF-8; a lone surrogate escaped rather than failing). A float that
    is not finite (``inf``, ``-inf``, ``nan``: JSON has no such numbers) is written as null,
    and ``data[NON_FINITE]`` maps each one's dotted path (``"final_reward"``,
    ``"completions.3.return"``) to what it was: ``"Infinity"``, ``"-Infinity"`` or ``"NaN"``;
    without such a float the key is absent."""
    try:
        text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: the slow path, only then
        found: dict[str, str] = {}
        data = {**_finite(data, (), found), NON_FINITE: found}
        text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: escape it rather than fail
        return json.dumps(data, allow_nan=False).encode()


def _finite(value: Any, path: tuple[Any, ...], found: dict[str, str]) -> Any:
    """``value`` with each non-finite float replaced by None (noted in ``found`` under its
    path); containers are copied only where something changed (the data is not changed)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        found[".".join(str(p) for p in path)] = (
            "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        )
        return None
    if isinstance(value, dict):
        items = {k: _finite(v, (*path, k), found) for k, v in value.items()}
        return items if any(items[k] is not v for k, v in value.items()) else value
    if isinstance(value, list | tuple):
        out = [_finite(v, (*path, i), found) for i, v in enumerate(value)]
        return out if any(a is not b for a, b in zip(out, value, strict=True)) else value
    return value


class ProxyRoutes(ProxyCore):
    """The HTTP endpoints of the proxy and its app (see the module docstring); the
    attributes below are set by :class:`~areal_agents.serve.proxy.Proxy`."""

    admin_key: str | None
    self_rewarding: bool
    privileged_keys: set[str]
    open_sessions: bool
    public_url: str | None
    app: FastAPI

    # ------------------------------------------------------------------ app
    def _build_app(self, description: str | None = None) -> FastAPI:
        """The FastAPI app; ``description`` heads its OpenAPI document."""
        app = FastAPI(
            title="areal-agents proxy",
            description=description or "",
            docs_url=None,
            redoc_url=None,
        )

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
            return validation_error(exc.errors()).response()

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
        body = json_body(app, ResponsesRequest)
        route("/v1/responses", self.responses, "POST", responses=model_call | read, **body)
        body = json_body(app, SessionCreate, required=False)
        opened = error_responses(400, 401, 409, 413, 429, 503)
        route("/sessions", self.create_session, "POST", responses=opened, **body)
        route("/sessions/{session_id}", self.get_session, "GET", responses=summary)
        deleted = error_responses(401, 403, 404, 409, 503)
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
                "rewards come from the environment or the admin key on this proxy, not "
                "from the agent (self-rewarding is off: a training run, "
                "Proxy(self_rewarding=False) or `areal-agent serve --no-self-rewarding`): "
                "a session key may call the model and read its session, but posting "
                "rewards, ending or deleting a session needs the admin key (in a "
                "self-rewarded training run, the worker token)",
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
                why = "the admin key: this proxy opens its sessions itself"
            else:
                why = "the proxy's admin key"
            raise ApiError(401, f"POST /sessions needs {why}", kind="authentication_error")
        body = await parse_body(request, SessionCreate, allow_empty=True)
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

    async def get_session(self, session_id: str, request: Request) -> Response:
        ep = (await self._session_for(request, session_id)).episode
        summary = {
            "id": ep.session_id,
            "group_id": ep.group_id,
            "task_id": ep.task_id,
            "ended": ep.ended,
            "end_reason": ep.end_reason,
            "completions": len(ep.completions),
            "final_reward": ep.final_reward,
        }
        return Response(encode_json(summary), media_type="application/json")

    async def delete_session(self, session_id: str, request: Request) -> dict[str, Any]:
        session = await self._session_for(request, session_id, manage=True)
        self._check_not_deleted(session)
        if self.session_hooks is not None and not session.closed:
            self.sessions.end(session, reason="deleted")
            self.session_hooks.ended(session)
        self.sessions.remove(session_id)
        await self._sync_store()
        return {"id": session_id, "deleted": True}

    async def add_reward(self, session_id: str, request: Request) -> dict[str, Any]:
        session = await self._session_for(request, session_id, manage=True)
        self._check_open_for_hooks(session, "rewards")
        body = await parse_body(request, RewardIn)
        self._check_not_deleted(session)
        try:
            target = self.sessions.add_reward(
                session,
                body.value,
                completion_id=body.completion_id,
                tool_call_id=body.tool_call_id,
                final=body.final,
            )
        except RewardRangeError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ArealError as exc:
            raise ApiError(400 if not isinstance(exc, SessionError) else 404, str(exc)) from None
        await self._sync_store()
        return {"session_id": session.id, "completion_id": target, "final": body.final}

    @staticmethod
    def _check_not_deleted(session: Session) -> None:
        """A request that reached a session before a ``DELETE`` of it was answered: a 409."""
        if session.deleted:
            raise ApiError(
                409,
                f"session {session.id} was deleted while this request was in flight; "
                "nothing was changed",
                kind="conflict_error",
                code="session_deleted",
            )

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
        body = await parse_body(request, EndIn, allow_empty=True)
        self._check_not_deleted(session)
        was_open = not session.closed
        try:
            self.sessions.end(
                session, final_reward=body.final_reward, reason=body.reason, error=body.error
            )
        except RewardRangeError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
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
            return encode_json(data)

        return Response(await asyncio.to_thread(encode), media_type="application/json")

    # ------------------------------------------------------------------ chat completions
    async def chat_completions(self, request: Request) -> Response:
        session = await self._model_caller(request)
        req = await parse_body(request, ChatCompletionRequest)
        reply = await self.until_disconnect(
            request, self.reply(session, req, agent=agent_name(request))
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = chat_sse(
                reply.body, include_usage, before_done=lambda: self._commit_before_done(reply)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        self.record(reply)
        answer = JSONResponse(reply.body)  # encoded while the store commits
        await self._sync_store()
        return answer

    async def responses(self, request: Request) -> Response:
        session = await self._model_caller(request)
        req = await parse_body(request, ResponsesRequest)
        return await respond(self, session, req, agent=agent_name(request), request=request)
