"""Rollout workers: episodes run by Ray actors, with the same interface as the local Runner.

:class:`RayRunner` keeps a pool of :class:`RolloutWorker` actors spread over the cluster. Each
worker holds a :class:`~areal_agents.serve.proxy.Proxy` (over a
:class:`~areal_agents.rollout.cluster.RayEngine` client) and a
:class:`~areal_agents.rollout.runner.Runner`, and runs every episode with exactly the code a
local run uses, next to its env and tools; the finished
:class:`~areal_agents.rollout.runner.EpisodeResult` comes back pickled. See
:mod:`areal_agents.rollout.cluster` for why episodes run there rather than against one central
proxy.

Dispatch: an episode goes to the live worker with the fewest episodes in flight from this
runner; ``concurrency`` bounds them over the whole pool (each worker's own runner gets an equal
share). The env factory and the agent travel to the object store once and are reused.

Recording: with a ``store`` (a :class:`~areal_agents.rollout.ray_store.RayStore`), every
worker's proxy records into the run's episode store through the store-writer actor, exactly
the rows a local run's proxy writes (:mod:`areal_agents.rollout.ray_store`); a worker returns
an episode once its records are committed. The sessions a dead worker left open end there as
``"worker_lost"``.

Fault tolerance: workers are created with ``max_restarts`` and called with
``max_task_retries=0``, so every loss is seen here. When a worker dies under an episode, the
runner waits for Ray to restart it (or retires it when its restarts are spent), then runs the
episode again from the start with the same seeds, on any live worker, up to
``episode_retries`` times; past that the episode is returned as failed with end reason
``"worker_lost"`` and the error, so it is counted like any other failure and never dropped.
``RayRunner.counters`` counts ``episodes``, ``worker_failures``, ``worker_restarts``,
``workers_retired``, ``episodes_rerun`` and ``episodes_lost``; a re-run episode carries
``info["worker_retries"]``. With no worker left,
:class:`~areal_agents.rollout.cluster.ClusterError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import tempfile
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.errors import UserError
from areal_agents.rollout.cluster import (
    ClusterError,
    RayActorError,
    RayEngine,
    RayTaskError,
    alive_nodes,
    cause,
    check_room,
    first_line,
    ray,
    wait_ready,
)
from areal_agents.rollout.ray_store import RayStore, StoreLink
from areal_agents.rollout.runner import EnvFactory, EpisodeResult, Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.trajectory import Episode

WORKER_LOST = "worker_lost"
"""End reason of an episode whose rollout worker died on every attempt."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".ckpt", ".onnx")
_MAX_TOKENIZER_FILE = 64 << 20


@dataclass(frozen=True)
class TokenizerFiles:
    """The small files of a tokenizer directory, to rebuild its ChatTokenizer on any node."""

    files: dict[str, bytes] = field(repr=False)

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> TokenizerFiles:
        """Every file of ``directory`` except weights (and anything over 64 MiB)."""
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise UserError(
                f"no tokenizer.json in {str(root)!r}; pass the model directory (one written "
                "by save_pretrained)"
            )
        files = {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file()
            and not p.name.endswith(_WEIGHT_SUFFIXES)
            and p.stat().st_size <= _MAX_TOKENIZER_FILE
        }
        return cls(files)

    def load(self) -> Any:
        """The :class:`~areal_agents.serve.chat.ChatTokenizer` these files describe."""
        with tempfile.TemporaryDirectory(prefix="areal-tokenizer-") as tmp:
            for name, data in self.files.items():
                path = Path(tmp) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            return ChatTokenizer.from_dir(tmp)


