"""Building a run's rollout side from its config: the engine and the group source.

:func:`build_rollout` checks the env (and the agent factory) first, then builds the engine
(:mod:`areal_agents.trainer.engine_build`: embedded in this process, inference servers, or
Ray actors with ``scheduler: ray``), the recording proxy, the episode
store, the judge and the HTTP server where agents need one, and picks the source
(:mod:`areal_agents.trainer.rollout`, :mod:`areal_agents.trainer.session_source`).
``workers.json`` in the run directory keeps the worker API's port and token across resumes.

An env with a simulated user (tau², whose constructor takes ``user_simulator``) that
``env.kwargs`` gives none (no ``user_base_url``) gets the run's own model as the customer:
a :class:`~areal_agents.envs.tau2.user.ProxyUserSimulator` over the run's proxy, whose calls
are answered by the engine and recorded in no session, so they are never trained, never
part of an agent's episode and never counted as episodes. ``env.kwargs.user_max_tokens``
caps its messages (default ``sampling.max_new_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from areal_agents.engines.launch import free_port
from areal_agents.envs.registry import make, probe
from areal_agents.envs.tau2.user import ProxyUserSimulator, ScriptedUserSimulator
from areal_agents.errors import ConfigError
from areal_agents.hardware import default_device, resolve_dtype
from areal_agents.rollout.runner import Runner
from areal_agents.rollout.task_agent import load_agent
from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import LoopServer
from areal_agents.serve.store import EpisodeStore
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.engine_build import build_engine
from areal_agents.trainer.judge import make_judge
from areal_agents.trainer.rollout import (
    AgentSource,
    EnvSource,
    ExternalSource,
    GroupSource,
    RaySource,
    SourceSettings,
)
from areal_agents.trainer.session_source import SessionSource


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
    makes one env and resets it with the first group's seed first
    (``areal_agents.envs.registry.probe``), so that a bad factory or env config fails here,
    with its message, before any episode."""
    settings = SourceSettings.from_config(cfg, dynamic_sampling)
    env_id, kwargs = cfg.env.id, dict(cfg.env.kwargs)
    what = f"env {env_id} (env.kwargs)"

    def make_env() -> Any:
        assert env_id is not None
        return make(env_id, **kwargs)

    customer: dict[str, Any] | None = None  # the run's own model plays the env's user
    if env_id is not None:  # None: a self-rewarded run (checked by the config)
        try:
            first = make_env()
        except TypeError as exc:
            raise ConfigError(f"{what}: the env does not take them: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        params = inspect.signature(type(first.unwrapped).__init__).parameters
        if "split" in params:
            kwargs.setdefault("split", cfg.env.split)
        first.close()
        if "user_simulator" in params and not _has_user(kwargs):
            customer = _own_model_customer(cfg, kwargs, what)
            # the env's settings (data, split, tasks) fail here, before the model loads; the
            # customer itself is checked once the proxy exists (_check_customer)
            stand_in = ScriptedUserSimulator(["Hello."])
            probe(
                functools.partial(make, env_id, **kwargs, user_simulator=stand_in),
                seed=settings.seed_base,
                what=what,
            )
        else:
            probe(make_env, seed=settings.seed_base, what=what)

    agent = None
    if cfg.agent.factory is not None:
        agent = load_agent(cfg.agent.factory, cfg.agent.kwargs, max_turns=cfg.rollout.max_turns)
    runner_kwargs: dict[str, Any] = {
        "concurrency": cfg.rollout.concurrency,
        "max_turns": cfg.rollout.max_turns,
        "episode_timeout_s": cfg.rollout.episode_timeout_s or 1e9,
        "sampling": _sampling(cfg),
        "sampling_by_kind": {k: dict(v) for k, v in cfg.sampling.by_kind.items()},
    }
    if cfg.ray_rollout:
        engine, runner = _ray_rollout(cfg, model_path, runner_kwargs, out)
        ray_source = RaySource(settings, state, runner, make_env, agent)
        judge = make_judge(cfg.rewards, None, out)  # over rewards.judge.base_url
        return _stored(engine, ray_source, runner.store, judge)

    engine = build_engine(
        cfg,
        model_path=model_path,
        tokenizer=tokenizer,
        compute_lock=compute_lock,
        out=out,
        quiet=quiet,
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
        context_policy=cfg.context,  # context.*: conversations that outgrow the context
    )
    judge = make_judge(cfg.rewards, proxy, out)
    if customer is not None:
        _check_customer(proxy, customer, kwargs, make_env, settings.seed_base, what)
    if agent is None and cfg.rollout.agents == "local":
        runner = Runner(proxy, **runner_kwargs)
        return _stored(engine, EnvSource(settings, state, runner, make_env), store, judge)
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


def _has_user(kwargs: dict[str, Any]) -> bool:
    """Whether env kwargs name who plays the simulated user."""
    return kwargs.get("user_base_url") is not None or kwargs.get("user_simulator") is not None


def _own_model_customer(cfg: TrainConfig, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    """The settings of the run's own model as the env's simulated user (taken out of
    ``kwargs``); a ConfigError where it cannot play it."""
    if cfg.ray_rollout:
        raise ConfigError(
            f"{what}: with scheduler: ray the episodes run on Ray actors, where the run's own "
            "model cannot play the simulated customer; set env.kwargs.user_base_url to an "
            "OpenAI-compatible endpoint that plays it (e.g. one started with areal-agent "
            "serve), or use scheduler: local"
        )
    cap = kwargs.pop("user_max_tokens", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"{what}: user_max_tokens must be an int >= 1, got {cap!r}")
    return {"max_tokens": cap if cap is not None else cfg.sampling.max_new_tokens}


def _check_customer(
    proxy: Proxy,
    customer: dict[str, Any],
    kwargs: dict[str, Any],
    make_env: Any,
    seed: int,
    what: str,
) -> None:
    """Put the run's own model in the customer's place (``kwargs["user_simulator"]``) and
    reset one env with it, so that a customer that cannot answer (an empty message) fails
    here. Then bind the customer to this event loop (the one the run's proxy serves on),
    where its calls from the env's worker threads then run."""
    user = ProxyUserSimulator(proxy, **customer)
    kwargs["user_simulator"] = user
    try:
        probe(make_env, seed=seed, what=f"{what}, the run's own model as the customer")
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}\nThe run's own model plays the customer when env.kwargs names none; set "
            "env.kwargs.user_base_url to an OpenAI-compatible endpoint whose model can play "
            "it (and user_model, user_max_tokens as needed)"
        ) from None
    with contextlib.suppress(RuntimeError):  # no loop yet: the calls run where they are made
        user.loop = asyncio.get_running_loop()


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


