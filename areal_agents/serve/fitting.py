"""The context policy applied to a prompt: what the proxy sends for a conversation that
would outgrow the model's context.

:class:`ContextFitting` (a layer of :class:`~areal_agents.serve.proxy.Proxy`, over
:class:`~areal_agents.serve.generation.Generation`) fits each request's prompt as its
:class:`~areal_agents.serve.context.ContextPolicy` says: sent as is, the oldest tool results
truncated (the fewest that leave ``reserve_tokens`` free), or the older turns replaced by a
summary the model writes (a summary call of its own, recorded before the completion it made
room for). The message edits themselves are :mod:`areal_agents.serve.context`'s; this
module tokenizes, searches and calls the model.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from areal_agents.serve import context as ctx
from areal_agents.serve.context import ContextPolicy
from areal_agents.serve.generation import Generation, PromptTooLong
from areal_agents.serve.schemas import ChatCompletionRequest
from areal_agents.serve.session import Session
from areal_agents.trajectory import SUMMARY_CALL, Completion, apply_edits, find_parent


@dataclass
class Fitted:
    """The prompt a request is sent as (:meth:`ContextFitting._fit`): its ids, the edits
    that made it from the request's messages and their kind (None: as sent), and the
    summary calls made for it."""

    ids: list[int]
    edits: list[dict[str, Any]] | None = None
    rewrite: str | None = None
    summaries: list[Completion] = field(default_factory=list)


class ContextFitting(Generation):
    """Fits a request's prompt to the model's context by :attr:`context_policy` (see the
    module docstring)."""

    context_policy: ContextPolicy

    async def _fit(
        self,
        session: Session | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        agent: str | None,
    ) -> Fitted:
        """The prompt to send for ``messages``, rewritten by :attr:`context_policy` when it
        would not leave ``reserve_tokens`` free (:mod:`areal_agents.serve.context`)."""
        policy = self.context_policy
        if policy.policy == "fail":
            return Fitted(await self._encode(messages, tools, req))
        limit = self._limit(policy.reserve_tokens)
        try:
            return Fitted(await self._tokens(messages, tools, req, limit))
        except PromptTooLong:
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
            except PromptTooLong:
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
    ) -> Fitted:
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
            except PromptTooLong as exc:
                hint = (
                    f"context.policy={policy.policy} truncated {len(candidates)} tool results "
                    f"and keeps the last {policy.keep_last_turns} turns whole; shorten the "
                    "conversation (or lower keep_last_turns)"
                )
                raise self._overflow(str(exc), hint) from None
        if edits is None:
            return Fitted(ids)
        self.counters["context_rewrites"] += 1
        self.counters["context_truncated"] += 1
        return Fitted(ids, edits, "truncated")

    async def _summarized(
        self,
        session: Session | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        req: ChatCompletionRequest,
        agent: str | None,
    ) -> tuple[Fitted | None, list[Completion]]:
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
                return Fitted(ids, edits, "summarized"), []
            except PromptTooLong:
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
        except PromptTooLong:
            return None, [summary]
        return Fitted(ids, edits, "summarized"), [summary]

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
        except PromptTooLong:
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