class RolloutWorker:
    """The body of a rollout-worker actor: a proxy and a runner next to the envs it runs.

    The tokenizer files come with every call, as an object reference inside a list (so Ray
    passes the reference, not the bytes): the worker builds its proxy on its first call, and
    after a restart on the first call again. The driver keeps the files alive. With
    ``store_info`` (:attr:`RayStore.info`) the proxy records through a
    :class:`~areal_agents.rollout.ray_store.StoreLink` of its own (a new one after a restart).
    """

    def __init__(
        self,
        engine_info: dict[str, Any],
        runner_kwargs: dict[str, Any],
        store_info: dict[str, Any] | None = None,
    ) -> None:
        # The engine actors (and the store writer) are found by name: actor handles among the
        # constructor's arguments would make Ray warn that a restart may lose them.
        self._engine = RayEngine.find(engine_info)
        self._runner_kwargs = runner_kwargs
        self._store_info = store_info
        self._link: StoreLink | None = None
        self.link_id = f"worker-{uuid.uuid4().hex[:12]}"
        """This process's link to the store (a restarted worker gets a new one)."""
        self._runner: Runner | None = None
        self._setup = asyncio.Lock()
        self._server: Any = None

    async def _ready(self, tokenizer: list[Any]) -> Runner:
        async with self._setup:
            if self._runner is None:
                files: TokenizerFiles = await tokenizer[0]
                if self._store_info is not None and self._link is None:
                    self._link = StoreLink.find(self._store_info, self.link_id)
                # restore=False: a worker's sessions are its own episodes', never an earlier
                # process's (a re-run episode opens a new session)
                proxy = Proxy(self._engine, files.load(), store=self._link, restore=False)
                self._runner = Runner(proxy, **self._runner_kwargs)
        return self._runner

    async def pid(self) -> int:
        return os.getpid()

    async def ping(self, tokenizer: list[Any]) -> tuple[int, str, str]:
        """Ready to run episodes: (process id, node id, store link id)."""
        await self._ready(tokenizer)
        return os.getpid(), ray.get_runtime_context().get_node_id(), self.link_id

    async def run_episode(
        self,
        tokenizer: list[Any],
        make_env: EnvFactory,
        agent: Any,
        seed: int | None,
        options: dict[str, Any] | None,
        group_id: str | None,
        sampling_seed: int | None,
    ) -> EpisodeResult:
        runner = await self._ready(tokenizer)
        if agent is not None and runner.base_url is None:
            self._server = ProxyServer.start(runner.proxy)  # loopback, for this node's agents
            runner.base_url = self._server.base_url
        try:
            return await runner.run_episode(
                make_env,
                seed=seed,
                options=options,
                agent=agent,
                group_id=group_id,
                sampling_seed=sampling_seed,
            )
        finally:  # the episode is in the store before the driver sees it
            if self._link is not None:
                await self._link.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._link is not None:  # what the proxy recorded so far reaches the store first
            await self._link.drain()  # (not closed: episodes still running may record on)


