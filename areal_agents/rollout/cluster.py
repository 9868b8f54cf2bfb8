"""Ray scale-out: inference engines and rollout workers as Ray actors across a cluster.

This module connects to the cluster and hosts the engines; :mod:`areal_agents.rollout.ray_runner`
runs the episodes.

::

    driver (CLI or trainer)                  Ray cluster: one machine or many
    -----------------------                  --------------------------------
    RayRunner.run_episode  ── actor call ──▶ RolloutWorker  (N, spread over the nodes)
                                               Runner + Proxy (recording), envs, tools,
                                               agents; a loopback proxy server for agents
                                                   │  RayEngine: the Engine protocol
                                                   ▼  token ids in, GenerateResult out
    RayEngine.update_weights ─ actor call ─▶ EngineHost     (M replicas, GPUs when there are)
                                               an Engine built on its node (embedded default)
    RayStore (trainer's writes) ─ actor call ─▶ StoreHost   (1, on the driver's node)
                                               the run's EpisodeStore; each worker's proxy
                                               writes to it through a StoreLink of its own

Choices made:

* **Episodes run where their env runs.** A rollout worker holds its own :class:`Proxy`
  (tokenizer, chat template, tool-call parsing, session recording) and its own
  :class:`~areal_agents.rollout.runner.Runner`, and runs each episode with exactly the code a
  local run uses; it returns the finished :class:`~areal_agents.rollout.runner.EpisodeResult`
  (pickled). Episodes are therefore identical in shape to local ones by construction: same
  fields, same token-level data, same end reasons. Only token ids cross the network, between
  a worker's proxy and an engine actor. The alternative, envs calling one central proxy over
  HTTP, was rejected: that proxy would tokenize and parse every call of the whole cluster,
  rewards would cost extra round trips, and the driver would need an address every node can
  reach.
* **One episode store.** Every worker's proxy records its sessions into the run's store
  (``RUN_DIR/episodes.db``, or ``eval --store``) through a store-writer actor on the
  driver's node, in batches and in order, the same rows a local proxy writes
  (:mod:`areal_agents.rollout.ray_store`); an episode comes back once its records are
  committed.
* **Agents** (agent-driven episodes) talk HTTP to a proxy server that their worker starts on
  loopback, the first time it runs one; the agent object, like the env factory, is shipped to
  the object store once (it must pickle with cloudpickle).
* **Engines.** An :class:`EngineHost` actor builds its engine on its own node from a picklable
  factory (:class:`EmbeddedSpec` by default, so the model is found where it is loaded), and
  :class:`RayEngine` implements the :class:`~areal_agents.engines.protocol.Engine` protocol by
  calling the hosts: ``generate`` goes to the replica that served the same ``route_key``
  (session) before, else to the one with the fewest requests in flight from this client;
  ``update_weights``, ``pause`` and ``resume`` go to every replica (new weights travel once,
  through the object store). The proxy, the recording and the data contract do not change.
  Engine actors are named, and workers find them by name.
* **Fault tolerance.** Workers are created with ``max_restarts`` and their calls with
  ``max_task_retries=0``, so the driver sees every loss. An episode whose worker died is run
  again from the start (same seeds; ``episode_retries`` times, on any live worker) or, past
  that, returned as a failed episode with end reason ``"worker_lost"`` and the error: never
  dropped. ``RayRunner.counters`` counts worker failures, restarts, re-runs and lost episodes. A
  worker whose restarts are spent is retired; when none is left, :class:`ClusterError`.
* **Engine hosts are not restarted** by default: a restarted engine would come back with its
  initial weights and silently serve an old policy during training. A call that finds its
  engine dead raises :class:`~areal_agents.errors.BackendError`, so the proxy ends that
  episode with ``"backend_error"``, as for any engine failure.
* **Tokenizer files** travel to the workers as bytes, so a worker on another machine needs no
  copy of the model directory; an engine host needs the model (a path that exists on its node,
  a hub id, or ``None`` for the default model, prepared on that node).

Every node needs the same Python environment with areal-agents installed (workers import
``areal_agents``, ``envs`` and ``tools``). Ray itself is optional
(``pip install 'areal-agents[ray]'``); importing this module without it raises
:class:`RayNotInstalled`.

Example::

    from areal_agents.rollout.cluster import EmbeddedSpec, RayEngine, attached
    from areal_agents.rollout.ray_runner import RayRunner

    with attached():                      # RAY_ADDRESS, a `ray start` cluster, or a local one
        engine = RayEngine.start(EmbeddedSpec(model=None), replicas=1)
        runner = RayRunner(engine, tokenizer="path/to/model", workers=4)
        results = asyncio.run(runner.run_group(make_env, 8, seed=0))
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from areal_agents import spans
from areal_agents.engines.protocol import (
    Engine,
    GenerateResult,
    KvOnUpdate,
    SamplingParams,
    WeightUpdate,
    accepts_route_key,
)
from areal_agents.errors import ArealError, BackendError, UserError
from areal_agents.hardware import lowest_priority, pin_to_cpus
from areal_agents.model import resolve_model
from areal_agents.serve.chat import ChatTokenizer

INSTALL_HINT = "pip install 'areal-agents[ray]'"
_MAX_ROUTES = 8192  # sessions remembered for sticky routing (least recently used dropped)
FORWARDED_ENV = ("OMP_WAIT_POLICY",)
"""Environment variables :func:`connect` passes to the job's Ray workers."""


