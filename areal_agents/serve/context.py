"""What the proxy does with a conversation that outgrows the model's context.

An agent's conversation grows with every turn; past ``Proxy.max_context`` the engine cannot
take it. A :class:`ContextPolicy` (``Proxy(..., context_policy=...)``, or the ``context``
section of a training config) says what the proxy does then, for every caller alike
(env-driven episodes, in-process agents, agents over HTTP):

``fail`` (the default)
    A prompt of ``max_context`` tokens or more is a 400 ``context_length_exceeded``
    (counted in ``context_overflow``); the runner ends the episode as ``context_overflow``.

``truncate_tool_results``
    When prompt + ``reserve_tokens`` would not fit, the content of the oldest tool results
    is replaced by a marker (``[tool result truncated: N chars]``), oldest first, until it
    fits; the leading system messages, the first user message and the last
    ``keep_last_turns`` turns (a turn starts at an assistant message) are never touched.
    The fewest truncations that fit are taken, so the next, longer request of the same
    conversation truncates the same results (and more only when it must): its prompt
    extends the previous one and the turns between rewrites train as one sample.

``summarize``
    When prompt + ``reserve_tokens`` would not fit, the model itself summarizes the older
    turns (everything between the system messages + first user message and the last
    ``keep_last_turns`` turns): a summary call through the same engine, greedy (at the
    request's own sampling when ``summary_trained``), at most ``summary_max_tokens`` tokens,
    recorded in the session as a completion of its own (``context_rewrite:
    "summary_call"``, trained only when ``summary_trained``). The older turns are then sent
    as one user message holding the summary (:data:`SUMMARY_PREFIX`). Later requests of the
    conversation reuse that summary while they fit; when they no longer do, a new summary
    is written from the previous one and the turns after it. A summary that does not make
    the prompt fit (or a summary request that cannot fit itself, even with its own tool
    results truncated) falls back to ``truncate_tool_results``.

Under both rewriting policies a prompt that cannot be brought to fit with
``reserve_tokens`` to spare is still sent if it fits the context at all (as ``fail`` would
send it, with less room to answer), and is a 400 ``context_length_exceeded`` otherwise.

The recorded completion keeps the client's own ``messages`` (its parent is found on them, so
the completion tree and its returns run across rewrites), ``context_edits`` (what was sent
instead), the ``prompt_ids`` actually sampled from, ``context_rewrite`` (``"truncated"`` or
``"summarized"``) and its ``segment`` (see :class:`~areal_agents.trajectory.Completion`).
The proxy counts ``context_rewrites`` (requests sent rewritten), ``context_truncated``,
``context_summarized``, ``context_summary_calls``, ``context_summary_fallbacks`` (a summary
that did not help) and ``context_overflow`` in ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from areal_agents.trajectory import Completion, message_key

PolicyName = Literal["fail", "truncate_tool_results", "summarize"]
POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)
"""The values of :attr:`ContextPolicy.policy`."""

SUMMARY_PREFIX = "Summary of the earlier part of this conversation, shortened to fit the context:"
"""The first line of the user message that holds a summary in place of the older turns."""

SUMMARY_INSTRUCTION = (
    "The conversation above is too long for the context window and its older part will be "
    "replaced by your summary. Write that summary for yourself, to continue the task from it: "
    "the task, what has been done so far, the facts found (tool results, numbers, names, "
    "paths) that are still needed, and what remains to do. Answer with the summary only."
)
"""The user message that ends a summary call's request."""


