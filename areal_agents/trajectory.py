"""Token-level trajectories: completions, episodes, discounted returns and training samples.

The data contract, in code (what every engine, proxy and trainer path agrees on):

* A :class:`Completion` is one model call with the exact token ids sampled, their logprobs and
  policy versions, and the parsed assistant message.
* An :class:`Episode` is the completions of one session plus the links between them: a
  completion's parent is the earlier completion whose request messages followed by its reply
  are a prefix of the new request's messages (the longest such; the latest on ties). Parallel
  calls and sub-agents therefore form a forest, not a line.
* Rewards are per turn (on a completion, or on a tool call id, which maps to the completion
  that made the call) and final. The final reward is credited to every leaf completion (one
  that no later completion continues), so it ends each branch of the episode.
* The discounted return follows the tree::

      G(c) = r(c) + gamma * mean(G(child) for child in children(c))      (0 without children)

  where r(c) is the sum of the rewards attached to c (plus the final reward for leaves).
  Several children are averaged so that fanning out does not multiply the return. With
  gamma = 1 and only a final reward R, every completion gets G = R.
* Training samples: one per completion (prompt tokens masked), except that a child whose
  prompt ids extend its parent's prompt + output ids *exactly* is appended to the parent's
  sample, the in-between tokens (tool results, user turns, template glue) masked. Only an only
  child merges (a parent with several children would otherwise be trained several times). The
  decision for every completion is recorded in ``merge`` and summarised as metrics.
* Context rewrites (:mod:`areal_agents.serve.context`): when the proxy had to shorten a request
  to fit the model's context, ``messages`` stays what the client sent (parents are found on
  it, so the tree and its returns run across the rewrite), ``context_edits`` says what was
  sent instead (:attr:`Completion.sent_messages`) and ``prompt_ids`` are its tokens, as
  sampled from. Such a completion starts a new ``segment``: its prompt does not extend its
  parent's, so it gets a sample of its own (merge reason ``context_rewrite``); the calls
  after it in the same segment merge into it as usual. A summary call the proxy made is a
  completion of its own (``context_rewrite == "summary_call"``), outside the tree: no
  parent, no children, a leaf credited with the final reward like any other, but not a
  root of the episode's return (``areal_agents.trainer.advantage.completion_returns``); untrained
  (``trained=False``, no sample) unless the policy trains summaries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SUMMARY_CALL = "summary_call"
"""``Completion.context_rewrite`` of a call the proxy made to summarize a conversation."""


@dataclass
class Completion:
    """One model call, recorded token by token."""

    id: str
    messages: list[dict[str, Any]]
    """The request's messages, as the client sent them (normalised to OpenAI dicts)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    message: dict[str, Any]
    """The assistant message returned to the client (content, tool_calls)."""
    finish_reason: str
    tools: list[dict[str, Any]] | None = None
    parse_errors: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    latency_s: float = 0.0
    queue_s: float = 0.0
    parent_id: str | None = None
    reward: float = 0.0
    """Sum of the per-turn rewards attached to this completion."""
    agent: str | None = None
    """The agent that made the call, as its request named it (header ``X-Areal-Agent``;
    ``run_agent`` sends the name of the SDK agent whose turn it is). ``agent.train`` picks
    the agents whose completions are trained."""
    context_rewrite: str | None = None
    """How the proxy rewrote a request that outgrew the model's context
    (:mod:`areal_agents.serve.context`): ``"truncated"`` (old tool results replaced by a marker),
    ``"summarized"`` (older turns replaced by a summary), ``"summary_call"`` (this call
    wrote such a summary), or None (sent as the client sent it)."""
    context_edits: list[dict[str, Any]] | None = None
    """What was sent instead of ``messages`` when the request was rewritten: edits
    ``{start, end, messages}`` in order, each replacing ``messages[start:end]`` (indices
    into ``messages``) by ``messages`` (see :attr:`sent_messages`); None when not rewritten.
    ``messages`` stays the client's own request, so parent links follow the conversation
    the client holds, across rewrites."""
    segment: int = 0
    """Which context segment of its branch this call belongs to: a root starts at 0 (1 when
    its own request was rewritten), and a child has its parent's segment, plus 1 when what
    it sent does not continue what its parent sent and answered (a rewrite began a new
    segment; :meth:`Episode.add` sets it). A summary call has the segment it opens."""
    trained: bool = True
    """False: recorded, but its tokens carry no loss (:func:`build_samples` gives it no
    sample; its merge decision says ``not_trained``). The proxy records its summary calls
    with False unless ``summary_trained``."""

    @property
    def tool_call_ids(self) -> list[str]:
        return [tc.get("id", "") for tc in self.message.get("tool_calls") or []]

    @property
    def sent_messages(self) -> list[dict[str, Any]]:
        """The messages rendered into ``prompt_ids``: ``messages`` with ``context_edits``
        applied (``messages`` itself when the request was not rewritten)."""
        return apply_edits(self.messages, self.context_edits)


