"""``areal-agent serve`` and ``areal-agent eval``: a model behind the recording proxy.

``serve`` runs the proxy over an engine (embedded, Ray engine actors with ``--ray``, or a
vLLM / SGLang server, :mod:`areal_agents.cli.backend`) until stopped; ``--smoke`` answers one
chat completion end to end and exits. ``eval`` runs an agent on an env's tasks through the
same proxy (or a :class:`~areal_agents.rollout.ray_runner.RayRunner` with ``--ray``), prints
the report and writes it with the episodes. torch loads only when the embedded engine is
built, and Ray only with ``--ray``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import httpx
from openai import OpenAI
from tqdm import tqdm

from areal_agents.cli.backend import eval_split, load_server_engine
from areal_agents.cli.common import json_object, load_agent_arg
from areal_agents.envs.registry import make, probe
from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.rollout.evaluate import evaluate, write_outputs
from areal_agents.rollout.runner import Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer, serve_forever
from areal_agents.serve.store import EpisodeStore

__all__ = ["eval_command", "serve_command"]


def serve_command(args: argparse.Namespace) -> int:
    """Serve the model behind the recording proxy until stopped (``--smoke``: one call)."""
    with _ray_session(args):
        proxy = _load_proxy(args)
        if args.smoke:
            return _smoke(proxy, args.host)
        print(
            f"areal-agent proxy on http://{args.host}:{args.port}/v1  "
            f"(POST /sessions for a session key)",
            file=sys.stderr,
        )
        serve_forever(proxy, args.host, args.port)
    return 0


def _smoke(proxy: Any, host: str) -> int:
    """One recorded chat completion end to end, through the real HTTP stack."""
    with ProxyServer.start(proxy, host=host) as server:
        headers = {"Authorization": f"Bearer {proxy.admin_key}"} if proxy.admin_key else {}
        made = httpx.post(f"{server.url}/sessions", json={}, headers=headers).json()
        client = OpenAI(base_url=made["base_url"], api_key=made["api_key"])
        reply = client.chat.completions.create(
            model=proxy.model_name,
            max_tokens=48,
            temperature=0,
            seed=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        text = reply.choices[0].message.content or ""
        traj = httpx.get(
            f"{server.url}/sessions/{made['id']}/trajectory",
            headers={"Authorization": f"Bearer {made['api_key']}"},
        ).json()
    comp = traj["completions"][0]
    decoded = proxy.tokenizer.decode(
        comp["output_ids"][:-1] if comp["finish_reason"] == "stop" else comp["output_ids"]
    )
    print(f"assistant: {text}")
    print(
        json.dumps(
            {
                "session": traj["session_id"],
                "prompt_tokens": len(comp["prompt_ids"]),
                "output_ids": comp["output_ids"],
                "output_logprobs": [round(x, 4) for x in comp["output_logprobs"]],
                "output_versions": comp["output_versions"],
                "finish_reason": comp["finish_reason"],
                "decodes_to_reply": decoded == text,
                "samples": len(traj["samples"]),
            },
            indent=1,
        )
    )
    asyncio.run(proxy.engine.close())
    return 0 if decoded == text else 1


def _load_proxy(args: argparse.Namespace) -> Any:
    settings = _proxy_args(args)  # checked before a model loads
    if args.backend != "embedded":  # a vLLM / SGLang server (see areal_agents.cli.backend)
        engine, tokenizer = load_server_engine(args)
        return Proxy(engine, tokenizer, **settings, **_store_args(args))
    if args.engine_url:
        raise ConfigError("--engine-url needs --backend vllm or --backend sglang")
    path = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_dir(path)
    if _uses_ray(args):
        engine = _ray_engine(args, path)
    else:
        from areal_agents.engines.embedded import EmbeddedEngine  # noqa: PLC0415  loads torch here

        print(f"loading {path} ...", file=sys.stderr)
        engine = EmbeddedEngine.from_pretrained(
            path,
            dtype=args.dtype,
            device=args.device,
            adapter=args.adapter,
            max_batch_size=args.max_batch_size,
        )
        engine._decode = tokenizer.decode
    return Proxy(engine, tokenizer, **settings, **_store_args(args))


def _proxy_args(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's ``admin_key`` (``--admin-key``) and ``self_rewarding``
    (``--no-self-rewarding``: rewards, ends and deletes take the admin key only, so an agent
    cannot score itself); the latter needs an admin key, else no one could post a reward."""
    self_rewarding = getattr(args, "self_rewarding", True)
    if not self_rewarding and not args.admin_key:
        raise ConfigError(
            "--no-self-rewarding: rewards, ends and deletes then need the admin key, and "
            "none is set; give --admin-key KEY (or set $AREAL_ADMIN_KEY), or drop "
            "--no-self-rewarding"
        )
    return {"admin_key": args.admin_key, "self_rewarding": self_rewarding}