def _ray_rollout(
    cfg: TrainConfig, model_path: str, runner_kwargs: dict[str, Any], out: Path
) -> Any:
    """``scheduler: ray``: the engine and the episodes run as Ray actors
    (:mod:`areal_agents.rollout.cluster`, :mod:`areal_agents.rollout.ray_runner`) while the
    policy trains in this process; new weights reach the engine actors through the object
    store.

    Joins ``$RAY_ADDRESS`` or a cluster started with ``ray start`` on this machine, else starts
    a local one (Ray shuts that down when the process exits). One engine actor (a GPU when the
    cluster has one; on the cores ``rollout.engine_cpus`` names); rollout workers: one per
    node, at least 2, their proxies recording into ``RUN_DIR/episodes.db`` through a
    store-writer actor (:mod:`areal_agents.rollout.ray_store`).
    """
    from areal_agents.rollout.cluster import EmbeddedSpec, RayEngine, connect  # noqa: PLC0415  it imports ray, an optional extra
    from areal_agents.rollout.ray_runner import RayRunner  # noqa: PLC0415  it imports ray, an optional extra
    from areal_agents.rollout.ray_store import RayStore  # noqa: PLC0415  it imports ray, an optional extra

    connect()
    store = RayStore.start(out / "episodes.db")  # every episode of the run, for inspection
    store.close_open("lost_at_restart")  # a resumed run redoes the groups it had in flight
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
    return engine, RayRunner(engine, model_path, store=store, **runner_kwargs)