class RayNotInstalled(UserError, ImportError):
    """Ray is needed (``--ray``, ``scheduler: ray``) but not installed."""


class ClusterError(ArealError):
    """The Ray cluster cannot run what was asked: too few resources for the actors, an actor
    that cannot start, or no rollout worker left alive."""


try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
except ImportError as _exc:
    raise RayNotInstalled(
        f"Ray is not installed; run `{INSTALL_HINT}` (or drop --ray / set scheduler: local)"
    ) from _exc


# ---------------------------------------------------------------------------- connecting
def connect(address: str | None = None) -> bool:
    """Attach this process to a Ray cluster; True when this call initialized Ray.

    ``address``: ``"auto"``, ``"HOST:PORT"`` of a head node, or None: ``$RAY_ADDRESS``, else
    the latest cluster started with ``ray start`` on this machine, else a new local instance.
    Whoever gets True calls ``ray.shutdown()`` when done (which only disconnects from a cluster
    it did not start).
    """
    if ray.is_initialized():
        return False
    _check_reachable(address or os.environ.get("RAY_ADDRESS"))
    # every worker of this job gets them, also on a cluster that `ray start` began elsewhere,
    # whose processes do not inherit this one's environment (the CLI sets OMP_WAIT_POLICY)
    env_vars = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
    try:
        ray.init(address=address, runtime_env={"env_vars": env_vars} if env_vars else None)
    except ConnectionError as exc:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address or os.environ.get('RAY_ADDRESS')!r}: "
            f"{exc}; start one with `ray start --head` or fix --ray-address / RAY_ADDRESS"
        ) from None
    return True


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``HOST:PORT`` nobody listens on (Ray itself retries for minutes)."""
    text = address or ""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or "://" in text:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster answers at {address} ({exc}); start the head node there with "
            "`ray start --head`, or fix --ray-address / RAY_ADDRESS"
        ) from None


@contextlib.contextmanager
def attached(address: str | None = None) -> Iterator[None]:
    """``connect`` for the duration of a block; shuts Ray down after it if it initialized it."""
    started = connect(address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EmbeddedSpec:
    """How an engine host builds an :class:`~areal_agents.engines.embedded.EmbeddedEngine` on
    its node.

    ``model``: a path that exists on the engine's node, a hub id, or None for the default model
    (prepared on that node on first use). ``adapter``: a saved LoRA adapter directory (on the
    engine's node) applied on top. ``max_context``: the longest prompt + output in tokens
    (None: the model's own limit). ``cpus``: CPU cores the engine's process runs on, with as
    many torch threads (None: wherever the OS puts it). ``kv_on_update``: what a weight
    update does with requests in flight (``EmbeddedEngine``'s). ``idle_priority``: the
    process runs at the lowest CPU priority (``SCHED_IDLE``), computing only when nothing
    else on its cores wants them (an extra replica on a trainer's cores:
    ``rollout.idle_engine_cpus``); its spans are on lane ``engine_idle`` and measured in
    CPU time.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    adapter: str | None = None
    max_batch_size: int = 64
    max_context: int | None = None
    cpus: tuple[int, ...] | None = None
    kv_on_update: KvOnUpdate = "recompute"
    idle_priority: bool = False

    @property
    def lane(self) -> str:
        """The spans lane of an engine built from this spec."""
        return "engine_idle" if self.idle_priority else "engine"

    def __call__(self) -> Engine:
        # torch loads in the engine actor that builds the engine, never in the driver
        from areal_agents.engines.embedded import EmbeddedEngine  # noqa: PLC0415  loads torch here

        key = "rollout.idle_engine_cpus" if self.idle_priority else "rollout.engine_cpus"
        if self.cpus is not None:
            pin_to_cpus(self.cpus, key)
        if self.idle_priority:
            lowest_priority(key)

        path = resolve_model(self.model, quiet=True)
        decode = ChatTokenizer.from_dir(path).decode
        return EmbeddedEngine.from_pretrained(
            path,
            dtype=self.dtype,
            device=self.device,
            adapter=self.adapter,
            decode=decode,
            max_batch_size=self.max_batch_size,
            max_context=self.max_context,
            kv_on_update=self.kv_on_update,
            cpu_time_spans=self.idle_priority,
        )

    @property
    def wants_gpu(self) -> bool:
        return self.device is None or self.device.startswith("cuda")


class EngineHost:
    """The body of an engine actor: builds its engine once and serves it to the clients."""

    def __init__(self, factory: Callable[[], Engine]) -> None:
        # The engine's prefill / decode spans, kept here until the trainer takes them
        # (``take_spans``); a client that never does keeps the newest 100k.
        self._spans = spans.record_to(None, max_pending=100_000)
        self._lane = str(getattr(factory, "lane", "engine"))
        self.engine = factory()
        self._takes_route_key = accepts_route_key(self.engine)

    async def take_spans(self) -> list[dict[str, Any]]:
        """The spans this engine recorded since the last call, on the wall clock."""
        return self._spans.drain()

    async def describe(self) -> dict[str, Any]:
        return {
            "model_name": self.engine.model_name,
            "max_context": getattr(self.engine, "max_context", None),
            "version": self.engine.version,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "lane": self._lane,
            "idle_priority": _idle_priority(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        }

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, route_key: str | None
    ) -> GenerateResult:
        if self._takes_route_key and route_key is not None:
            return await self.engine.generate(prompt_ids, params, route_key=route_key)  # type: ignore[call-arg]
        return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self.engine.update_weights(update)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def health(self) -> dict[str, Any]:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()


def _idle_priority() -> bool:
    """Whether this process runs at the idle CPU priority (``SCHED_IDLE``, Linux)."""
    if not hasattr(os, "sched_getscheduler"):
        return False
    return bool(os.sched_getscheduler(0) == getattr(os, "SCHED_IDLE", -1))


class RayEngine:
    """The :class:`~areal_agents.engines.protocol.Engine` protocol over one or more engine actors.

    Build it with :meth:`start`. A call with a ``route_key`` (the proxy passes the session id)
    goes to the replica that served that key before, so a session's growing prompt stays on
    one replica (and its prefix cache); other calls go to the replica with the fewest requests
    in flight from this client. Other processes get a client of the same actors with
    :meth:`find` (rollout workers do) or by unpickling one; such a client does not own the
    actors, so only the original's :meth:`close` ends them. ``version`` is the last version
    this client saw (at start and after each update).
    """

    def __init__(self, actors: Sequence[Any], info: dict[str, Any], *, owner: bool) -> None:
        if not actors:
            raise ValueError("RayEngine needs at least one engine actor")
        self._actors = list(actors)
        self._inflight = [0] * len(self._actors)
        self._routes: OrderedDict[str, int] = OrderedDict()
        self._owner = owner
        self._closed = False
        self.info = dict(info)
        """What the replicas reported at start (model_name, max_context, version, nodes) and
        the actors' names."""
        self.model_name: str = info["model_name"]
        self.max_context: int | None = info.get("max_context")
        self._version: int = info["version"]
        self.nodes: list[str] = list(info.get("nodes", []))

    @classmethod
    def start(
        cls,
        factory: Callable[[], Engine] | None = None,
        *,
        replicas: int = 1,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        max_restarts: int = 0,
        ready_timeout_s: float = 600.0,
        extra: Sequence[tuple[Callable[[], Engine], float]] = (),
    ) -> RayEngine:
        """Start ``replicas`` engine actors, each building its engine with ``factory()``.

        ``factory`` defaults to ``EmbeddedSpec()`` (the default model). ``num_gpus`` None: one
        GPU per replica when the cluster has GPUs and the factory wants one, else none. Blocks
        until every replica answers (model loading included), at most ``ready_timeout_s``.
        ``extra``: more replicas, each ``(factory, num_cpus)`` (e.g. one at the idle CPU
        priority on the trainer's cores, which reserves no CPU: ``num_cpus=0``); they serve
        and take weight updates like the others.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        factory = factory if factory is not None else EmbeddedSpec()
        gpus = _engine_gpus(factory, num_gpus)
        check_room("engine", replicas, {"CPU": num_cpus, "GPU": gpus}, "--ray-engines")
        host: Any = ray.remote(EngineHost)
        plans = [(factory, num_cpus, gpus)] * replicas
        plans += [(f, cpus, _engine_gpus(f, num_gpus)) for f, cpus in extra]
        # Named, so that rollout workers find them by name (``find``).
        tag = uuid.uuid4().hex[:12]
        names = [f"areal-engine-{tag}-{i}" for i in range(len(plans))]
        actors = [
            host.options(
                name=name,
                max_task_retries=0,
                num_cpus=cpus,
                num_gpus=gpu,
                max_restarts=max_restarts,
            ).remote(f)
            for name, (f, cpus, gpu) in zip(names, plans, strict=True)
        ]
        try:
            infos = wait_ready(
                [a.describe.remote() for a in actors], "engine host", ready_timeout_s, len(plans)
            )
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        contexts = [i["max_context"] for i in infos if i["max_context"]]
        info = {
            "model_name": infos[0]["model_name"],
            "version": infos[0]["version"],
            "max_context": min(contexts) if contexts else None,
            "nodes": sorted({i["node_id"] for i in infos}),
            "cpus": [i.get("cpus") for i in infos],  # each replica's cores
            "lanes": [i.get("lane", "engine") for i in infos],  # each replica's spans lane
            "idle_priority": [bool(i.get("idle_priority")) for i in infos],
            "names": names,
        }
        return cls(actors, info, owner=True)

    @classmethod
    def find(cls, info: dict[str, Any]) -> RayEngine:
        """A client (not the owner) of the running engine actors that ``info`` names."""
        return cls([ray.get_actor(name) for name in info["names"]], info, owner=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_owner=False, _inflight=[0] * len(self._actors), _routes=OrderedDict())
        return state

    @property
    def version(self) -> int:
        return self._version

    @property
    def replicas(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The engine actor handles (for inspection)."""
        return list(self._actors)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        i = self._replica_for(route_key)
        self._inflight[i] += 1
        try:
            result: GenerateResult = await _engine_call(
                self._actors[i].generate.remote(list(prompt_ids), params, route_key), i
            )
        finally:
            self._inflight[i] -= 1
        return result

    def _replica_for(self, route_key: str | None) -> int:
        least = min(range(len(self._actors)), key=self._inflight.__getitem__)
        if route_key is None or len(self._actors) == 1:
            return least
        i = self._routes.setdefault(route_key, least)
        self._routes.move_to_end(route_key)
        while len(self._routes) > _MAX_ROUTES:
            self._routes.popitem(last=False)
        return i

    async def update_weights(self, update: WeightUpdate) -> int:
        ref = ray.put(update)
        versions = await self._broadcast("update_weights", ref)
        if len(set(versions)) != 1:
            raise BackendError(
                f"engine replicas disagree on the version after an update: {versions}"
            )
        self._version = int(versions[0])
        return self._version

    async def take_spans(self) -> list[dict[str, Any]]:
        """The engine actors' spans since the last call (wall-clock times, for
        :meth:`areal_agents.spans.SpanRecorder.merge`), each replica's on its factory's lane
        (``engine``, ``engine_idle``); where replicas share a lane, each one's is
        ``<lane><i>``."""
        got = await self._broadcast("take_spans")
        lanes = self.info.get("lanes") or ["engine"] * len(got)
        names = [f"{lane}{i}" if lanes.count(lane) > 1 else lane for i, lane in enumerate(lanes)]
        return [
            r if names[i] == "engine" else {**r, "lane": names[i]}
            for i, rows in enumerate(got)
            for r in rows
        ]

    async def pause(self) -> None:
        await self._broadcast("pause")

    async def resume(self) -> None:
        await self._broadcast("resume")

    async def health(self) -> dict[str, Any]:
        replicas: list[dict[str, Any]] = []
        for i, actor in enumerate(self._actors):
            try:
                replicas.append(await _engine_call(actor.health.remote(), i))
            except BackendError as exc:
                replicas.append({"status": "error", "error": str(exc)})
        bad = [r["status"] for r in replicas if r.get("status") != "ok"]
        return {
            "status": bad[0] if bad else "ok",
            "backend": "ray",
            "model": self.model_name,
            "version": self._version,
            "replicas": replicas,
        }

    async def close(self) -> None:
        """End the engine actors (only the original object owns them; copies do nothing)."""
        if not self._owner or self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*[a.close.remote() for a in self._actors]), 30)
        for actor in self._actors:
            ray.kill(actor)

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        calls = [
            _engine_call(getattr(a, method).remote(*args), i) for i, a in enumerate(self._actors)
        ]
        return list(await asyncio.gather(*calls))


async def _engine_call(ref: Any, replica: int) -> Any:
    """Await an engine actor call: the engine's own exceptions come back as they were raised,
    a dead or unreachable actor becomes a :class:`BackendError`."""
    try:
        return await ref
    except RayTaskError as exc:
        raise cause(exc) from None
    except RayActorError as exc:
        raise BackendError(f"engine replica {replica} is unavailable: {first_line(exc)}") from None


def _engine_gpus(factory: Callable[[], Engine], num_gpus: float | None) -> float:
    if num_gpus is not None:
        return num_gpus
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    if not isinstance(factory, EmbeddedSpec) or not factory.wants_gpu:
        return 0.0
    if cluster_gpus == 0 and factory.device is not None:
        raise ClusterError(
            f"the engine asks for device {factory.device!r} but the Ray cluster has no GPUs; "
            "add a GPU node (`ray start --address=HEAD:PORT` on it) or use --device cpu"
        )
    return 1.0 if cluster_gpus > 0 else 0.0


# ---------------------------------------------------------------------------- helpers
def cause(exc: RayTaskError) -> BaseException:
    """The exception a remote call raised, as it was raised (Ray wraps it)."""
    original = getattr(exc, "cause", None)
    return original if isinstance(original, Exception) else exc


def first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else "unknown error"
    return text.splitlines()[0] if text else type(exc).__name__


def alive_nodes() -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def check_room(what: str, count: int, each: dict[str, float], knob: str) -> None:
    """Refuse at once when the whole cluster could never hold ``count`` actors."""
    total = ray.cluster_resources()
    for resource, amount in each.items():
        need, have = count * amount, total.get(resource, 0.0)
        if amount and need > have + 1e-9:
            raise ClusterError(
                f"{count} {what}(s) need {need:g} {resource} but the Ray cluster has {have:g}; "
                f"lower {knob} or add nodes (`ray start --address=HEAD:PORT` on each)"
            )


def wait_ready(refs: list[Any], what: str, timeout_s: float, count: int) -> list[Any]:
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except GetTimeoutError:
        free = ray.available_resources()
        raise ClusterError(
            f"the {count} {what}(s) did not start within {timeout_s:g} s (free resources now: "
            f"{ {k: v for k, v in free.items() if k in ('CPU', 'GPU')} }); the cluster may "
            "be busy or too small"
        ) from None
    except RayTaskError as exc:
        raise ClusterError(f"{_article(what)} {what} failed to start: {cause(exc)!r}") from None
    except RayActorError as exc:
        raise ClusterError(
            f"{_article(what)} {what} failed to start: {_actor_error_summary(exc)}"
        ) from None


def _article(word: str) -> str:
    return "An" if word[:1] in "aeiou" else "A"


def _actor_error_summary(exc: RayActorError) -> str:
    """The constructor's exception (the traceback's last line) when the constructor raised,
    else the error's first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1] if getattr(exc, "_actor_init_failed", False) else lines[0]
