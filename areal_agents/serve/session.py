"""Sessions: one API key per episode, so a session's key only ever reaches its own episode.

The durable store (:class:`~areal_agents.serve.store.EpisodeStore`) builds on this module: it
writes and restores :class:`Session` objects, and a :class:`SessionStore` reaches it only
through what :class:`DurableStore` names.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from areal_agents.errors import SessionError, UserError
from areal_agents.trajectory import Completion, Episode


def hash_key(api_key: str) -> str:
    """The stored form of a session key: its SHA-256, hex (keys are 192-bit random tokens,
    so a fast hash is enough)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class Session:
    """A recorded episode and the key that writes to it."""

    id: str
    api_key: str
    """The key, as handed out by :meth:`SessionStore.create` ("" for a session restored from
    a store: only its hash is kept, in :attr:`key_hash`)."""
    episode: Episode
    created_at: float = field(default_factory=time.time)
    sampling: dict[str, Any] = field(default_factory=dict)
    """Defaults for this session's model calls that set none of their own: ``temperature``,
    ``top_p``, ``top_k``, ``max_tokens`` (the runner sets the run's sampling, per task kind,
    so an agent that leaves sampling to the server samples as the config says)."""
    key_hash: str = ""
    last_active: float = field(default_factory=time.time)
    stored_active: float = 0.0
    """When ``last_active`` last reached the durable store (it is written coarsely)."""
    deleted: bool = False
    """Set by :meth:`SessionStore.remove` (``DELETE /sessions/{id}``): a call still in flight
    holds the session object, and must not record into it after that."""

    def __post_init__(self) -> None:
        if self.api_key and not self.key_hash:
            self.key_hash = hash_key(self.api_key)

    @property
    def closed(self) -> bool:
        return self.episode.ended


