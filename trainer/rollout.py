"""Sources of training groups: where the episodes of a step come from.

A :class:`GroupSource` yields finished groups (``rollout.group_size`` episodes of one task,
under one group id) to the training loop, and owns everything about producing them:

* **Task sampling.** Group g of the run resets its env with seed ``seed_base + g``; episode i
  of group g samples with seed ``(seed_base + g) * G + i`` (env-driven episodes; probe or
  not), so a group is reproducible.
* **The staleness gate** (:mod:`trainer.staleness`): a group starts only while
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

Four sources differ only in how the episodes of one group are produced and what they own:

    EnvSource       the raw model drives the env turn by turn (the runner loops env.step)
    AgentSource     the user's agent in this process, against the proxy's HTTP endpoint
    ExternalSource  agents in other processes pull tasks from the worker API
    RaySource       the runner's episodes on Ray actors (env- or agent-driven)

:func:`build_rollout` picks and builds one from the config, with its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from areal_agents.errors import ConfigError
from areal_agents.runner import EpisodeResult, Runner

from .advantage import filter_uniform_groups
from .checkpoint import RunState
from .config import GROUP_ALGORITHMS, TrainConfig
from .staleness import StalenessGate

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

    async def close(self) -> None:
        """Stop generating. Groups in flight are not consumed (a resume redoes them)."""
        pending = [t for t in (self._producer, *self._tasks) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._failure is not None and not self._failure.done():
            self._failure.cancel()
        elif self._failure is not None:
            self._failure.exception()  # retrieved: no "never retrieved" warning
        self.state.dropped = dict(self.dropped)

    # ------------------------------------------------------------------ producing
    async def _produce(self) -> None:
        assert self.gate is not None
        while True:
            await self.gate.acquire()
            if self._redo:
                g = self._redo.pop(0)
            else:
                g = self.state.next_group
                self.state.next_group += 1
            task = asyncio.create_task(self._guarded(g))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _guarded(self, g: int) -> None:
        try:
            await self._group(g)
        except Exception as exc:
            assert self._failure is not None
            if not self._failure.done():
                self._failure.set_exception(exc)

    async def _group(self, g: int) -> None:
        s = self.settings
        assert self.gate is not None
        k = s.probe_size
        results = await self.episodes(g, k or s.group_size, 0)
        probed_out = False
        if k:
            probe = _usable(results)
            probed_out = len(probe) >= 2 and _uniform(probe)
            if probed_out:
                self.dropped["uniform_probe"] += 1
            else:
                results += await self.episodes(g, s.group_size - k, k)
        for r in results:
            if not r.ok:
                self.dropped[r.end_reason] += 1
        if s.redo_lost and any(r.end_reason == "agent_lost" for r in results):
            self._redo.append(g)  # generated again; the gate admits it like a new group
            await self.gate.finish(accepted=False)
            return
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
        """The agent code that runs in this process (its prompts can be observed for a
        warm start), or None: the model drives the env, or agents run elsewhere."""
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

    async def start(self, version: int) -> None:
        await self.server.start()
        await super().start(version)

    async def close(self) -> None:
        await super().close()
        await self.server.stop()


class ExternalSource(AgentSource):
    """Agents in their own processes: a group's episodes become tasks on the worker API
    (:mod:`areal_agents.workers`); a worker pulls one, runs its agent against the session,
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


# ---------------------------------------------------------------------------- building
@dataclass
class Rollout:
    """What :func:`build_rollout` returns: the engine the policy's weights go to, and the
    source of groups."""

    engine: Any
    source: EnvSource


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
    makes one env first, so that a bad factory or env fails here, before any episode."""
    from envs.registry import make

    settings = SourceSettings.from_config(cfg, dynamic_sampling)
    kwargs = dict(cfg.env.kwargs)
    probe = make(cfg.env.id, **kwargs)
    if "split" in inspect.signature(type(probe.unwrapped).__init__).parameters:
        kwargs.setdefault("split", cfg.env.split)
    probe.close()

    def make_env() -> Any:
        return make(cfg.env.id, **kwargs)

    agent = None
    if cfg.agent.factory is not None:
        from areal_agents.task_agent import load_agent

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
        return Rollout(engine, RaySource(settings, state, runner, make_env, agent))

    from areal_agents.embedded import EmbeddedEngine
    from areal_agents.hardware import default_device, resolve_dtype
    from areal_agents.proxy import Proxy

    device = default_device(cfg.model.device)
    engine = EmbeddedEngine.from_pretrained(
        model_path,
        dtype=resolve_dtype(cfg.model.dtype, device),
        device=cfg.model.device,
        decode=tokenizer.decode,
        max_batch_size=max(cfg.rollout.concurrency, 1),
        compute_lock=compute_lock,
    )
    external = cfg.rollout.agents == "external"
    proxy = Proxy(
        engine,
        tokenizer,
        self_rewarding=not external,
        default_max_tokens=cfg.sampling.max_new_tokens,  # for agent calls that set none
    )
    if agent is None and not external:
        return Rollout(engine, EnvSource(settings, state, Runner(proxy, **runner_kwargs), make_env))
    from areal_agents.server import LoopServer

    host, port = cfg.workers.host, cfg.workers.port
    hub = None
    if external:
        from areal_agents.workers import WorkerHub

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
        return Rollout(engine, ExternalSource(settings, state, runner, make_env, hub, server))
    return Rollout(engine, AgentSource(settings, state, runner, make_env, agent, server))


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
    from areal_agents.server import free_port

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
    (:mod:`areal_agents.cluster`, :mod:`areal_agents.ray_runner`) while the policy trains in
    this process; new weights reach the engine actors through the object store.

    Joins ``$RAY_ADDRESS`` or a cluster started with ``ray start`` on this machine, else starts
    a local one (Ray shuts that down when the process exits). One engine actor (a GPU when the
    cluster has one); rollout workers: one per node, at least 2.
    """
    from areal_agents.cluster import EmbeddedSpec, RayEngine, connect
    from areal_agents.hardware import default_device, resolve_dtype
    from areal_agents.ray_runner import RayRunner

    connect()
    spec = EmbeddedSpec(
        model=None if cfg.model.path is None else model_path,  # None: prepared on its node
        dtype=resolve_dtype(cfg.model.dtype, default_device(cfg.model.device)),
        device=cfg.model.device,
        max_batch_size=max(cfg.rollout.concurrency, 1),
    )
    engine = RayEngine.start(spec)
    return engine, RayRunner(engine, model_path, **runner_kwargs)


__all__ = [
    "AgentSource",
    "EnvSource",
    "ExternalSource",
    "Group",
    "GroupSource",
    "RaySource",
    "Rollout",
    "SourceSettings",
    "build_rollout",
]
