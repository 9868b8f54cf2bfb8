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
  group-normalized algorithms, else 1; else ``group_too_small``).
* **A run that cannot progress stops.** When every episode of
  :attr:`GroupSource.failed_groups_to_stop` groups in a row failed (no episode of any of them
  ended normally: an env that raises, prompts longer than the model's context, a judge or a
  server that is down), the run stops with the most common end reasons and the last error,
  instead of generating failures for ever.
* **Redo after resume.** Every group started but neither consumed nor skipped before the
  checkpoint is generated again, first; nothing consumed is used twice.
* **Lost agents** (external workers): with ``workers.on_lost: redo`` a group with an
  ``agent_lost`` episode is generated again from scratch (its other episodes count as
  ``regenerated``); with ``drop`` the lost episode is dropped like any failed one.
* **The accounting** (``dropped/*``, in episodes): every episode the store recorded for a
  training group and that is not trained is counted once, under one reason: its end reason
  when it failed, ``no_completions`` when it never called the model, else its group's
  (``uniform_probe``, ``uniform_group``, ``group_too_small``, ``regenerated``);
  ``lost_at_restart`` when a resumed run starts (whatever the store holds that the restored
  checkpoint does not account for: episodes in flight, finished but not consumed, or
  consumed after the checkpoint) and ``stopped`` when the source closes (the episodes of
  groups still running or not yet trained). So at the end of a run, and at every resume,
  ``generated = trained + dropped`` (``docs/data-contract.md``); ``group_incomplete``
  (:mod:`areal_agents.trainer.session_source`) counts sessions never opened, outside it.

The sources differ only in how the episodes of one group are produced and what they own:

    EnvSource       the raw model drives the env turn by turn (the runner loops env.step)
    AgentSource     the user's agent in this process, against the proxy's HTTP endpoint
    ExternalSource  agents in other processes pull tasks from the worker API
    RaySource       the runner's episodes on Ray actors (env- or agent-driven)
    SessionSource   no env: a service opens sessions in groups and rewards them itself
                    (:mod:`areal_agents.trainer.session_source`)

:func:`areal_agents.trainer.rollout_build.build_rollout` picks and builds one from the
config, with its engine.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from areal_agents import spans
from areal_agents.rollout.runner import EpisodeResult, Runner
from areal_agents.trainer.advantage import filter_uniform_groups
from areal_agents.trainer.algorithms import GROUP_ALGORITHMS
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_rollout import RolloutConfig
from areal_agents.trainer.staleness import StalenessGate

EnvFactory = Callable[[], Any]
log = logging.getLogger(__name__)

NOT_GENERATED = frozenset({"group_incomplete"})
"""``dropped/*`` reasons that count sessions a group never opened: not episodes that were
generated, so outside ``generated = trained + dropped``."""
_GROUP_ID = re.compile(r"g\d+")


class Group(NamedTuple):
    """A finished group of the run: its number and its usable episodes."""

    number: int
    episodes: list[EpisodeResult]


@dataclass(frozen=True)
class SourceSettings:
    """What every source needs from the config (see the module docstring): the ``rollout``
    section itself (batch and group size, staleness, probe), and what the run derives."""

    rollout: RolloutConfig
    min_episodes: int = 2
    """Usable episodes a group needs to be trained on."""
    dynamic_sampling: bool = False
    seed_base: int = 0
    redo_lost: bool = False
    """Generate a group with an ``agent_lost`` episode again (else drop the episode)."""

    @property
    def batch_size(self) -> int:
        """Groups per training step (``rollout.batch_size``)."""
        return self.rollout.batch_size

    @property
    def group_size(self) -> int:
        """Episodes per group (``rollout.group_size``)."""
        return self.rollout.group_size

    @property
    def eta(self) -> int:
        """The staleness bound (``rollout.max_head_offpolicyness``)."""
        return self.rollout.max_head_offpolicyness

    @property
    def probe_size(self) -> int:
        """Episodes of a group's probe (``rollout.probe_size``; 0 = none)."""
        return self.rollout.probe_size

    @classmethod
    def of(
        cls, batch_size: int, group_size: int, eta: int = 0, probe_size: int = 0, **derived: Any
    ) -> SourceSettings:
        """Settings without a whole config (a source built by hand): a ``rollout`` section
        with these values and the defaults, and ``derived`` fields (``min_episodes``, ...)."""
        rollout = RolloutConfig(
            batch_size=batch_size,
            group_size=group_size,
            max_head_offpolicyness=eta,
            probe_size=probe_size,
        )
        return cls(rollout, **derived)

    @classmethod
    def from_config(cls, cfg: TrainConfig, dynamic_sampling: bool) -> SourceSettings:
        seed = cfg.env.seed if cfg.env.seed is not None else cfg.train.seed * 100_000
        return cls(
            rollout=cfg.rollout,
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
        """The run's ``dropped/*`` totals, in episodes; taken from ``state`` again by
        :meth:`start` (after a checkpoint was restored into it)."""
        self._pending: dict[int, str] = {}
        """Groups started and neither handed to the loop nor skipped: number -> group id."""
        self._counted: Counter[int] = Counter()
        """Per pending group, its episodes already counted under ``dropped/*``."""
        self._stored_before: dict[str | None, int] = {}
        """The store's sessions per group id when :meth:`start` ran."""
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
        self._failed_in_row: list[list[EpisodeResult]] = []
        """The latest groups in a row none of whose episodes ended normally."""
        self.judge: Any = None
        """The run's :class:`areal_agents.trainer.judge.Judge` (``rewards.judge``): scores each
        finished group before it is counted and checked."""

    make_env: EnvFactory | None = None
    """The env the source's episodes run in (None: the episodes bring their own rewards)."""

    failed_groups_to_stop = 16
    """Groups in a row whose every episode failed, after which the run stops (its wait for a
    batch raises :class:`RolloutStalled`)."""

    @property
    def local_agent(self) -> Any:
        """The agent code that runs in this process (its prompts can be observed for a
        warm start), or None: the model drives the env, or agents run elsewhere."""
        return None

    async def episodes(self, g: int, n: int, first: int) -> list[EpisodeResult]:
        """Episodes ``first .. first + n - 1`` of group ``g``."""
        raise NotImplementedError

    def group_name(self, g: int) -> str:
        """The proxy's ``group_id`` of group ``g``'s episodes."""
        return f"g{g}"

    def is_training_group(self, name: str | None) -> bool:
        """Whether the store's sessions of group ``name`` are training episodes of this
        source (not held-out ``eval-*`` or ``judge-*`` sessions)."""
        return name is not None and _GROUP_ID.fullmatch(name) is not None

    def live_proxy(self) -> Any:
        """The proxy that holds this source's sessions in this process (None: none here)."""
        runner = getattr(self, "runner", None)
        return getattr(self, "proxy", None) or getattr(runner, "proxy", None)

    # ------------------------------------------------------------------ the loop's side
    async def start(self, version: int) -> None:
        """Start producing groups for policy ``version`` (the number of steps taken). The
        ``dropped/*`` totals are taken from ``state`` here, after a checkpoint was restored
        into it, and episodes that the store holds and the checkpoint does not account for
        are counted as ``lost_at_restart``."""
        s, st = self.settings, self.state
        self.dropped = Counter(st.dropped)
        if self.store is not None:
            await asyncio.to_thread(self._count_lost_at_restart)
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
        for group in out:  # the loop's now: trained, or redone after a restart
            self._pending.pop(group.number, None)
            self._counted.pop(group.number, None)
        self.state.dropped = dict(self.dropped)
        return out

    async def set_version(self, version: int) -> None:
        """The policy is at ``version`` now (the loop calls it after each step, before its
        checkpoint): the totals go to ``state`` and the store commits what they count, so a
        checkpoint never counts an episode that a ``kill -9`` could take from the store."""
        assert self.gate is not None
        self.state.dropped = dict(self.dropped)
        if self.store is not None:
            try:
                await self.store.flush()
            except Exception as exc:  # the proxy answers 503 for it; the step goes on
                log.warning("the episode store failed to commit: %r", exc)
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
        proxy = self.live_proxy()
        if proxy is not None:  # episodes cut short: a model call in flight gets a 409
            for session in proxy.sessions.open_sessions():
                proxy.sessions.end(session, reason="cancelled")
        self.state.dropped = dict(self.dropped)

    def metrics(self) -> dict[str, float]:
        """The source's own metrics of a step (the judge's ``judge/*``)."""
        return self.judge.metrics() if self.judge is not None else {}

    async def close(self) -> None:
        """:meth:`stop`, then stop serving (:meth:`stop_serving`: the HTTP server, the worker
        hub), then release what the source owns (the judge, then the episode store, last: a
        request still in flight while anything is served can be recorded)."""
        await self.stop()
        await self.stop_serving()
        if self.judge is not None:
            await self.judge.close()
        if self.store is not None:  # episodes cut short here end as "cancelled" in the store
            self.store.flush_sync()
            self.store.close_open("cancelled")
            self._count_stopped()
            self.store.close()

    async def stop_serving(self) -> None:
        """Stop answering HTTP requests (what the source serves, if anything), after
        :meth:`stop` and before the store closes."""

    # ------------------------------------------------------------------ the accounting
    def _count_lost_at_restart(self) -> None:
        """``lost_at_restart``: the training episodes in the store that the restored state
        neither trained (``episodes_consumed``) nor counted under ``dropped/*``; nothing on
        a fresh run. Runs in a thread (it reads the store)."""
        assert self.store is not None
        self.store.flush_sync()
        self._stored_before = self.store.group_counts()
        generated = sum(n for g, n in self._stored_before.items() if self.is_training_group(g))
        counted = sum(n for k, n in self.dropped.items() if k not in NOT_GENERATED)
        lost = generated - self.state.episodes_consumed - counted
        if lost > 0:
            self.dropped["lost_at_restart"] += lost
        elif lost < 0:  # a checkpoint of an older version (it counted groups), or rows lost
            log.warning(
                "the episode store holds %d training episodes, %d fewer than the restored "
                "checkpoint accounts for (trained %d, dropped %d)",
                generated,
                -lost,
                self.state.episodes_consumed,
                counted,
            )
        self.state.dropped = dict(self.dropped)

    def _count_stopped(self) -> None:
        """``stopped``: the episodes of the groups still pending when the source closes (in
        flight, or finished and not yet handed to the loop), as the store recorded them since
        :meth:`start`, less those already counted."""
        assert self.store is not None
        if self._pending:
            counts = self.store.group_counts()
            recorded = sum(
                counts.get(name, 0) - self._stored_before.get(name, 0)
                for name in set(self._pending.values())
            )
            lost = recorded - sum(self._counted[g] for g in self._pending)
            if lost > 0:
                self.dropped["stopped"] += lost
        self._pending.clear()
        self._counted.clear()
        self.state.dropped = dict(self.dropped)

    def _drop(self, g: int, results: list[EpisodeResult], unused: str | None) -> None:
        """Count the episodes of group ``g`` that will not be trained: a failed one under its
        end reason, one without a completion under ``no_completions``, and with ``unused``
        (the group is not trained) every other one under ``unused``."""
        for r in results:
            if not r.ok:
                reason = r.end_reason
            elif not r.episode.completions:
                reason = "no_completions"
            elif unused is not None:
                reason = unused
            else:
                continue
            self.dropped[reason] += 1
            self._counted[g] += 1

    def _check_progress(self, results: list[EpisodeResult]) -> None:
        """Count groups in a row none of whose episodes ended normally; at
        :attr:`failed_groups_to_stop` of them, the run's wait raises :class:`RolloutStalled`."""
        if not results or any(r.ok for r in results):
            self._failed_in_row = []
            return
        self._failed_in_row.append(results)
        groups = len(self._failed_in_row)
        if groups < self.failed_groups_to_stop or self._failure is None or self._failure.done():
            return
        eps = [r for group in self._failed_in_row for r in group]
        counts = Counter(r.end_reason for r in eps).most_common()
        reasons = ", ".join(f"{k} x{n}" for k, n in counts)
        last = next((r.error for r in reversed(eps) if r.error), None)
        self._failure.set_exception(
            RolloutStalled(
                f"no episode of the last {groups} groups ended normally ({len(eps)} episodes: "
                f"{reasons}); the run cannot train on failures, so it stops. "
                + (f"The last error: {last[:500]}. " if last else "")
                + "Each episode's error is in RUN_DIR/episodes.db (areal-agent view RUN_DIR)."
            )
        )

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
            self._pending[g] = self.group_name(g)
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
            if not probed_out:
                results += await self._timed_episodes(g, s.group_size - k, k)
        if s.redo_lost and any(r.end_reason == "agent_lost" for r in results):
            self._drop(g, results, "regenerated")  # the finished ones are thrown away too
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

    async def _settle(self, g: int, results: list[EpisodeResult], probed_out: bool) -> None:
        """A finished group: checked (enough usable episodes; not uniform under dynamic
        sampling), its episodes that will not be trained counted, its gate slot freed, and
        queued for training or skipped."""
        s = self.settings
        assert self.gate is not None
        if self.judge is not None and not probed_out:
            with spans.span("rollout", "judge", group=g):
                rescored = await self.judge.apply(f"g{g}", results)
            if self.store is not None:
                for r in rescored:
                    self.store.put_rescored(r.episode)
        ok = _usable(results)
        self._check_progress(results)
        unused = None
        if probed_out:
            unused = "uniform_probe"
        elif len(ok) < s.min_episodes:
            unused = "group_too_small"
        elif s.dynamic_sampling and _uniform(ok):
            unused = "uniform_group"
        self._drop(g, results, unused)
        keep = unused is None
        await self.gate.finish(accepted=keep)
        if keep:
            await self._queue.put(Group(g, ok))
        else:
            self.state.skipped_groups.append(g)  # never redone; the gate admits a new group
            self._pending.pop(g, None)
            self._counted.pop(g, None)


class RolloutStalled(RuntimeError):
    """Every episode of many groups in a row failed: the run cannot train."""


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
            group_id=self.group_name(g),
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

    async def stop_serving(self) -> None:
        await self.server.stop()
        self._serving = False


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

    async def stop_serving(self) -> None:
        # the episodes were cancelled first (stop): their tasks are withdrawn, and calls on
        # them get 409 task_over; now waiting long-polls get 503 at once, then the server
        # finishes the requests in flight and stops, all before the store closes
        self.hub.close()
        await super().stop_serving()


class RaySource(EnvSource):
    """The runner's episodes on Ray rollout-worker actors (env- or agent-driven), the engine
    an actor too; the policy trains in this process. Closing ends the worker actors, before
    the store closes: their proxies' records reach it first."""

    async def stop_serving(self) -> None:
        await self.runner.close()


__all__ = [
    "AgentSource",
    "EnvSource",
    "ExternalSource",
    "Group",
    "GroupSource",
    "RaySource",
    "SourceSettings",
]