class RewardRangeError(UserError):
    """A reward that is not finite, or that would make the episode's rewards, their sum or
    its returns overflow the float range (``param``: the request field to fix)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_rewards(
    episode: Episode,
    value: float,
    *,
    target: Completion | None = None,
    final: bool = False,
    param: str = "value",
) -> None:
    """Raise :class:`RewardRangeError` unless adding ``value`` (to ``target``'s reward, or
    with ``final`` to the episode's final reward) keeps every number computed from the
    episode's rewards finite: each completion's reward, the final reward, the episode's
    reward (their sum) and every return ``G(c) = r(c) + gamma * mean G(children)``, for
    any gamma in [0, 1]. Those returns, and the sums they are computed from, are bounded by
    the sum of ``|r(c)|`` over the completions plus ``|final reward|`` once per leaf (a
    completion without children), so that bound must be finite. The episode is not
    changed."""
    if not math.isfinite(value):
        raise RewardRangeError(
            f"{param}: {value} is not a finite number; send a finite number", param
        )
    rewards = {c.id: c.reward for c in episode.completions}
    final_reward = episode.final_reward or 0.0
    if final:
        final_reward += value
        if not math.isfinite(final_reward):
            raise RewardRangeError(
                f"{param}: adding {value!r} to the episode's final reward "
                f"{episode.final_reward!r} leaves the float range; post a smaller reward",
                param,
            )
    elif target is not None:
        rewards[target.id] = target.reward + value
        if not math.isfinite(rewards[target.id]):
            raise RewardRangeError(
                f"{param}: adding {value!r} to the reward {target.reward!r} of completion "
                f"{target.id!r} leaves the float range; post a smaller reward",
                param,
            )
    total = sum(rewards.values()) + final_reward
    parents = {c.parent_id for c in episode.completions if c.parent_id is not None}
    leaves = sum(1 for c in episode.completions if c.id not in parents)
    bound = sum(abs(r) for r in rewards.values()) + leaves * abs(final_reward)
    if not (math.isfinite(total) and math.isfinite(bound)):
        raise RewardRangeError(
            f"{param}: with {value!r} the episode's rewards would add up past the float "
            f"range (its reward, the per-turn rewards plus the final reward, or its returns, "
            f"which add the rewards along the completion tree and credit the final reward "
            f"to each of its {leaves} leaves); post smaller rewards",
            param,
        )


class DurableStore(Protocol):
    """What a :class:`SessionStore` writes through to and restores from: an
    :class:`~areal_agents.serve.store.EpisodeStore` (each write returns the future of its
    commit)."""

    def put_session(self, session: Session) -> Future[Any]: ...

    def put_header(self, session: Session) -> Future[Any]: ...

    def put_completion(
        self, session: Session, completion: Completion, seq: int, earlier: list[Completion]
    ) -> Future[Any]: ...

    def put_reward(self, session: Session, completion_id: str | None) -> Future[Any]: ...

    def put_deleted(self, session_id: str) -> Future[Any]: ...

    def session_id_for_key(self, api_key: str) -> str | None: ...

    def load(self, session_id: str) -> Session | None: ...


class SessionStore:
    """The sessions of one proxy. Not thread-safe: used from the proxy's event loop.

    Live sessions are kept in memory. With a durable :class:`~areal_agents.serve.store.EpisodeStore`
    (``durable``) every change is also queued to it, in order (await
    ``durable.flush()`` before answering a client), and ``restore=True`` lets
    :meth:`load` / :meth:`load_key` bring back sessions this process does not hold (after a
    restart); an ended session then leaves memory after ``keep_ended`` others have ended.
    """

    def __init__(
        self, durable: DurableStore | None = None, *, restore: bool = True, keep_ended: int = 256
    ) -> None:
        self.durable = durable
        self.restore = restore and durable is not None
        self.keep_ended = keep_ended
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def open_sessions(self) -> list[Session]:
        return [s for s in self._by_id.values() if not s.closed]

    def create(
        self,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Session:
        sid = "sess-" + uuid.uuid4().hex[:16]
        key = "sk-areal-" + secrets.token_urlsafe(24)
        episode = Episode(sid, group_id=group_id, task_id=task_id, metadata=dict(metadata or {}))
        session = Session(sid, key, episode)
        self._hold(session)
        if self.durable is not None:
            session.stored_active = session.last_active  # the new row carries it
            self.durable.put_session(session)
        return session

    def _hold(self, session: Session) -> None:
        self._by_id[session.id] = session
        self._by_key[session.key_hash] = session

    def get(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise SessionError(
                f"no session {session_id!r}; create one with POST /sessions"
            ) from None

    def by_key(self, api_key: str) -> Session | None:
        return self._by_key.get(hash_key(api_key))

    # -- restoring (call off the event loop: these read the database) ---------------------
    def fetch(self, session_id: str) -> Session | None:
        """The stored session ``session_id`` (None: none, or restoring is off). Reads the
        database: call it in a thread, then :meth:`adopt` the result on the loop."""
        if not self.restore or self.durable is None:
            return None
        return self.durable.load(session_id)

    def fetch_key(self, api_key: str) -> Session | None:
        if not self.restore or self.durable is None:
            return None
        sid = self.durable.session_id_for_key(api_key)
        return None if sid is None else self.durable.load(sid)

    def adopt(self, session: Session) -> Session:
        """Hold a fetched session (or the one already held under its id)."""
        held = self._by_id.get(session.id)
        if held is not None:
            return held
        self._hold(session)
        if session.closed:
            self._note_ended(session)
        return session

    def remove(self, session_id: str) -> Session:
        """Forget a session (``DELETE /sessions/{id}``): its key stops working; a store keeps
        its records, marked deleted."""
        session = self.release(session_id)
        session.deleted = True  # a call in flight must not record into it
        if self.durable is not None:
            self.durable.put_deleted(session_id)
        return session

    def release(self, session_id: str) -> Session:
        """Stop holding a session in memory (the runner, once its episode is collected); a
        store keeps it as it is."""
        session = self.get(session_id)
        del self._by_id[session_id]
        self._by_key.pop(session.key_hash, None)
        self._ended.pop(session_id, None)
        return session

    def touch(self, session: Session) -> None:
        session.last_active = time.time()

    def record(self, session: Session, completion: Completion) -> Completion:
        if session.deleted:
            raise SessionError(f"session {session.id} was deleted; open a new session")
        if session.closed:
            raise SessionError(f"session {session.id} has ended; open a new session")
        earlier = list(session.episode.completions)
        session.episode.add(completion)
        session.last_active = time.time()
        if self.durable is not None:
            self.durable.put_completion(session, completion, len(earlier), earlier)
        return completion

    def add_reward(
        self,
        session: Session,
        value: float,
        *,
        completion_id: str | None = None,
        tool_call_id: str | None = None,
        final: bool = False,
    ) -> str | None:
        """Attach a reward; returns the id of the completion that received it (None if final).

        ``final=True`` sets the episode's final reward (added to every leaf's return).
        Otherwise the reward goes to ``completion_id``, to the completion that made
        ``tool_call_id``, or, when neither is given, to the latest completion. A reward
        that would leave the float range anywhere (:func:`check_rewards`) raises
        :class:`RewardRangeError` and changes nothing.
        """
        ep = session.episode
        if final:
            if completion_id or tool_call_id:
                raise UserError(
                    "a final reward belongs to the episode: drop completion_id/tool_call_id"
                )
            check_rewards(ep, value, final=True)
            ep.final_reward = (ep.final_reward or 0.0) + value
            if self.durable is not None:
                self.durable.put_reward(session, None)
            return None
        if completion_id and tool_call_id:
            raise UserError("give completion_id or tool_call_id, not both")
        if completion_id:
            target = ep.by_id(completion_id)
            what = f"completion {completion_id!r}"
        elif tool_call_id:
            target = ep.by_tool_call(tool_call_id)
            what = f"tool call {tool_call_id!r}"
        else:
            target = ep.completions[-1] if ep.completions else None
            what = "any completion (the session has none yet)"
        if target is None:
            raise SessionError(f"session {session.id} has no {what}")
        check_rewards(ep, value, target=target)
        target.reward += value
        session.last_active = time.time()
        if self.durable is not None:
            self.durable.put_reward(session, target.id)
        return target.id

    def note_error(self, session: Session, error: dict[str, Any]) -> None:
        """Record a failure on the session's episode (``{"kind", "message"}``)."""
        session.episode.errors.append(error)
        if self.durable is not None:
            self.durable.put_header(session)

    def end(
        self,
        session: Session,
        *,
        final_reward: float | None = None,
        reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """End the episode, adding ``final_reward`` to its final reward; a final reward that
        would leave the float range (:func:`check_rewards`) raises
        :class:`RewardRangeError` and the session stays as it was."""
        ep = session.episode
        if final_reward is not None:
            check_rewards(ep, final_reward, final=True, param="final_reward")
            ep.final_reward = (ep.final_reward or 0.0) + final_reward
        if error:
            ep.errors.append(error)
        ep.ended = True
        ep.end_reason = reason or ep.end_reason or "terminated"
        session.last_active = time.time()
        if self.durable is not None:
            self.durable.put_header(session)
        self._note_ended(session)

    def _note_ended(self, session: Session) -> None:
        """With a store to restore from, ended sessions leave memory (the oldest first)."""
        if not self.restore:
            return
        self._ended[session.id] = None
        while len(self._ended) > self.keep_ended:
            sid, _ = self._ended.popitem(last=False)
            gone = self._by_id.pop(sid, None)
            if gone is not None:
                self._by_key.pop(gone.key_hash, None)

    def expire(self, idle_s: float) -> list[Session]:
        """End the held sessions idle for more than ``idle_s`` as ``expired``; those."""
        cutoff = time.time() - idle_s
        stale = [s for s in self._by_id.values() if not s.closed and s.last_active < cutoff]
        for s in stale:
            self.end(s, reason="expired")
        return stale
