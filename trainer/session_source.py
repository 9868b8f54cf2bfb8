"""Self-rewarded training (``rollout.agents: self_rewarded``): the group source of sessions.

:class:`SessionSource` takes its groups from proxy sessions that a service opens, rewards and
ends itself, through the proxy's session hooks (``admit``, ``opened``, ``ended``); the
staleness gate, the checks of a finished group and the queue are
:class:`~areal_agents.trainer.rollout.GroupSource`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

from areal_agents.errors import SessionError
from areal_agents.rollout.runner import EpisodeResult
from areal_agents.serve.api_error import ApiError
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.rollout import GroupSource, SourceSettings

_RESERVED = ("judge-", "eval-")
"""Group-name prefixes of the sessions in a run's store that are not training episodes."""


@dataclass
class _OpenGroup:
    """A group of a self-rewarded run, from its first session to its last end."""

    number: int
    name: str
    sessions: dict[str, Any] = field(default_factory=dict)
    """Session id -> Session, as opened."""
    results: dict[str, EpisodeResult] = field(default_factory=dict)
    """Session id -> its episode, as ended."""
    opened_at: float = field(default_factory=time.monotonic)
    expiry: asyncio.TimerHandle | None = None
    settling: bool = False


class SessionSource(GroupSource):
    """Self-rewarded training (``rollout.agents: self_rewarded``): traffic without an env.

    A service (an online agent deployment, say) opens a proxy session per episode with
    ``POST /sessions {group, task_id?, metadata?}`` and the worker token, gives the session's
    key to its agent, posts the episode's rewards to ``/sessions/{id}/rewards`` and ends it
    with ``/sessions/{id}/end`` (both with the worker token: the agent's key may only call the
    model). The ``rollout.group_size`` sessions of one ``group`` are one training group (the
    same request answered G times); the group is trained on when all G have ended.

    * The gate: the first session of a new group takes a gate slot, or is answered 429 with
      ``Retry-After`` while there is none (so the service never runs ahead of
      ``max_head_offpolicyness``); more sessions than G in one group are a 409, and so is a
      group name used again after its group finished.
    * Lost sessions: ``rollout.episode_timeout_s`` after a group's first session opened, its
      sessions still open end as ``agent_lost`` and its sessions never opened count as
      ``group_incomplete``; the group is trained on the rest when enough are left.
    * Sampling: the agent's calls sample as they ask; what they leave unset comes from
      ``sampling`` (``by_kind`` matched against the session's ``metadata.kind``).
    * Checks as for every source: failed ends (any ``reason`` other than terminated or
      truncated) are dropped and counted by reason; dynamic sampling drops uniform groups.
    * A restart (``--resume``) cannot redo a group: its sessions lived in the stopped
      process. The groups in flight then are skipped, their sessions counted under
      ``dropped/lost_at_restart`` (episodes, from the store), and their session keys are
      unknown to the new proxy.
    * Group names starting with ``judge-`` or ``eval-`` are refused (400): the store keeps
      the judge's and held-out sessions under such names, apart from training episodes.
    """

    def __init__(
        self,
        settings: SourceSettings,
        state: RunState,
        proxy: Any,
        server: Any,
        *,
        episode_timeout_s: float | None,
        sampling: dict[str, Any] | None = None,
        sampling_by_kind: dict[str, dict[str, Any]] | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(settings, state)
        self.proxy = proxy
        self.sampling = dict(sampling or {})
        self.sampling_by_kind = dict(sampling_by_kind or {})
        self.server = server
        self.episode_timeout_s = episode_timeout_s
        self.retry_after_s = retry_after_s
        self._open: dict[str, _OpenGroup] = {}
        self._finished: dict[str, None] = {}  # names of finished groups (insertion-ordered)
        self._closed = False
        proxy.session_hooks = self

    async def start(self, version: int) -> None:
        await self.server.start()
        await super().start(version)

    async def close(self) -> None:
        self._closed = True  # new sessions get a 503 from now on
        for group in self._open.values():
            if group.expiry is not None:
                group.expiry.cancel()
        await super().close()

    async def stop_serving(self) -> None:
        await self.server.stop()

    def is_training_group(self, name: str | None) -> bool:
        return name is not None and not name.startswith(_RESERVED)

    async def _produce(self) -> None:
        # their sessions were in the stopped process's memory; the store's count of them
        # is in dropped/lost_at_restart already (start)
        self.state.skipped_groups.extend(self._redo)
        self._redo.clear()
        await asyncio.Event().wait()  # the groups come from the proxy's session hooks

    # ------------------------------------------------------------------ session hooks
    def admit(self, body: Any) -> None:
        name = body.group_id
        if self._closed or self.gate is None:
            raise ApiError(503, "the trainer is not taking sessions now", kind="server_error")
        if not name:
            raise ApiError(
                400,
                f"this run trains on groups of {self.settings.group_size} sessions: send "
                "'group', the same name for the sessions that answer one request",
                param="group",
            )
        if name.startswith(_RESERVED):
            raise ApiError(
                400,
                f"group {name!r}: names starting with {' or '.join(_RESERVED)} are the "
                "judge's and held-out evaluations' in the episode store; choose another name",
                param="group",
            )
        group = self._open.get(name)
        if group is not None:
            if len(group.sessions) >= self.settings.group_size or group.settling:
                raise ApiError(
                    409,
                    f"group {name!r} already has its {self.settings.group_size} sessions; "
                    "open the next request's sessions under a new group",
                    kind="conflict_error",
                    param="group",
                )
            return
        if name in self._finished:
            raise ApiError(
                409,
                f"group {name!r} has finished; a group name is used once",
                kind="conflict_error",
                param="group",
            )
        if not self.gate.try_acquire():
            raise ApiError(
                429,
                "the trainer's staleness gate has no room for a new group; open it after "
                "Retry-After seconds (a session of a group already open is admitted)",
                kind="rate_limit_error",
                code="no_room",
                headers={"Retry-After": str(math.ceil(self.retry_after_s))},
            )
        number = self.state.next_group
        self.state.next_group += 1
        group = self._open[name] = _OpenGroup(number, name)
        self._pending[number] = name
        if self.episode_timeout_s is not None:
            loop = asyncio.get_running_loop()
            group.expiry = loop.call_later(self.episode_timeout_s, self._expire, group)

    def opened(self, session: Any) -> None:
        self._open[session.episode.group_id].sessions[session.id] = session
        kind = str(session.episode.metadata.get("kind"))
        session.sampling = {**self.sampling, **self.sampling_by_kind.get(kind, {})}

    def ended(self, session: Any) -> None:
        group = self._open.get(session.episode.group_id or "")
        if group is None or session.id not in group.sessions or session.id in group.results:
            return
        ep = session.episode
        error = ep.errors[-1].get("message") if ep.errors else None
        group.results[session.id] = EpisodeResult(
            episode=ep,
            reward=sum(c.reward for c in ep.completions) + (ep.final_reward or 0.0),
            success=None,
            turns=len(ep.completions),
            end_reason=ep.end_reason or "terminated",
            error=None if error is None else str(error),
            info={"task": {"task_id": ep.task_id, **ep.metadata}},
            duration_s=time.monotonic() - group.opened_at,
        )
        if len(group.results) == self.settings.group_size:
            self._settle_soon(group)

    def _expire(self, group: _OpenGroup) -> None:
        if group.settling:
            return
        for sid, session in group.sessions.items():
            if sid not in group.results:
                self.proxy.sessions.end(session, reason="agent_lost")
                self.ended(session)
        missing = self.settings.group_size - len(group.sessions)
        if missing and not group.settling:
            self.dropped["group_incomplete"] += missing
        self._settle_soon(group)

    def _settle_soon(self, group: _OpenGroup) -> None:
        if group.settling:
            return
        group.settling = True
        if group.expiry is not None:
            group.expiry.cancel()
        del self._open[group.name]
        self._finished[group.name] = None
        while len(self._finished) > 100_000:
            del self._finished[next(iter(self._finished))]
        for sid in group.sessions:  # the episodes are the trainer's now
            with contextlib.suppress(SessionError):
                self.proxy.sessions.release(sid)
        self._spawn(self._settle(group.number, list(group.results.values()), probed_out=False))
