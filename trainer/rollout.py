"""Sources of training groups: where the episodes of a step come from.

A :class:`GroupSource` yields finished groups (``rollout.group_size`` episodes of one task,
under one group id) to the training loop, and owns everything about producing them:

* **Task sampling.** Group g of the run resets its env with seed ``seed_base + g``; episode i
  of group g samples with seed ``(seed_base + g) * G + i`` (env-driven episodes; probe or
  not), so a group is reproducible.
* **The staleness gate** (:mod:`areal_agents.trainer.staleness`): a group starts only while
  ``running + accepted < (eta + version + 1) * batch_size``.
* **The probe and dynamic sampling.** With ``rollout.probe_size = k``, k episodes run first
  and the group is dropped there when their rewards are all equal (``uniform_probe``);
  otherwise the other G - k complete it. Algorithms with dynamic sampling drop a finished
  group whose usable rewards are all equal (``uniform_group``). Failed episodes are dropped
  and counted by end reason; a group keeps going with the rest when enough are left (2 for
  group-normalized algorithms, else 1).
* **Redo after resume.** Every group started but neither consumed nor skipped before the
  checkpoint is generated again, first; nothing consumed is used twice.
* **Lost agents** (external workers): with ``workers.on_lost: redo`` a group with an
  ``agent_lost`` episode is generated again from scratch; with ``drop`` the lost episode is
  dropped like any failed one.

The sources differ only in how the episodes of one group are produced and what they own:

    EnvSource       the raw model drives the env turn by turn (the runner loops env.step)
    AgentSource     the user's agent in this process, against the proxy's HTTP endpoint
    ExternalSource  agents in other processes pull tasks from the worker API
    RaySource       the runner's episodes on Ray actors (env- or agent-driven)
    SessionSource   no env: a service opens sessions in groups and rewards them itself

:func:`build_rollout` picks and builds one from the config, with its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from areal_agents import spans
from areal_agents.errors import ConfigError, SessionError
from areal_agents.rollout.runner import EpisodeResult, Runner
from areal_agents.trainer.advantage import filter_uniform_groups
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.config import GROUP_ALGORITHMS, TrainConfig
from areal_agents.trainer.judge import make_judge
from areal_agents.trainer.staleness import StalenessGate

EnvFactory = Callable[[], Any]


class Group(NamedTuple):
    """A finished group of the run: its number and its usable episodes."""

    number: int
    episodes: list[EpisodeResult]


@dataclass(frozen=True)
class SourceSettings:
    """What every source needs from the config (see the module docstring)."""

    batch_size: int
    group_size: int
    eta: int
    probe_size: int = 0
    min_episodes: int = 2
    """Usable episodes a group needs to be trained on."""
    dynamic_sampling: bool = False
    seed_base: int = 0
    redo_lost: bool = False
    """Generate a group with an ``agent_lost`` episode again (else drop the episode)."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, dynamic_sampling: bool) -> SourceSettings:
        seed = cfg.env.seed if cfg.env.seed is not None else cfg.train.seed * 100_000
        return cls(
            batch_size=cfg.rollout.batch_size,
            group_size=cfg.rollout.group_size,
            eta=cfg.rollout.max_head_offpolicyness,
            probe_size=cfg.rollout.probe_size,
            min_episodes=2 if cfg.algorithm in GROUP_ALGORITHMS else 1,
            dynamic_sampling=dynamic_sampling,
            seed_base=seed,
            redo_lost=cfg.rollout.agents == "external" and cfg.workers.on_lost == "redo",
        )


