"""One model call of the proxy: a chat request in, the engine's tokens out, an OpenAI choice
and a :class:`~areal_agents.trajectory.Completion` back.

:class:`Generation` is the lowest layer of :class:`~areal_agents.serve.proxy.Proxy`: it
renders and tokenizes the prompt (in a worker thread when it is long), refuses one that
cannot fit the model's context, fills in the sampling the request leaves unset (the
session's defaults, then the server's), generates on the engine (a session's calls routed to
one replica), and turns each result into a message (tool calls and reasoning parsed out of
the text) with its logprobs. The context policy (:mod:`areal_agents.serve.fitting`) and the
call's life (:mod:`areal_agents.serve.core`) build on it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from pydantic import BaseModel

from areal_agents.engines.protocol import Engine, GenerateResult, SamplingParams
from areal_agents.errors import BackendError, ContextOverflow
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.schemas import ChatCompletionRequest
from areal_agents.serve.session import Session, SessionStore
from areal_agents.serve.toolcall import parse_tool_calls
from areal_agents.trajectory import Completion

INLINE_ENCODE_CHARS = 8192
"""Prompts whose text is shorter than this are tokenized on the event loop (well under a
millisecond); longer ones in a worker thread."""


class PromptTooLong(Exception):
    """The prompt cannot fit the model's context (the message says how many tokens)."""


class Generation:
    """Prompt tokens, sampling, generation and the parsed reply of one model call (see the
    module docstring); the attributes below are set by
    :class:`~areal_agents.serve.proxy.Proxy`."""

    engine: Engine
    tokenizer: ChatTokenizer
    max_context: int
    default_max_tokens: int
    sessions: SessionStore
    counters: Counter[str]
    _routes: bool
    """Whether the engine takes a ``route_key`` (several replicas)."""

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
        except PromptTooLong as exc:
            raise self._overflow(str(exc)) from None

    async def _tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        limit: int,
    ) -> list[int]:
        """The prompt's token ids, or :class:`PromptTooLong` when it has ``limit`` tokens or
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
                    raise PromptTooLong(f"at least {at_least}")
            ids = tokenizer.encode(text)
            if len(ids) >= limit:
                raise PromptTooLong(str(len(ids)))
            return ids

        try:
            if _payload_chars(messages, tools) < INLINE_ENCODE_CHARS:
                return encode()  # a short prompt: cheaper here than a trip to a thread
            return await asyncio.to_thread(encode)
        except PromptTooLong:
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


def _payload_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """About how many characters ``messages`` and ``tools`` render to (a cheap upper bound
    on the template's own text is not needed: long prompts are far over the cut)."""
    size = sum(
        len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages
    )
    return size + (len(str(tools)) if tools else 0)


def message_dict(message: BaseModel) -> dict[str, Any]:
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