def _store_args(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's ``store`` (``--store``) and ``session_idle_s`` (``--session-idle-s``)."""
    out: dict[str, Any] = {}
    idle = getattr(args, "session_idle_s", None)
    if idle is not None:
        if not idle > 0:
            raise ConfigError(f"--session-idle-s must be > 0, got {idle}")
        out["session_idle_s"] = idle
    if getattr(args, "store", None):
        out["store"] = EpisodeStore(args.store)
        print(f"recording into {out['store'].url.split('@')[-1]}", file=sys.stderr)
    return out


def eval_command(args: argparse.Namespace) -> int:
    """Evaluate the agent on ``--env``, print the report and write it to ``--out``."""
    use_ray = _uses_ray(args)
    env_kwargs = json_object(args.env_kwargs, "--env-kwargs")
    simulated_user = _takes_user(args.env) and not _has_user(env_kwargs)
    if args.user_model:
        if not _takes_user(args.env):
            raise ConfigError(f"--user-model: {args.env} has no simulated user; drop it")
        if not simulated_user:
            raise ConfigError("--user-model and a user in --env-kwargs: give one of them")
        _check_endpoint(args.user_model, "--user-model")
        env_kwargs["user_base_url"] = args.user_model
    elif simulated_user and use_ray:
        raise ConfigError(
            f"{args.env} needs a simulated user: with --ray, give --user-model URL (an "
            "OpenAI-compatible endpoint)"
        )
    # unknown ids and bad kwargs fail before the model loads; the test split by default
    env_kwargs = eval_split(args.env, env_kwargs)
    agent = load_agent_arg(args.agent, args.agent_kwargs, args.max_turns) if args.agent else None
    if not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("--top-p must be in (0, 1] and --top-k >= 0 (0 keeps every token)")
    sampling: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.top_p < 1:
        sampling["top_p"] = args.top_p
    if args.top_k:
        sampling["top_k"] = args.top_k
    db = _eval_store(args)
    with _ray_session(args), _eval_runner(args, sampling) as (runner, close):
        if simulated_user and not args.user_model:  # the served model plays the user
            env_kwargs.update(_served_user(runner.proxy, runner.base_url, args.max_tokens))
        make_env = functools.partial(make, args.env, **env_kwargs)
        try:  # a config error fails here, once, not as an env_error per episode
            probe(make_env, seed=args.seed, what=f"--env {args.env}")
        except BaseException:
            asyncio.run(close())
            raise
        bar = tqdm(
            total=args.episodes // args.k * args.k,
            desc=f"eval {args.env}",
            unit="ep",
            file=sys.stderr,
        )
        done = {"ok": 0}

        def progress(res: Any) -> None:
            done["ok"] += bool(res.success)
            bar.update()
            bar.set_postfix(success=f"{done['ok'] / bar.n:.0%}")

        async def run() -> Any:
            try:
                return await evaluate(
                    runner,
                    make_env,
                    env_id=args.env,
                    episodes=args.episodes,
                    k=args.k,
                    seed=args.seed,
                    agent=agent,
                    progress=progress,
                )
            finally:
                await close()

        report, groups = asyncio.run(run())
        bar.close()
        print(report.table())
        if use_ray:
            print("ray: " + ", ".join(f"{k} {v}" for k, v in runner.stats().items()))
    if args.out:
        out = write_outputs(args.out, report, groups)
        print(f"wrote {out / 'episodes.jsonl'} and {out / 'report.json'}")
        if db is not None:
            print(f"episodes recorded in {db}")
    return 0


def _eval_store(args: argparse.Namespace) -> Path | None:
    """With ``--out DIR`` and no ``--store``: the eval records into a fresh
    ``DIR/episodes.db`` (an earlier one is replaced, as the other outputs are), with
    ``--ray`` too; its path, else None."""
    if not args.out or args.store:
        return None
    db = Path(args.out).expanduser() / "episodes.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    for part in (db, db.with_name("episodes.db-wal"), db.with_name("episodes.db-shm")):
        part.unlink(missing_ok=True)
    args.store = str(db)
    return db


def _takes_user(env_id: str) -> bool:
    """Whether ``env_id``'s constructor takes ``user_base_url`` (a simulated user, tau2)."""
    try:
        entry = gymnasium.spec(env_id).entry_point
    except gymnasium.error.Error:
        make(env_id)  # raises EnvNotFound with the nearest ids
        return False
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    if not callable(entry):
        return False
    try:
        return "user_base_url" in inspect.signature(entry).parameters
    except (TypeError, ValueError):
        return False


def _has_user(env_kwargs: dict[str, Any]) -> bool:
    return env_kwargs.get("user_base_url") is not None or "user_simulator" in env_kwargs


def _check_endpoint(base_url: str, flag: str) -> None:
    """``GET {base_url}/models`` answers, else a ConfigError naming ``flag`` and the fix."""
    url = base_url.rstrip("/") + "/models"
    try:
        httpx.get(url, timeout=10.0).raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"{flag} {base_url}: no OpenAI-compatible endpoint answers GET {url} ({exc}); "
            f"start one there (e.g. areal-agent serve), fix the URL, or drop {flag} to let "
            "the served model play the user"
        ) from None