def apply_edits(
    messages: list[dict[str, Any]], edits: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` with each edit ``{start, end, messages}`` (in order, not overlapping,
    indices into ``messages``) replacing ``messages[start:end]`` by its ``messages``."""
    if not edits:
        return messages
    out: list[dict[str, Any]] = []
    at = 0
    for e in edits:
        start, end = int(e["start"]), int(e["end"])
        if not at <= start <= end <= len(messages):
            raise ValueError(
                f"context edit [{start}, {end}) does not fit {len(messages)} messages "
                f"after position {at}"
            )
        out.extend(messages[at:start])
        out.extend(e["messages"])
        at = end
    out.extend(messages[at:])
    return out


@dataclass
class TrainingSample:
    """One training sequence: prompt + outputs of one or more merged completions."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 where the token was sampled by the policy (trained on), 0 for prompt / tool / user."""
    logprobs: list[float]
    """Behaviour logprob of each sampled token (0.0 where loss_mask is 0)."""
    versions: list[int]
    """Policy version of each sampled token (-1 where loss_mask is 0)."""
    completion_ids: list[str]
    token_completion: list[int]
    """Index into ``completion_ids`` of each sampled token (-1 where loss_mask is 0)."""
    returns: list[float]
    """Discounted return of each completion in ``completion_ids``."""


@dataclass
class Episode:
    """All completions of one session, with rewards and how the episode ended."""

    session_id: str
    completions: list[Completion] = field(default_factory=list)
    final_reward: float | None = None
    group_id: str | None = None
    task_id: str | None = None
    ended: bool = False
    end_reason: str | None = None
    """"terminated", "truncated", or a rollout error kind (e.g. "tool_error", "timeout")."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The message keys of each recorded completion's request, so that linking a new
        # completion does not re-key the whole episode (see ``_chain``).
        self._request_keys: dict[int, tuple[Completion, int, list[tuple[Any, ...]]]] = {}
        self.bases: dict[str, PromptBase] = {}
        """Known :class:`PromptBase` of completions (by id), e.g. as read from a store: a
        cache for delta reads, which compute the rest."""

    def __getstate__(self) -> dict[str, Any]:
        # The caches: copies and pickles (sent to trainer processes) go without.
        return {k: v for k, v in self.__dict__.items() if k not in ("_request_keys", "bases")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._request_keys, self.bases = {}, {}

    # -- building --------------------------------------------------------------------
    def add(self, completion: Completion) -> Completion:
        """Append ``completion``, linking it to its parent (see the module docstring) and
        setting its :attr:`~Completion.segment`. A summary call (``context_rewrite ==
        "summary_call"``) is never linked: it has no parent and is no one's parent."""
        keys = [message_key(m) for m in completion.messages]
        if completion.context_rewrite == SUMMARY_CALL:
            completion.parent_id = None
        else:
            completion.parent_id = _longest_prefix(self.completions, keys, self._chain)
            completion.segment = self._segment(completion, keys)
        self.completions.append(completion)
        self._request_keys[id(completion)] = (completion, len(completion.messages), keys)
        return completion

    def _segment(self, c: Completion, keys: list[tuple[Any, ...]]) -> int:
        """``c``'s segment (see :attr:`Completion.segment`), its parent already linked."""
        parent = self.by_id(c.parent_id) if c.parent_id is not None else None
        if parent is None:
            return 1 if c.context_edits else 0
        if not (c.context_edits or parent.context_edits):
            return parent.segment  # both as the client sent them: the link is the prefix
        sent = keys if not c.context_edits else [message_key(m) for m in c.sent_messages]
        before = [*(message_key(m) for m in parent.sent_messages), message_key(parent.message)]
        return parent.segment + (0 if sent[: len(before)] == before else 1)

    def _chain(self, c: Completion) -> list[tuple[Any, ...]]:
        """The keys of ``c.messages`` (remembered since ``add``) + ``c.message``."""
        known = self._request_keys.get(id(c))
        if known is None or known[0] is not c or known[1] != len(c.messages):
            return _chain_keys(c)
        return [*known[2], message_key(c.message)]

    def by_id(self, completion_id: str) -> Completion | None:
        return next((c for c in self.completions if c.id == completion_id), None)

    def by_tool_call(self, tool_call_id: str) -> Completion | None:
        return next((c for c in self.completions if tool_call_id in c.tool_call_ids), None)

    def children(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {c.id: [] for c in self.completions}
        for c in self.completions:
            if c.parent_id is not None:
                out[c.parent_id].append(c.id)
        return out

    # -- credit ------------------------------------------------------------------------
    def returns(self, gamma: float = 1.0) -> dict[str, float]:
        """Discounted return of every completion: G(c) = r(c) + gamma * mean G(children)."""
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        kids = self.children()
        final = self.final_reward or 0.0
        out: dict[str, float] = {}
        # Children always come after their parent, so a reverse pass sees children first.
        for c in reversed(self.completions):
            ch = kids[c.id]
            future = sum(out[k] for k in ch) / len(ch) if ch else 0.0
            own = c.reward + (final if not ch else 0.0)
            out[c.id] = own + gamma * future
        return out

    def samples(self, gamma: float = 1.0) -> tuple[list[TrainingSample], list[dict[str, Any]]]:
        """Training samples and the merge decision of every completion."""
        return build_samples(self, gamma)

    # -- export ------------------------------------------------------------------------
    def to_dict(
        self,
        gamma: float = 1.0,
        *,
        prompts: str = "full",
        offset: int = 0,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """The episode as JSON-ready data.

        ``prompts="full"``: every completion carries its ``messages`` and ``prompt_ids``, and
        the training ``samples`` come along (O(turns²) for long episodes). ``"delta"``: each
        completion carries ``prompt_base`` ``{completion_id, tokens, messages}`` (or None)
        plus ``prompt_suffix`` and ``messages_suffix`` instead (see :class:`PromptBase`;
        :func:`episode_from_dict` rebuilds the full form), and no samples: O(tokens).
        ``offset``/``limit`` page through the completions (``next_offset``: None on the last
        page); a paged read has no samples either.
        """
        if prompts not in ("full", "delta"):
            raise ValueError(f"prompts must be 'full' or 'delta', got {prompts!r}")
        rets = self.returns(gamma)
        end = len(self.completions) if limit is None else min(len(self.completions), offset + limit)
        whole = prompts == "full" and offset == 0 and end == len(self.completions)
        if whole:
            samples, merges = build_samples(self, gamma)
            n_samples = len(samples)
        else:  # no samples to build: the decisions alone, O(tokens)
            samples, merges = [], merge_decisions(self)
            n_samples = sum(1 for m in merges if not m["merged"] and m["reason"] != "not_trained")
        completions = []
        for i in range(offset, end):
            c, m = self.completions[i], merges[i]
            if prompts == "full":
                d = asdict(c)
            else:
                # Shallow: asdict would deep-copy every prompt first (O(turns²) again).
                d = {k: getattr(c, k) for k in _COMPLETION_FIELDS if k not in _FULL_ONLY}
                base = self.bases.get(c.id) or prompt_base(self.completions[:i], c)
                d["prompt_base"] = (
                    None
                    if base.index is None
                    else {
                        "completion_id": self.completions[base.index].id,
                        "tokens": base.tokens,
                        "messages": base.messages,
                    }
                )
                d["prompt_suffix"] = c.prompt_ids[base.tokens :]
                d["messages_suffix"] = c.messages[base.messages :]
            d["return"] = rets[c.id]
            d["merge"] = m
            completions.append(d)
        merged = sum(1 for m in merges if m["merged"])
        eligible = sum(1 for m in merges if m["reason"] not in UNMERGEABLE)
        return {
            "session_id": self.session_id,
            "group_id": self.group_id,
            "task_id": self.task_id,
            "ended": self.ended,
            "end_reason": self.end_reason,
            "errors": self.errors,
            "final_reward": self.final_reward,
            "gamma": gamma,
            "prompts": prompts,
            "offset": offset,
            "next_offset": end if end < len(self.completions) else None,
            "completions": completions,
            "samples": [asdict(s) for s in samples] if whole else None,
            "metrics": {
                "completions": len(self.completions),
                "samples": n_samples,
                "merge_rate": merged / eligible if eligible else 0.0,
                "merge_mismatches": sum(1 for m in merges if m["reason"] == "token_mismatch"),
                "output_tokens": sum(len(c.output_ids) for c in self.completions),
            },
            "metadata": self.metadata,
        }

    def snapshot(self) -> Episode:
        """A copy that later records do not change (completions shared, not copied)."""
        copy = Episode(
            self.session_id,
            completions=list(self.completions),
            final_reward=self.final_reward,
            group_id=self.group_id,
            task_id=self.task_id,
            ended=self.ended,
            end_reason=self.end_reason,
            errors=list(self.errors),
            metadata=dict(self.metadata),
        )
        copy.bases = dict(self.bases)
        return copy


_COMPLETION_FIELDS = tuple(Completion.__dataclass_fields__)
_FULL_ONLY = ("messages", "prompt_ids")


def episode_from_dict(data: dict[str, Any]) -> Episode:
    """The :class:`Episode` of a trajectory read (``to_dict``, full or delta, all pages
    concatenated), prompts and messages rebuilt exactly; rewards as recorded."""
    built: list[Completion] = []
    by_id: dict[str, Completion] = {}
    for d in data["completions"]:
        fields = {k: v for k, v in d.items() if k in _COMPLETION_FIELDS}
        if "prompt_ids" not in d:
            base = d.get("prompt_base")
            prompt, messages = list(d["prompt_suffix"]), list(d["messages_suffix"])
            if base is not None:
                b = by_id[base["completion_id"]]
                prompt = [*(b.prompt_ids + b.output_ids)[: base["tokens"]], *prompt]
                messages = [*[*b.messages, b.message][: base["messages"]], *messages]
            fields["prompt_ids"], fields["messages"] = prompt, messages
        c = Completion(**fields)
        built.append(c)
        by_id[c.id] = c
    return Episode(
        data["session_id"],
        completions=built,
        final_reward=data.get("final_reward"),
        group_id=data.get("group_id"),
        task_id=data.get("task_id"),
        ended=bool(data.get("ended")),
        end_reason=data.get("end_reason"),
        errors=list(data.get("errors") or []),
        metadata=dict(data.get("metadata") or {}),
    )


# ------------------------------------------------------------------ parent links
def message_key(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages "the same" for parent linking.

    Role, text content (a list of text parts is joined; None is ""), tool calls by name and
    canonical JSON arguments, and the tool_call_id of tool results. Ids of tool calls are
    ignored: clients may rewrite them.
    """
    content = msg.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = tuple(
        (tc.get("function", {}).get("name"), _canonical_args(tc.get("function", {})))
        for tc in msg.get("tool_calls") or []
    )
    return (msg.get("role"), (content or "").strip(), calls, msg.get("tool_call_id") or "")


def _canonical_args(fn: dict[str, Any]) -> str:
    args = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return args.strip()
    return json.dumps(args, sort_keys=True, separators=(",", ":"))


def find_parent(earlier: Iterable[Completion], messages: list[dict[str, Any]]) -> str | None:
    """The id of the earlier completion that ``messages`` continues, or None."""
    return _longest_prefix(earlier, [message_key(m) for m in messages], _chain_keys)


def _chain_keys(c: Completion) -> list[tuple[Any, ...]]:
    return [*(message_key(m) for m in c.messages), message_key(c.message)]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _longest_prefix(
    earlier: Iterable[Completion],
    keys: list[tuple[Any, ...]],
    chain_of: Callable[[Completion], list[tuple[Any, ...]]],
) -> str | None:
    """The id of the completion whose keys (``chain_of``: its messages', then its reply's)
    are the longest prefix of ``keys``; the latest on ties."""
    best: tuple[int, str] | None = None
    for c in earlier:
        if c.context_rewrite == SUMMARY_CALL:  # a request of the proxy's own, not a turn
            continue
        n = len(c.messages) + 1
        if n > len(keys) or (best is not None and n < best[0]):
            continue
        if chain_of(c) == keys[:n]:
            best = (n, c.id)
    return best[1] if best else None


# ------------------------------------------------------------------ prompt deltas
@dataclass(frozen=True)
class PromptBase:
    """How a completion's request extends an earlier completion of its episode.

    ``prompt_ids == (base.prompt_ids + base.output_ids)[:tokens] + suffix`` and
    ``messages == (base.messages + [base.message])[:messages] + suffix``, where ``base`` is
    completion number ``index`` (None: no base, everything is suffix).
    """

    index: int | None
    tokens: int = 0
    messages: int = 0


def prompt_base(earlier: Sequence[Completion], c: Completion) -> PromptBase:
    """The base of ``c`` among the ``earlier`` completions of its episode: its parent in the
    tree or the completion just before it (parallel calls share a prompt), whichever shares
    more prompt tokens with it. Storing only the rest makes an episode O(tokens)."""
    candidates: list[int] = []
    if c.parent_id is not None:
        i = next((k for k in range(len(earlier) - 1, -1, -1) if earlier[k].id == c.parent_id), -1)
        if i >= 0:
            candidates.append(i)
    if earlier and (not candidates or candidates[0] != len(earlier) - 1):
        candidates.append(len(earlier) - 1)
    best = PromptBase(None)
    for i in candidates:
        b = earlier[i]
        tokens = _shared_prefix(c.prompt_ids, b.prompt_ids + b.output_ids)
        if best.index is None or tokens > best.tokens:
            chain = [*b.messages, b.message]
            n = len(chain)
            if c.messages[:n] != chain:  # else the usual case, compared at C speed
                n = 0
                while n < min(len(chain), len(c.messages)) and chain[n] == c.messages[n]:
                    n += 1
            best = PromptBase(i, tokens, n)
    return best


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed
        return n
    return common_prefix_len(a, b)


# ------------------------------------------------------------------ samples
def build_samples(
    episode: Episode, gamma: float = 1.0
) -> tuple[list[TrainingSample], list[dict[str, Any]]]:
    """Build training samples, merging only children that extend their parent exactly."""
    rets = episode.returns(gamma)
    samples: list[TrainingSample] = []
    owner: dict[str, int] = {}  # completion id -> index of its sample
    merges = merge_decisions(episode)
    for c, decision in zip(episode.completions, merges, strict=True):
        if decision["reason"] == "not_trained":
            continue
        if decision["merged"]:
            s = samples[owner[c.parent_id]]  # type: ignore[index]
            gap = c.prompt_ids[len(s.input_ids) :]
            _extend_masked(s, gap)
            owner[c.id] = owner[c.parent_id]  # type: ignore[index]
        else:
            s = TrainingSample([], [], [], [], [], [], [])
            _extend_masked(s, c.prompt_ids)
            samples.append(s)
            owner[c.id] = len(samples) - 1
        s.completion_ids.append(c.id)
        s.returns.append(rets[c.id])
        idx = len(s.completion_ids) - 1
        s.input_ids.extend(c.output_ids)
        s.loss_mask.extend([1] * len(c.output_ids))
        s.logprobs.extend(c.output_logprobs)
        s.versions.extend(c.output_versions)
        s.token_completion.extend([idx] * len(c.output_ids))
    return samples, merges


UNMERGEABLE = ("root", "not_trained")
"""Merge reasons of completions that have no parent sample to merge into (left out of the
merge rate)."""


def merge_decisions(episode: Episode) -> list[dict[str, Any]]:
    """The merge decision of every completion, as :func:`build_samples` makes it, without
    building the samples: a sample always ends with its last completion's prompt + output,
    so a child merges iff it is its parent's only child and its prompt starts with the
    parent's prompt + output (known from :attr:`Episode.bases` where recorded).

    A completion that is not trained (:attr:`Completion.trained`) gets no sample
    (``not_trained``), and its children none of its (``parent_not_trained``). A child whose
    prompt does not extend its parent's because the proxy rewrote the context in between
    (another :attr:`Completion.segment`) is ``context_rewrite``, not a ``token_mismatch``."""
    kids = episode.children()
    index = {c.id: i for i, c in enumerate(episode.completions)}
    out: list[dict[str, Any]] = []
    for c in episode.completions:
        if not c.trained:
            out.append({"merged": False, "reason": "not_trained"})
            continue
        if c.parent_id is None:
            out.append({"merged": False, "reason": "root"})
            continue
        siblings = len(kids[c.parent_id])
        if siblings > 1:
            out.append(
                {"merged": False, "reason": "parent_has_several_children", "children": siblings}
            )
            continue
        p = episode.completions[index[c.parent_id]]
        if not p.trained:
            out.append({"merged": False, "reason": "parent_not_trained"})
            continue
        n = len(p.prompt_ids) + len(p.output_ids)
        known = episode.bases.get(c.id)
        if known is not None and known.index == index[p.id] and known.tokens == n:
            out.append({"merged": True, "reason": "token_prefix"})
            continue
        shared = _shared_prefix(c.prompt_ids, p.prompt_ids + p.output_ids)
        if shared == n:
            out.append({"merged": True, "reason": "token_prefix"})
        else:
            why = "context_rewrite" if c.segment != p.segment else "token_mismatch"
            out.append({"merged": False, "reason": why, "position": shared})
    return out


def _extend_masked(s: TrainingSample, ids: list[int]) -> None:
    s.input_ids.extend(ids)
    s.loss_mask.extend([0] * len(ids))
    s.logprobs.extend([0.0] * len(ids))
    s.versions.extend([-1] * len(ids))
    s.token_completion.extend([-1] * len(ids))