class GroupSource:
    """Finished groups for the loop: ``start``, then ``next_batch`` / ``set_version`` per
    step, then ``close``. Subclasses implement :meth:`episodes` (and may own resources that
    :meth:`close` releases). ``state`` is the run's state: the source advances
    ``next_group``, ``skipped_groups`` and ``dropped``; the loop records consumption."""

    def __init__(self, settings: SourceSettings, state: RunState) -> None:
        self.settings = settings
        self.state = state
        self.dropped: Counter[str] = Counter(state.dropped)
        self._queue: asyncio.Queue[Group] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._producer: asyncio.Task[None] | None = None
        self._redo: list[int] = []
        self._failure: asyncio.Future[None] | None = None
        """Set with the error of a group that failed outside its episodes (a bug, an env
        that cannot be made): ``next_batch`` raises it instead of waiting forever."""
        self.gate: StalenessGate | None = None
        self.store: Any = None
        """The run's episode store (``RUN_DIR/episodes.db``), closed with the source."""
        self.judge: Any = None
        """The run's :class:`areal_agents.trainer.judge.Judge` (``rewards.judge``): scores each finished
        group before it is counted and checked."""

    make_env: EnvFactory | None = None
    """The env the source's episodes run in (None: the episodes bring their own rewards)."""

    @property
    def local_agent(self) -> Any:
        """The agent code that runs in this process (its prompts can be observed for a
        warm start), or None: the model drives the env, or agents run elsewhere."""
        return None

    async def episodes(self, g: int, n: int, first: int) -> list[EpisodeResult]:
        """Episodes ``first .. first + n - 1`` of group ``g``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop's side
    async def start(self, version: int) -> None:
        """Start producing groups for policy ``version`` (the number of steps taken)."""
        s, st = self.settings, self.state
        self.gate = StalenessGate(
            s.batch_size, s.eta, version=version, accepted=len(st.consumed_groups)
        )
        self._redo = st.unfinished_groups()
        self._failure = asyncio.get_running_loop().create_future()
        self._producer = asyncio.create_task(self._produce())

    def ready(self, n: int) -> bool:
        """Whether :meth:`next_batch` would return (or raise) without waiting."""
        if self._queue.qsize() >= n:
            return True
        ended = (self._producer, self._failure)
        return any(f is not None and f.done() for f in ended)

    async def next_batch(self, n: int) -> list[Group]:
        """The next ``n`` accepted groups, in the order they finished."""
        if self._producer is None:
            raise RuntimeError("call start() before next_batch()")
        assert self._failure is not None
        out = []
        for _ in range(n):
            get = asyncio.ensure_future(self._queue.get())
            waits: set[asyncio.Future[Any]] = {get, self._producer, self._failure}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # an error outside any episode: it is the run's
                get.cancel()
                if self._failure.done():
                    self._failure.result()
                self._producer.result()
            out.append(get.result())
        self.state.dropped = dict(self.dropped)
        return out

    async def set_version(self, version: int) -> None:
        assert self.gate is not None
        await self.gate.set_version(version)

    async def prepare(self) -> None:
        """Make the source's runner usable (``start`` does it too): what episodes outside
        the groups, such as a held-out evaluation, need before ``start`` or after ``stop``."""

    async def stop(self) -> None:
        """Stop generating; the runner, proxy and servers stay up until :meth:`close`.
        Groups in flight are not consumed (a resume redoes them)."""
        pending = [t for t in (self._producer, *self._tasks) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._failure is not None and not self._failure.done():
            self._failure.cancel()
        elif self._failure is not None and not self._failure.cancelled():  # stopped before
            self._failure.exception()  # retrieved: no "never retrieved" warning
        self.state.dropped = dict(self.dropped)

    def metrics(self) -> dict[str, float]:
        """The source's own metrics of a step (the judge's ``judge/*``)."""
        return self.judge.metrics() if self.judge is not None else {}

    async def close(self) -> None:
        """:meth:`stop`, then release what the source owns (the judge, the episode store)."""
        await self.stop()
        if self.judge is not None:
            await self.judge.close()
        if self.store is not None:  # episodes cut short here end as "cancelled" in the store
            self.store.flush_sync()
            self.store.close_open("cancelled")
            self.store.close()

    # ------------------------------------------------------------------ producing
    async def _produce(self) -> None:
        assert self.gate is not None
        while True:
            t0 = time.perf_counter()
            await self.gate.acquire()
            if (t1 := time.perf_counter()) - t0 > 1e-3:  # it waited: the gate was full
                spans.add("rollout", "gate_full", t0, t1)
            if self._redo:
                g = self._redo.pop(0)
            else:
                g = self.state.next_group
                self.state.next_group += 1
            self._spawn(self._group(g))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task of this source; an error in it is the run's (next_batch
        raises it), and :meth:`close` cancels it."""
        task = asyncio.create_task(self._guarded(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as exc:
            assert self._failure is not None
            if not self._failure.done():
                self._failure.set_exception(exc)

    async def _group(self, g: int) -> None:
        s = self.settings
        assert self.gate is not None
        k = s.probe_size
        results = await self._timed_episodes(g, k or s.group_size, 0)
        probed_out = False
        if k:
            probe = _usable(results)
            probed_out = len(probe) >= 2 and _uniform(probe)
            if probed_out:
                self.dropped["uniform_probe"] += 1
            else:
                results += await self._timed_episodes(g, s.group_size - k, k)
        if s.redo_lost and any(r.end_reason == "agent_lost" for r in results):
            self._count_failures(results)
            self._redo.append(g)  # generated again; the gate admits it like a new group
            await self.gate.finish(accepted=False)
            return
        await self._settle(g, results, probed_out)

    async def _timed_episodes(self, g: int, n: int, first: int) -> list[EpisodeResult]:
        """:meth:`episodes`, recorded as spans: one per episode (lane ``episodes``) and the
        ``group_tail``, from the first of them to finish to the last."""
        t0 = time.perf_counter()
        results = await self.episodes(g, n, first)
        ends = [t0 + max(r.duration_s, 0.0) for r in results]
        for r, end in zip(results, ends, strict=True):
            spans.add("episodes", "episode", t0, end, group=g, reward=r.reward)
        if ends:
            spans.add("rollout", "group_tail", min(ends), max(ends), group=g)
        return results

    def _count_failures(self, results: list[EpisodeResult]) -> None:
        for r in results:
            if not r.ok:
                self.dropped[r.end_reason] += 1

    async def _settle(self, g: int, results: list[EpisodeResult], probed_out: bool) -> None:
        """A finished group: counted, checked (enough usable episodes; not uniform under
        dynamic sampling), its gate slot freed, and queued for training or skipped."""
        s = self.settings
        assert self.gate is not None
        if self.judge is not None and not probed_out:
            with spans.span("rollout", "judge", group=g):
                rescored = await self.judge.apply(f"g{g}", results)
            if self.store is not None:
                for r in rescored:
                    self.store.put_rescored(r.episode)
        self._count_failures(results)
        ok = _usable(results)
        keep = not probed_out and len(ok) >= s.min_episodes
        if keep and s.dynamic_sampling and _uniform(ok):
            keep = False
            self.dropped["uniform_group"] += 1
        await self.gate.finish(accepted=keep)
        if keep:
            await self._queue.put(Group(g, ok))
        else:
            self.state.skipped_groups.append(g)  # never redone; the gate admits a new group


def _usable(results: list[EpisodeResult]) -> list[EpisodeResult]:
    return [r for r in results if r.ok and r.episode.completions]


def _uniform(ok: list[EpisodeResult]) -> bool:
    rewards = torch.tensor([r.reward for r in ok])
    return not bool(filter_uniform_groups(rewards, ["g"] * len(ok)).any())


# ---------------------------------------------------------------------------- the sources
class EnvSource(GroupSource):
    """``runner.run_group`` in this process: the raw model drives the env (no agent), or
    the runner drives ``agent`` (what the subclasses give it)."""

    def __init__(
        self,
        settings: SourceSettings,
        state: RunState,
        runner: Any,
        make_env: EnvFactory,
        agent: Any = None,
    ) -> None:
        super().__init__(settings, state)
        self.runner = runner
        self.make_env = make_env
        self.agent = agent

    @property
    def local_agent(self) -> Any:
        return self.agent

    async def episodes(self, g: int, n: int, first: int) -> list[EpisodeResult]:
        s = self.settings
        result: list[EpisodeResult] = await self.runner.run_group(
            self.make_env,
            n,
            seed=s.seed_base + g,
            group_id=f"g{g}",
            sampling_seed=(s.seed_base + g) * s.group_size + first,
            agent=self.agent,
        )
        return result


class AgentSource(EnvSource):
    """The user's agent in this process: each episode hands it an ``AgentTask`` (the env's
    messages and tools, a proxy session's ``base_url`` and key); the env scores what it
    did. ``server`` serves the proxy over HTTP for the agent, in this event loop, from
    :meth:`start` to :meth:`close`."""

    def __init__(
        self,
        settings: SourceSettings,
        state: RunState,
        runner: Runner,
        make_env: EnvFactory,
        agent: Any,
        server: Any,
    ) -> None:
        super().__init__(settings, state, runner, make_env, agent)
        self.server = server
        self._serving = False

    async def prepare(self) -> None:
        if not self._serving:
            await self.server.start()
            self._serving = True

    async def start(self, version: int) -> None:
        await self.prepare()
        await super().start(version)

    async def close(self) -> None:
        await super().close()
        await self.server.stop()


class ExternalSource(AgentSource):
    """Agents in their own processes: a group's episodes become tasks on the worker API
    (:mod:`areal_agents.rollout.workers`); a worker pulls one, runs its agent against the session,
    posts the final answer, and the env scores it. Tasks exist only for groups the gate
    admitted, so workers never run more than the gate's capacity."""

    def __init__(
        self,
        settings: SourceSettings,
        state: RunState,
        runner: Runner,
        make_env: EnvFactory,
        hub: Any,
        server: Any,
    ) -> None:
        super().__init__(settings, state, runner, make_env, hub.remote_agent, server)
        self.hub = hub

    @property
    def local_agent(self) -> Any:
        return None  # the agents are the workers'

    async def close(self) -> None:
        await GroupSource.close(self)  # episodes cancelled first: their tasks are withdrawn
        self.hub.close()  # then waiting long-polls return at once
        await self.server.stop()


class RaySource(EnvSource):
    """The runner's episodes on Ray rollout-worker actors (env- or agent-driven), the engine
    an actor too; the policy trains in this process. Closing ends the worker actors."""

    async def close(self) -> None:
        await super().close()
        await self.runner.close()


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
      process. The groups in flight then are skipped (``dropped/lost_at_restart``), and their
      session keys are unknown to the new proxy.
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
        self._closed = True
        for group in self._open.values():
            if group.expiry is not None:
                group.expiry.cancel()
        await super().close()
        await self.server.stop()

    async def _produce(self) -> None:
        for g in self._redo:  # their sessions were in the stopped process's memory
            self.state.skipped_groups.append(g)
            self.dropped["lost_at_restart"] += 1
        self._redo.clear()
        await asyncio.Event().wait()  # the groups come from the proxy's session hooks

    # ------------------------------------------------------------------ session hooks
    def admit(self, body: Any) -> None:
        from areal_agents.serve.proxy import ApiError

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


# ---------------------------------------------------------------------------- building
@dataclass
class Rollout:
    """What :func:`build_rollout` returns: the engine the policy's weights go to, and the
    source of groups."""

    engine: Any
    source: GroupSource


def build_rollout(
    cfg: TrainConfig,
    *,
    model_path: str,
    tokenizer: Any,
    compute_lock: Any,
    state: RunState,
    out: Path,
    dynamic_sampling: bool,
    quiet: bool = False,
) -> Rollout:
    """The engine and the group source that ``cfg`` asks for. Loads the agent factory and
    makes one env and resets it with the first group's seed first (``areal_agents.envs.registry.probe``),
    so that a bad factory or env config fails here, with its message, before any episode."""
    from areal_agents.envs.registry import make, probe

    settings = SourceSettings.from_config(cfg, dynamic_sampling)
    env_id, kwargs = cfg.env.id, dict(cfg.env.kwargs)

    def make_env() -> Any:
        assert env_id is not None
        return make(env_id, **kwargs)

    if env_id is not None:  # None: a self-rewarded run (checked by the config)
        what = f"env {env_id} (env.kwargs)"
        try:
            first = make_env()
        except TypeError as exc:
            raise ConfigError(f"{what}: the env does not take them: {exc}") from None
        if "split" in inspect.signature(type(first.unwrapped).__init__).parameters:
            kwargs.setdefault("split", cfg.env.split)
        first.close()
        probe(make_env, seed=settings.seed_base, what=what)

    agent = None
    if cfg.agent.factory is not None:
        from areal_agents.rollout.task_agent import load_agent

        agent = load_agent(cfg.agent.factory, cfg.agent.kwargs, max_turns=cfg.rollout.max_turns)
    runner_kwargs: dict[str, Any] = {
        "concurrency": cfg.rollout.concurrency,
        "max_turns": cfg.rollout.max_turns,
        "episode_timeout_s": cfg.rollout.episode_timeout_s or 1e9,
        "sampling": _sampling(cfg),
        "sampling_by_kind": {k: dict(v) for k, v in cfg.sampling.by_kind.items()},
    }
    if cfg.scheduler == "ray":
        engine, runner = _ray_rollout(cfg, model_path, runner_kwargs)
        ray_source = RaySource(settings, state, runner, make_env, agent)
        ray_source.judge = make_judge(cfg.rewards, None, out)  # over rewards.judge.base_url
        return Rollout(engine, ray_source)

    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.hardware import default_device, resolve_dtype
    from areal_agents.serve.context import policy_of
    from areal_agents.serve.proxy import Proxy
    from areal_agents.serve.store import EpisodeStore

    device = default_device(cfg.model.device)
    engine = EmbeddedEngine.from_pretrained(
        model_path,
        dtype=resolve_dtype(cfg.model.dtype, device),
        device=cfg.model.device,
        decode=tokenizer.decode,
        max_batch_size=max(cfg.rollout.concurrency, 1),
        max_context=cfg.model.max_context,  # the proxy refuses longer prompts (400)
        compute_lock=compute_lock,
        kv_on_update=cfg.rollout.kv_on_update,
    )
    external = cfg.rollout.agents == "external"
    store = EpisodeStore(out / "episodes.db")  # every episode of the run, for inspection
    store.close_open("lost_at_restart")  # a resumed run redoes the groups it had in flight
    proxy = Proxy(
        engine,
        tokenizer,
        self_rewarding=False,  # the env (or, self-rewarded, the worker token) rewards
        open_sessions=False,  # the trainer opens every session
        default_max_tokens=cfg.sampling.max_new_tokens,  # for agent calls that set none
        store=store,
        restore=False,  # sessions of an earlier process belong to groups that are gone
        context_policy=policy_of(cfg),  # context.*: conversations that outgrow the context
    )
    judge = make_judge(cfg.rewards, proxy, out)
    if agent is None and cfg.rollout.agents == "local":
        runner = Runner(proxy, **runner_kwargs)
        return _stored(engine, EnvSource(settings, state, runner, make_env), store, judge)
    from areal_agents.serve.server import LoopServer

    host, port = cfg.workers.host, cfg.workers.port
    if cfg.rollout.agents == "self_rewarded":
        port, token = _worker_endpoint(cfg, out)
        proxy.privileged_keys.add(token)
        server = LoopServer(proxy, host=host, port=port)
        if not quiet:
            print(f"sessions on {server.url} (worker token in {out / 'workers.json'})", flush=True)
        source = SessionSource(
            settings,
            state,
            proxy,
            server,
            episode_timeout_s=cfg.rollout.episode_timeout_s,
            sampling=runner_kwargs["sampling"],
            sampling_by_kind=runner_kwargs["sampling_by_kind"],
        )
        return _stored(engine, source, store, judge)
    hub = None
    if external:
        from areal_agents.rollout.workers import WorkerHub

        port, token = _worker_endpoint(cfg, out)
        hub = WorkerHub(
            proxy,
            token,
            heartbeat_timeout_s=cfg.workers.heartbeat_timeout_s,
            episode_timeout_s=cfg.rollout.episode_timeout_s,
        )
    server = LoopServer(proxy, host=host if external else "127.0.0.1", port=port)
    runner = Runner(proxy, base_url=server.base_url, **runner_kwargs)
    if hub is not None:
        if not quiet:
            print(f"worker API on {server.url} (token in {out / 'workers.json'})", flush=True)
        external_source = ExternalSource(settings, state, runner, make_env, hub, server)
        return _stored(engine, external_source, store, judge)
    return _stored(
        engine, AgentSource(settings, state, runner, make_env, agent, server), store, judge
    )


def _stored(engine: Any, source: GroupSource, store: Any, judge: Any) -> Rollout:
    source.store, source.judge = store, judge
    return Rollout(engine, source)


def _sampling(cfg: TrainConfig) -> dict[str, Any]:
    s = cfg.sampling
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_tokens": s.max_new_tokens,
    }


def _worker_endpoint(cfg: TrainConfig, out: Path) -> tuple[int, str]:
    """The worker API's port and token: the config's, else those of an earlier start of this
    run (``workers.json``, so that ``--resume`` keeps them and connected workers go on), else
    a free port and ``$AREAL_WORKER_TOKEN`` or a new random token. Saved with mode 0600."""
    from areal_agents.engines.launch import free_port

    path = out / "workers.json"
    saved: dict[str, Any] = {}
    if path.exists():
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads(path.read_text())
    port = cfg.workers.port or int(saved.get("port") or 0) or free_port(cfg.workers.host)
    token = (
        cfg.workers.token
        or saved.get("token")
        or os.environ.get("AREAL_WORKER_TOKEN")
        or "wk-" + secrets.token_urlsafe(24)
    )
    if not isinstance(token, str) or not token:
        raise ConfigError(f"{path}: the saved worker token is not a string; delete the file")
    path.write_text(json.dumps({"port": port, "token": token, "host": cfg.workers.host}))
    path.chmod(0o600)
    return port, token


def _ray_rollout(cfg: TrainConfig, model_path: str, runner_kwargs: dict[str, Any]) -> Any:
    """``scheduler: ray``: the engine and the episodes run as Ray actors
    (:mod:`areal_agents.rollout.cluster`, :mod:`areal_agents.rollout.ray_runner`) while the policy trains in
    this process; new weights reach the engine actors through the object store.

    Joins ``$RAY_ADDRESS`` or a cluster started with ``ray start`` on this machine, else starts
    a local one (Ray shuts that down when the process exits). One engine actor (a GPU when the
    cluster has one; on the cores ``rollout.engine_cpus`` names); rollout workers: one per
    node, at least 2.
    """
    from areal_agents.hardware import default_device, resolve_dtype
    from areal_agents.rollout.cluster import EmbeddedSpec, RayEngine, connect
    from areal_agents.rollout.ray_runner import RayRunner

    connect()
    spec = EmbeddedSpec(
        model=None if cfg.model.path is None else model_path,  # None: prepared on its node
        dtype=resolve_dtype(cfg.model.dtype, default_device(cfg.model.device)),
        device=cfg.model.device,
        max_batch_size=max(cfg.rollout.concurrency, 1),
        max_context=cfg.model.max_context,
        cpus=cfg.rollout.engine_cpus,
        kv_on_update=cfg.rollout.kv_on_update,
    )
    cores, idle = cfg.rollout.engine_cpus, cfg.rollout.idle_engine_cpus
    # the idle-priority replica reserves no CPU: it runs on what others leave
    extra = [] if idle is None else [(replace(spec, cpus=idle, idle_priority=True), 0.0)]
    engine = RayEngine.start(spec, num_cpus=float(len(cores)) if cores else 1.0, extra=extra)
    return engine, RayRunner(engine, model_path, **runner_kwargs)


__all__ = [
    "AgentSource",
    "EnvSource",
    "ExternalSource",
    "Group",
    "GroupSource",
    "RaySource",
    "Rollout",
    "SessionSource",
    "SourceSettings",
    "build_rollout",
]
