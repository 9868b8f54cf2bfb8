"""How the judge (:mod:`areal_agents.trainer.judge`) reaches a model: the run's own proxy
(``rewards.judge.self: true``, the policy's weights, calls recorded as ``judge-*`` sessions
that are never trained) or any OpenAI-compatible server (``rewards.judge.base_url``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import openai

from areal_agents.errors import ConfigError
from areal_agents.serve.api_error import ApiError

__all__ = ["Backend", "HttpBackend", "JudgeError", "ProxyBackend", "Reply"]


class JudgeError(Exception):
    """A judge call failed, or its reply could not be read."""


@dataclass
class Reply:
    """A judge call's answer."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_top: list[tuple[str, float]] = field(default_factory=list)
    """The first output token's most likely alternatives, ``(token, logprob)`` (asked with
    ``top_logprobs``)."""


class Backend(Protocol):
    model: str

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply: ...


def _first_top(choice_logprobs: Any) -> list[tuple[str, float]]:
    """``[(token, logprob)]`` of the first token's ``top_logprobs`` in an OpenAI choice's
    ``logprobs`` (a dict or the ``openai`` client's object)."""
    if not choice_logprobs:
        return []
    content = (
        choice_logprobs.get("content")
        if isinstance(choice_logprobs, dict)
        else choice_logprobs.content
    )
    if not content:
        return []
    first = content[0]
    top = first.get("top_logprobs") if isinstance(first, dict) else first.top_logprobs
    out = []
    for t in top or []:
        tok, lp = (t["token"], t["logprob"]) if isinstance(t, dict) else (t.token, t.logprob)
        out.append((str(tok), float(lp)))
    return out


class ProxyBackend:
    """The run's own proxy, in process: each call is a session of its own in group
    ``judge-<group>`` (recorded, never trained)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.model = str(proxy.model_name)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply:
        sessions = self.proxy.sessions
        session = sessions.create(group_id=f"judge-{group}", metadata={"judge": True})
        request: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if top_logprobs:
            request.update(logprobs=True, top_logprobs=top_logprobs)
        reason, error = "terminated", None
        try:
            body = await self.proxy.complete(session, request)
        except ApiError as exc:
            reason, error = "judge_error", {"kind": "judge_error", "message": exc.message}
            raise JudgeError(f"the judge's call failed: {exc.message}") from None
        finally:
            sessions.end(session, reason=reason, error=error)
            sessions.release(session.id)
        usage = body.get("usage") or {}
        choice = body["choices"][0]
        return Reply(
            choice["message"].get("content") or "",
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            _first_top(choice.get("logprobs")),
        )


class HttpBackend:
    """Any OpenAI-compatible endpoint, with the ``openai`` client (no retries of its own:
    :class:`Judge` retries and times out)."""

    def __init__(self, base_url: str, model: str | None, api_key: str, timeout_s: float) -> None:
        self.base_url = base_url
        self.model = model or ""
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0
        )

    async def check(self) -> None:
        """Reach the endpoint once; without ``model``, take the first model it serves."""
        try:
            models = [m.id async for m in self.client.models.list()]
        except openai.OpenAIError as exc:
            raise ConfigError(
                f"rewards.judge.base_url: cannot reach the judge at {self.base_url}: {exc}; "
                "start it first (e.g. areal-agent serve) or fix the URL"
            ) from None
        if not self.model:
            if not models:
                raise ConfigError(
                    f"rewards.judge.model: the judge at {self.base_url} lists no models; "
                    "set rewards.judge.model"
                )
            self.model = models[0]

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply:
        extra: dict[str, Any] = {}
        if top_logprobs:
            extra = {"logprobs": True, "top_logprobs": top_logprobs}
        try:
            resp = await self.client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=temperature,
                **extra,
            )
        except openai.OpenAIError as exc:
            raise JudgeError(f"the judge's call failed: {exc}") from None
        if not resp.choices:
            raise JudgeError("the judge's reply has no choices")
        usage, choice = resp.usage, resp.choices[0]
        return Reply(
            choice.message.content or "",
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            _first_top(choice.logprobs),
        )

    async def close(self) -> None:
        await self.client.close()


# ---------------------------------------------------------------------------- the judge