def _served_user(proxy: Any, base_url: str | None, max_tokens: int) -> dict[str, Any]:
    """Env kwargs that make the served model play the simulated user, through the proxy's
    admin key: its calls are answered by the same engine but recorded in no episode."""
    if base_url is None:
        raise ConfigError("the served model can play the user only behind a proxy server")
    if proxy.admin_key is None:
        proxy.admin_key = secrets.token_urlsafe(24)
    return {
        "user_base_url": base_url,
        "user_api_key": proxy.admin_key,
        "user_model": proxy.model_name,
        "user_max_tokens": max_tokens,
    }


@contextlib.contextmanager
def _eval_runner(args: argparse.Namespace, sampling: dict[str, Any]) -> Iterator[Any]:
    """(runner, async close) for ``eval``: a local Runner behind a proxy server, or a RayRunner
    whose workers each hold their own proxy, all recording into ``--store`` through one
    store-writer actor (:mod:`areal_agents.rollout.ray_store`)."""
    settings = {
        "concurrency": args.concurrency,
        "max_turns": args.max_turns,
        "episode_timeout_s": args.timeout,
        "sampling": sampling,
    }
    if _uses_ray(args):
        from areal_agents.rollout.ray_runner import RayRunner  # noqa: PLC0415  loads ray with --ray
        from areal_agents.rollout.ray_store import RayStore  # noqa: PLC0415  loads ray with --ray

        store = RayStore.start(args.store) if args.store else None  # a bad store fails first
        if store is not None:
            print(f"recording into {store.url.split('@')[-1]}", file=sys.stderr)
        path = resolve_model(args.model)
        engine = _ray_engine(args, path)
        runner = RayRunner(engine, path, workers=args.ray_workers, store=store, **settings)

        async def close() -> None:
            await runner.close()  # the workers' records reach the store first
            await engine.close()
            if store is not None:
                store.close()

        yield runner, close
        return
    proxy = _load_proxy(args)

    async def close_local() -> None:
        await proxy.engine.close()
        if proxy.store is not None:
            proxy.store.close()

    with ProxyServer.start(proxy) as server:
        yield Runner(proxy, base_url=server.base_url, **settings), close_local


def _uses_ray(args: argparse.Namespace) -> bool:
    """Whether the command runs on Ray; fails now, naming the install, when Ray is missing."""
    if not (getattr(args, "ray", False) or getattr(args, "ray_address", None)):
        return False
    if args.ray_engines < 1 or (getattr(args, "ray_workers", None) or 1) < 1:
        raise ConfigError("--ray-engines and --ray-workers must be >= 1")
    if getattr(args, "backend", "embedded") != "embedded":
        raise ConfigError(
            f"--ray runs embedded engines as Ray actors; --backend {args.backend} uses a server "
            "that is its own engine: drop --ray, or drop --backend"
        )
    # Importing the cluster module raises RayNotInstalled, naming the pip command.
    from areal_agents.rollout import cluster  # noqa: F401, PLC0415  ray loads only with --ray

    return True


def _ray_engine(args: argparse.Namespace, path: str) -> Any:
    """Engine actors on the Ray cluster, each loading the model on its own node."""
    from areal_agents.rollout.cluster import (  # noqa: PLC0415  ray loads only with --ray
        EmbeddedSpec,
        RayEngine,
    )

    spec = EmbeddedSpec(
        model=None if args.model is None else path,
        dtype=args.dtype,
        device=args.device,
        adapter=args.adapter,
        max_batch_size=args.max_batch_size,
    )
    print(f"starting {args.ray_engines} engine actor(s) for {path} on Ray ...", file=sys.stderr)
    return RayEngine.start(spec, replicas=args.ray_engines)


@contextlib.contextmanager
def _ray_session(args: argparse.Namespace) -> Iterator[None]:
    """Joined to the Ray cluster for the command (when it uses Ray); leaves it afterwards."""
    if not _uses_ray(args):
        yield
        return
    from areal_agents.rollout.cluster import attached  # noqa: PLC0415  ray loads only with --ray

    with attached(args.ray_address):
        yield
