"""Sessions: one API key per episode, so a session's key only ever reaches its own episode."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import SessionError, UserError
from .trajectory import Completion, Episode


@dataclass
class Session:
    """A recorded episode and the key that writes to it."""

    id: str
    api_key: str
    episode: Episode
    created_at: float = field(default_factory=time.time)
    sampling: dict[str, Any] = field(default_factory=dict)
    """Defaults for this session's model calls that set none of their own: ``temperature``,
    ``top_p``, ``top_k``, ``max_tokens`` (the runner sets the run's sampling, per task kind,
    so an agent that leaves sampling to the server samples as the config says)."""

    @property
    def closed(self) -> bool:
        return self.episode.ended


class SessionStore:
    """All live sessions of one proxy. Not thread-safe: used from the proxy's event loop."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

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
        self._by_id[sid] = session
        self._by_key[key] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise SessionError(
                f"no session {session_id!r}; create one with POST /sessions"
            ) from None

    def by_key(self, api_key: str) -> Session | None:
        return self._by_key.get(api_key)

    def remove(self, session_id: str) -> Session:
        session = self.get(session_id)
        del self._by_id[session_id]
        self._by_key.pop(session.api_key, None)
        return session

    @staticmethod
    def record(session: Session, completion: Completion) -> Completion:
        if session.closed:
            raise SessionError(f"session {session.id} has ended; open a new session")
        return session.episode.add(completion)

    @staticmethod
    def add_reward(
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
        ``tool_call_id``, or, when neither is given, to the latest completion.
        """
        ep = session.episode
        if final:
            if completion_id or tool_call_id:
                raise UserError(
                    "a final reward belongs to the episode: drop completion_id/tool_call_id"
                )
            ep.final_reward = (ep.final_reward or 0.0) + value
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
        target.reward += value
        return target.id

    @staticmethod
    def end(
        session: Session,
        *,
        final_reward: float | None = None,
        reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        ep = session.episode
        if final_reward is not None:
            ep.final_reward = (ep.final_reward or 0.0) + final_reward
        if error:
            ep.errors.append(error)
        ep.ended = True
        ep.end_reason = reason or ep.end_reason or "terminated"