@dataclass(frozen=True)
class ContextPolicy:
    """What the proxy does with a conversation that outgrows the model's context
    (``model.max_context``), for env-driven, in-process and external agents alike
    (:mod:`areal_agents.serve.context`); a wrong value is a ``ValueError`` naming the field."""

    policy: PolicyName = "fail"
    """``fail``: the call is a 400 ``context_length_exceeded`` and the episode ends as
    ``context_overflow``. ``truncate_tool_results``: the oldest tool results are replaced by
    a marker until the prompt leaves ``reserve_tokens`` free. ``summarize``: the model
    summarizes the older turns (a recorded call of its own) and they are sent as that
    summary; truncation when the summary does not make it fit. A rewritten call starts a
    new segment: a training sample of its own, its returns still along the episode's tree."""
    reserve_tokens: int = 512
    """Tokens kept free for the answer: a request is rewritten once its prompt + this would
    exceed the context (the rewriting policies only)."""
    keep_last_turns: int = 2
    """The last this many turns (a turn starts at an assistant message and holds the tool
    results and user messages after it) are never truncated nor summarized; 0 = none kept
    (the rewriting policies only)."""
    summary_max_tokens: int = 512
    """``summarize``: the longest summary in tokens."""
    summary_trained: bool = False
    """``summarize``: train the summary calls like the agent's own (sampled at the
    request's temperature); false: they are greedy and carry no loss."""

    def __post_init__(self) -> None:
        if problems := self.problems():
            raise ValueError("invalid context policy: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        """The checks of a config section (``areal_agents.trainer.config_io`` runs them on
        the ``context`` section, which it builds without ``__post_init__``)."""
        return self.problems()

    def problems(self, max_context: int | None = None) -> list[str]:
        """What is wrong with these values (and, given ``max_context``, with the token
        counts this policy uses against it), each as ``"field: what is wrong"``."""
        out = []
        if self.policy not in POLICIES:
            out.append(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        lows = (("reserve_tokens", 0, ""), ("keep_last_turns", 0, " (0 = no turn kept whole)"))
        for name, low, note in (*lows, ("summary_max_tokens", 1, "")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                out.append(f"{name}: must be an integer >= {low}{note}, got {value!r}")
        if not isinstance(self.summary_trained, bool):
            out.append(f"summary_trained: must be true or false, got {self.summary_trained!r}")
        if max_context is not None and not out:  # what this policy uses must fit
            used = {"fail": (), "truncate_tool_results": ("reserve_tokens",)}
            for name in used.get(self.policy, ("reserve_tokens", "summary_max_tokens")):
                if getattr(self, name) >= max_context:
                    out.append(
                        f"{name}: must be below the model's context of {max_context} tokens, "
                        f"got {getattr(self, name)}; lower it (or raise model.max_context)"
                    )
        return out

    @classmethod
    def of(cls, value: ContextPolicy | Mapping[str, Any] | str | None) -> ContextPolicy:
        """A policy from a policy, a mapping of its fields, a policy name, or None (the
        default, ``fail``)."""
        if value is None:
            return cls()
        if isinstance(value, ContextPolicy):
            return value
        if isinstance(value, str):
            return cls(policy=value)  # type: ignore[arg-type]  # checked when built
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            if unknown := sorted(set(value) - known):
                raise ValueError(
                    f"invalid context policy: unknown keys {unknown}; the keys are "
                    f"{', '.join(sorted(known))}"
                )
            return cls(**value)
        raise TypeError(
            f"context_policy: expected a ContextPolicy, a mapping or a policy name, got "
            f"{type(value).__name__}"
        )


# ---------------------------------------------------------------------- where to rewrite
def turn_bounds(messages: Sequence[Mapping[str, Any]], keep_last_turns: int) -> tuple[int, int]:
    """``(head, kept)``: ``messages[:head]`` are never rewritten (the leading system messages
    and the first user message, when it comes before any assistant message), and
    ``messages[kept:]`` are the last ``keep_last_turns`` turns, each starting at an
    assistant message. What lies between may be rewritten (``head <= kept``)."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    for i in range(head, len(messages)):
        role = messages[i].get("role")
        if role == "user":
            head = i + 1
            break
        if role == "assistant":
            break
    if keep_last_turns == 0:
        return head, len(messages)
    starts = [i for i in range(head, len(messages)) if messages[i].get("role") == "assistant"]
    kept = starts[-keep_last_turns] if len(starts) >= keep_last_turns else head
    return head, max(head, kept)


def truncation_marker(chars: int) -> str:
    """What a truncated tool result says instead of its ``chars`` characters."""
    return f"[tool result truncated: {chars} chars]"


def truncatable(messages: Sequence[Mapping[str, Any]], start: int, end: int) -> list[int]:
    """The indices in ``[start, end)`` of tool results that a marker would shorten, oldest
    first."""
    out = []
    for i in range(start, end):
        m = messages[i]
        if m.get("role") == "tool":
            chars = len(_text(m.get("content")))
            if chars > len(truncation_marker(chars)):
                out.append(i)
    return out


def truncation_edits(
    messages: Sequence[Mapping[str, Any]], indices: Sequence[int]
) -> list[dict[str, Any]]:
    """The ``context_edits`` that replace the content of the tool results at ``indices``
    (ascending) by their marker."""
    return [
        {
            "start": i,
            "end": i + 1,
            "messages": [
                {
                    **messages[i],
                    "content": truncation_marker(len(_text(messages[i].get("content")))),
                }
            ],
        }
        for i in indices
    ]


# ---------------------------------------------------------------------- summaries
def summary_message(summary: str) -> dict[str, Any]:
    """The user message that stands for the summarized turns."""
    return {"role": "user", "content": f"{SUMMARY_PREFIX}\n\n{summary.strip()}"}


def summary_request(
    messages: Sequence[dict[str, Any]],
    head: int,
    end: int,
    previous: tuple[int, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The request of a summary call for ``messages[head:end]``: the head, the turns to
    summarize and :data:`SUMMARY_INSTRUCTION`. With ``previous = (cut, summary message)``
    the turns before ``cut`` are already summarized: that summary stands for them."""
    start, carried = head, []
    if previous is not None:
        start, carried = previous[0], [previous[1]]
    return [
        *messages[:head],
        *carried,
        *messages[start:end],
        {"role": "user", "content": SUMMARY_INSTRUCTION},
    ]


def summary_text(message: Mapping[str, Any]) -> str:
    """The summary a summary call answered (its content; reasoning left out)."""
    return _text(message.get("content")).strip() or "(no summary)"


def previous_summary(
    earlier: Sequence[Completion], messages: Sequence[Mapping[str, Any]], head: int
) -> tuple[int, dict[str, Any]] | None:
    """``(cut, summary message)`` of the latest summarized completion among ``earlier``
    whose summary covers turns that ``messages`` still starts with (``messages[head:cut]``),
    or None: that summary may stand for them again."""
    keys: list[tuple[Any, ...]] | None = None
    for c in reversed(earlier):
        if c.context_rewrite != "summarized" or not c.context_edits:
            continue
        edit = c.context_edits[0]
        cut = int(edit["end"])
        if int(edit["start"]) != head or not cut < len(messages) or cut > len(c.messages):
            continue
        if keys is None:
            keys = [message_key(dict(m)) for m in messages]
        if [message_key(m) for m in c.messages[:cut]] == keys[:cut]:
            return cut, dict(edit["messages"][0])
    return None


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


__all__ = [
    "POLICIES",
    "SUMMARY_INSTRUCTION",
    "SUMMARY_PREFIX",
    "ContextPolicy",
    "previous_summary",
    "summary_message",
    "summary_request",
    "summary_text",
    "truncatable",
    "truncation_edits",
    "truncation_marker",
    "turn_bounds",
]
