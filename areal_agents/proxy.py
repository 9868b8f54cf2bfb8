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
    GET  /sessions/{id}/trajectory?gamma=G   the episode with returns and training samples
    DELETE /sessions/{id}               forget the session

A wrong or missing key is a 401, another session's key a 403, an unknown session a 404, a
malformed body a 400 whose message names the field; nothing a client sends produces a 500.

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
import hmac
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from .chat import ChatTokenizer
from .engine import Engine, GenerateResult, SamplingParams, accepts_route_key
from .errors import ArealError, BackendError, ContextOverflow, SessionError
from .schemas import ChatCompletionRequest, EndIn, RewardIn, SessionCreate
from .session import Session, SessionStore
from .toolcall import parse_tool_calls
from .trajectory import Completion

M = TypeVar("M", bound=BaseModel)


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


class ApiError(Exception):
    """An error answered to the client in the OpenAI error format."""

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

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers or None)


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
    ) -> None:
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
        self.sessions = SessionStore()
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

        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/sessions", self.create_session, methods=["POST"])
        app.add_api_route("/sessions/{session_id}", self.get_session, methods=["GET"])
        app.add_api_route("/sessions/{session_id}", self.delete_session, methods=["DELETE"])
        app.add_api_route("/sessions/{session_id}/rewards", self.add_reward, methods=["POST"])
        app.add_api_route("/sessions/{session_id}/end", self.end_session, methods=["POST"])
        app.add_api_route("/sessions/{session_id}/trajectory", self.trajectory, methods=["GET"])
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

    def _model_caller(self, request: Request) -> Session | None:
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
        session = self.sessions.by_key(key)
        if session is None:
            raise ApiError(
                401,
                "invalid API key: use the api_key returned by POST /sessions",
                kind="authentication_error",
            )
        return session

    def _is_privileged(self, key: str) -> bool:
        given = key.encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.privileged_keys)

    def _session_for(self, request: Request, session_id: str, *, manage: bool = False) -> Session:
        """The session ``request`` may reach; ``manage``: rewards, end, delete."""
        key = self._bearer(request)
        if key is None:
            raise ApiError(
                401,
                "missing API key: send the session's key or the admin key",
                kind="authentication_error",
            )
        try:
            session = self.sessions.get(session_id)
        except SessionError as exc:
            raise ApiError(404, str(exc), kind="not_found_error") from None
        if self._is_admin(key) or self._is_privileged(key):
            return session
        if hmac.compare_digest(key.encode(), session.api_key.encode()):
            if manage and not self.self_rewarding:
                raise ApiError(
                    403,
                    "rewards come from the environment in this run: a session key may call "
                    "the model and read its session, but posting rewards, ending or deleting "
                    "a session needs the admin key (or start the proxy with "
                    "self_rewarding=True)",
                    kind="permission_error",
                )
            return session
        if self.sessions.by_key(key) is not None:
            raise ApiError(403, "this key belongs to another session", kind="permission_error")
        raise ApiError(401, "invalid API key", kind="authentication_error")

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
        base = self.public_url or str(request.base_url).rstrip("/")
        return {"id": session.id, "api_key": session.api_key, "base_url": f"{base}/v1"}

    async def get_session(self, session_id: str, request: Request) -> dict[str, Any]:
        ep = self._session_for(request, session_id).episode
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
        session = self._session_for(request, session_id, manage=True)
        if self.session_hooks is not None and not session.closed:
            self.sessions.end(session, reason="deleted")
            self.session_hooks.ended(session)
        self.sessions.remove(session_id)
        return {"id": session_id, "deleted": True}

    async def add_reward(self, session_id: str, request: Request) -> dict[str, Any]:
        session = self._session_for(request, session_id, manage=True)
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
        session = self._session_for(request, session_id, manage=True)
        self._check_open_for_hooks(session, "an end")
        body = await _parse(request, EndIn, allow_empty=True)
        was_open = not session.closed
        self.sessions.end(
            session, final_reward=body.final_reward, reason=body.reason, error=body.error
        )
        if self.session_hooks is not None and was_open:
            self.session_hooks.ended(session)
        return {"id": session.id, "ended": True, "end_reason": session.episode.end_reason}

    async def trajectory(
        self, session_id: str, request: Request, gamma: float = 1.0
    ) -> dict[str, Any]:
        session = self._session_for(request, session_id)
        if not 0.0 <= gamma <= 1.0:
            raise ApiError(400, f"gamma must be in [0, 1], got {gamma}", param="gamma")
        return session.episode.to_dict(gamma)

    # ------------------------------------------------------------------ chat completions
    async def chat_completions(self, request: Request) -> Response:
        session = self._model_caller(request)
        req = await _parse(request, ChatCompletionRequest)
        body = await self.complete(session, req, agent=agent_name(request))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(body, include_usage), media_type="text/event-stream")
        return JSONResponse(body)

    async def responses(self, request: Request) -> Response:
        from .responses import ResponsesRequest, respond  # responses.py builds on this module

        session = self._model_caller(request)
        req = await _parse(request, ResponsesRequest)
        return await respond(self, session, req, agent=agent_name(request))

    async def complete(
        self,
        session: Session | None,
        request: ChatCompletionRequest | dict[str, Any],
        *,
        agent: str | None = None,
    ) -> dict[str, Any]:
        """One chat completion, recorded into ``session`` (None: not recorded); ``agent``
        names the agent that made the call (:attr:`Completion.agent`).

        The HTTP endpoint and in-process callers (the episode runner) share this path.
        Raises :class:`ApiError` for anything the caller must fix.
        """
        if session is not None and session.closed:
            raise ApiError(
                409, f"session {session.id} has ended; open a new session", kind="conflict_error"
            )
        req = request if isinstance(request, ChatCompletionRequest) else _validate(request)
        messages = [_message_dict(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt_ids = self._encode(messages, tools if req.tool_choice != "none" else None, req)
        params = self._sampling(req, len(prompt_ids), session)
        self.counters["chat_calls"] += 1
        started = time.time()
        results = await self._generate(session, prompt_ids, params, req.n)
        base_id = "chatcmpl-" + uuid.uuid4().hex[:24]
        tool_names = [t["function"]["name"] for t in tools or []]
        choices = []
        for i, result in enumerate(results):
            cid = base_id if req.n == 1 else f"{base_id}-{i}"
            choice, completion = self._choice(
                i, cid, result, req, messages, tools, tool_names, prompt_ids, params, started
            )
            choices.append(choice)
            completion.agent = agent
            if session is not None and not session.closed:
                self.sessions.record(session, completion)
                self.counters["recorded_completions"] += 1
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": sum(len(r.output_ids) for r in results),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {
            "id": base_id,
            "object": "chat.completion",
            "created": int(started),
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }

    def _encode(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
    ) -> list[int]:
        try:
            ids = self.tokenizer.encode_chat(
                messages, tools=tools, **(req.chat_template_kwargs or {})
            )
        except Exception as exc:  # template errors name the offending message
            raise ApiError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from None
        if len(ids) >= self.max_context:
            self.counters["context_overflow"] += 1
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{self.max_context}; shorten the conversation",
                code="context_length_exceeded",
                param="messages",
            )
        return ids

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
            if session is not None:
                session.episode.errors.append({"kind": "backend_error", "message": str(exc)})
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
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return model()
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"expected a JSON object, got {type(data).__name__}")
    return _validate(data, model)


def _validate(data: dict[str, Any], model: type[M] = ChatCompletionRequest) -> M:  # type: ignore[assignment]
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise ApiError(
            400, f"invalid request: {problems}", param=".".join(str(p) for p in first) or None
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


async def _sse(body: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """Replay a finished completion as OpenAI chat.completion.chunk events."""
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
    yield "data: [DONE]\n\n"