@dataclass(eq=False)
class _Worker:
    handle: Any
    pid: int = 0
    link: str = ""
    inflight: int = 0
    generation: int = 0
    dead: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RayRunner:
    """Runs episodes on rollout-worker actors; the same interface as
    :class:`~areal_agents.rollout.runner.Runner` (``run_episode``, ``run_group``).

    ``tokenizer``: the model directory (or :class:`TokenizerFiles`). ``workers`` None: one per
    alive node, at least 2, spread over the nodes. ``concurrency`` bounds the episodes in flight
    over all workers (each worker gets an equal share). ``max_restarts``: how often Ray restarts
    a dead worker; ``episode_retries``: how often an episode whose worker died is run again
    before it is returned with end reason ``"worker_lost"``. ``store``: the episode store the
    workers' proxies record into (its owner closes it, after this runner). Blocks until every
    worker is up.
    """

    def __init__(
        self,
        engine: RayEngine,
        tokenizer: str | os.PathLike[str] | TokenizerFiles,
        *,
        workers: int | None = None,
        concurrency: int = 256,
        max_turns: int = 16,
        episode_timeout_s: float = 600.0,
        sampling: dict[str, Any] | None = None,
        sampling_by_kind: dict[str, dict[str, Any]] | None = None,
        step_in_thread: bool = True,
        worker_cpus: float = 0.5,
        max_restarts: int = 3,
        episode_retries: int = 1,
        restart_timeout_s: float = 120.0,
        ready_timeout_s: float = 300.0,
        store: RayStore | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if episode_retries < 0:
            raise ValueError(f"episode_retries must be >= 0, got {episode_retries}")
        n = workers if workers is not None else max(2, alive_nodes())
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        check_room("rollout worker", n, {"CPU": worker_cpus}, "--ray-workers")
        files = (
            tokenizer if isinstance(tokenizer, TokenizerFiles) else TokenizerFiles.read(tokenizer)
        )
        runner_kwargs = {
            "concurrency": math.ceil(concurrency / n),
            "max_turns": max_turns,
            "episode_timeout_s": episode_timeout_s,
            "sampling": dict(sampling or {}),
            "sampling_by_kind": dict(sampling_by_kind or {}),
            "step_in_thread": step_in_thread,
        }
        actor: Any = ray.remote(RolloutWorker).options(
            num_cpus=worker_cpus,
            max_restarts=max_restarts,
            max_task_retries=0,
            scheduling_strategy="SPREAD",
        )
        self._tokenizer = [ray.put(files)]
        store_info = None if store is None else store.info
        handles = [actor.remote(engine.info, runner_kwargs, store_info) for _ in range(n)]
        try:
            ready = wait_ready(
                [h.ping.remote(self._tokenizer) for h in handles],
                "rollout worker",
                ready_timeout_s,
                n,
            )
        except BaseException:
            for h in handles:
                ray.kill(h)
            raise
        self.engine = engine
        self.store = store
        """The episode store the workers record into (None: they record nothing)."""
        self.episode_retries = episode_retries
        self.restart_timeout_s = restart_timeout_s
        self.counters: Counter[str] = Counter()
        """episodes, worker_failures, worker_restarts, workers_retired, episodes_rerun,
        episodes_lost (returned with end reason "worker_lost")."""
        self._workers = [
            _Worker(h, pid, link=link) for h, (pid, _, link) in zip(handles, ready, strict=True)
        ]
        self.nodes = sorted({node for _, node, _ in ready} | set(engine.nodes))
        """The nodes the workers and the engine replicas started on."""
        self._slots = asyncio.Semaphore(concurrency)
        self._refs: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._closed = False

    @property
    def workers(self) -> list[Any]:
        """The worker actor handles (for inspection; killing one is what the tests do)."""
        return [w.handle for w in self._workers]

    def stats(self) -> dict[str, Any]:
        """Counters plus the pool's size, for reports."""
        alive = sum(not w.dead for w in self._workers)
        return {
            "workers": len(self._workers),
            "workers_alive": alive,
            "engine_replicas": self.engine.replicas,
            "nodes": len(self.nodes),
            **{k: self.counters[k] for k in sorted(self.counters)},
        }

    # ------------------------------------------------------------------ public
    # The same grouping as the local runner (one gid, seeds sampling_seed + i); it only
    # calls run_episode, which this class runs on a worker.
    run_group = Runner.run_group

    async def run_episode(
        self,
        make_env: EnvFactory,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        agent: Any = None,
        group_id: str | None = None,
        sampling_seed: int | None = None,
    ) -> EpisodeResult:
        """One episode on a worker, as :meth:`Runner.run_episode`; a worker that dies under it
        costs a re-run or a ``"worker_lost"`` result (see the module docstring)."""
        if self._closed:
            raise UserError("this RayRunner is closed; build a new one")
        env_ref = self._shipped(make_env, "make_env")
        agent_ref = None if agent is None else self._shipped(agent, "the agent")
        start = time.perf_counter()
        async with self._slots:
            error: Exception | None = None
            for attempt in range(self.episode_retries + 1):
                worker = self._pick()
                generation = worker.generation
                worker.inflight += 1
                try:
                    result: EpisodeResult = await worker.handle.run_episode.remote(
                        self._tokenizer, env_ref, agent_ref, seed, options, group_id, sampling_seed
                    )
                except RayTaskError as exc:
                    raise cause(exc) from None
                except RayActorError as exc:
                    error = exc
                    await self._recover(worker, generation)
                    if attempt < self.episode_retries:
                        self.counters["episodes_rerun"] += 1
                    continue
                finally:
                    worker.inflight -= 1
                if attempt:
                    result.info["worker_retries"] = attempt
                self.counters["episodes"] += 1
                return result
            self.counters["episodes_lost"] += 1
            self.counters["episodes"] += 1
            attempts, duration_s = self.episode_retries + 1, time.perf_counter() - start
            return _lost(group_id, seed, error, attempts, duration_s)

    async def close(self) -> None:
        """End the worker actors (the engine is closed by its owner)."""
        if self._closed:
            return
        self._closed = True
        alive = [w.handle for w in self._workers if not w.dead]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*[h.close.remote() for h in alive]), 10)
        for w in self._workers:
            ray.kill(w.handle)

    # ------------------------------------------------------------------ internals
    def _pick(self) -> _Worker:
        alive = [w for w in self._workers if not w.dead]
        if not alive:
            raise ClusterError(
                f"all {len(self._workers)} rollout workers died and their restarts are spent; "
                "see the Ray logs (/tmp/ray/session_latest/logs) for why, then rerun"
            )
        return min(alive, key=lambda w: w.inflight)

    async def _recover(self, worker: _Worker, generation: int) -> None:
        """After a call failed because its worker died: wait for Ray to restart it (counted) or
        retire it. Several episodes lost with the same worker recover it once."""
        async with worker.lock:
            if worker.generation != generation or worker.dead:
                return
            worker.generation += 1
            self.counters["worker_failures"] += 1
            try:
                ping = worker.handle.ping.options(max_task_retries=-1).remote(self._tokenizer)
                pid, _, link = await asyncio.wait_for(ping, self.restart_timeout_s)
            except (RayActorError, TimeoutError):
                worker.dead = True
                self.counters["workers_retired"] += 1
                self._end_link(worker.link)
                return
            if pid != worker.pid:
                worker.pid = pid
                self.counters["worker_restarts"] += 1
            if link != worker.link:  # a new process: the old one's open sessions are lost
                self._end_link(worker.link)
                worker.link = link

    def _end_link(self, link: str) -> None:
        if self.store is not None and link:
            self.store.end_link(link, WORKER_LOST)

    def _shipped(self, obj: Any, what: str) -> Any:
        """``obj`` in the object store, once per object (the last 64 kept)."""
        key = id(obj)
        if key in self._refs and self._refs[key][0] is obj:
            self._refs.move_to_end(key)
            return self._refs[key][1]
        try:
            ref = ray.put(obj)
        except Exception as exc:
            raise UserError(
                f"{what} cannot be sent to the Ray workers ({exc}); it must pickle with "
                "cloudpickle: define it in an importable module or use functools.partial"
            ) from None
        self._refs[key] = (obj, ref)
        while len(self._refs) > 64:
            self._refs.popitem(last=False)
        return ref


def _lost(
    group_id: str | None,
    seed: int | None,
    error: Exception | None,
    attempts: int,
    duration_s: float,
) -> EpisodeResult:
    """The result of an episode that never came back: no completions, the reason, the error."""
    message = (
        f"the rollout worker died under this episode on each of {attempts} attempt(s): "
        f"{first_line(error)}"
    )
    episode = Episode(
        "lost-" + uuid.uuid4().hex[:16], group_id=group_id, ended=True, metadata={"seed": seed}
    )
    episode.end_reason = WORKER_LOST
    episode.errors.append({"kind": WORKER_LOST, "message": message})
    return EpisodeResult(
        episode=episode,
        reward=0.0,
        success=None,
        turns=0,
        end_reason=WORKER_LOST,
        error=message,
        info={"task": {}, "worker_retries": attempts - 1},
        duration_s=duration_s,
    )
