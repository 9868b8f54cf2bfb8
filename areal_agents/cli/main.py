"""The ``areal-agent`` command line.

    areal-agent serve [--model M] [--port P] [--smoke]   the recording proxy + embedded engine
    ... [--backend vllm|sglang [--engine-url URL ...]]    a vLLM / SGLang server (started or given)
    areal-agent eval --env ID [--episodes N --k K ...]    evaluate an agent, write a report
    ... [--ray [--ray-address HOST:PORT]]                 engines and rollouts on a Ray cluster
    areal-agent train [--config FILE] [a.b=c ...]         asynchronous RL
    areal-agent demos --env ID --n N --out FILE [--agent F] demonstrations for a warm start
    areal-agent envs                                      registered environments
    areal-agent mcp-serve --env ID [--transport stdio|http] serve an env's tools over MCP
    areal-agent worker --connect URL --agent MOD:FACTORY  run an agent for a trainer's tasks

Heavy imports (torch, transformers, envs) happen inside the commands, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_agents.cli.backend import add_backend_args
from areal_agents.errors import ArealError, ConfigError

_ADAPTER_HELP = (
    "a LoRA adapter directory to apply on top of --model (e.g. a training checkpoint's "
    "model/ directory)"
)


_STORE_HELP = (
    "record every session, completion, reward and end in this store: a file path (SQLite) "
    "or a postgresql:// URL; `serve` restarted on the same store restores its open "
    "sessions (default: none, sessions live in memory)"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal-agent",
        description="Agent-environment gym and asynchronous RL for tool-using LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model behind the recording OpenAI proxy")
    serve.add_argument(
        "--model",
        default=None,
        help="HF model directory or hub id (default: SmolLM2-135M-Instruct, offline)",
    )
    serve.add_argument("--adapter", default=None, help=_ADAPTER_HELP)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--admin-key",
        default=os.environ.get("AREAL_ADMIN_KEY"),
        help="require this key for POST /sessions and allow it everywhere "
        "(default: $AREAL_ADMIN_KEY; none)",
    )
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    serve.add_argument("--max-batch-size", type=int, default=64)
    serve.add_argument("--store", default=None, help=_STORE_HELP)
    serve.add_argument(
        "--session-idle-s",
        type=float,
        default=None,
        help="end sessions idle this long as 'expired' (kept in the store; default: never)",
    )
    serve.add_argument(
        "--smoke",
        action="store_true",
        help="start, answer one chat completion through the openai client, print "
        "the recorded trajectory, and exit",
    )
    _add_ray_args(serve, workers=False)
    add_backend_args(serve)
    serve.set_defaults(func=_serve)

    ev = sub.add_parser("eval", help="evaluate an agent on an environment")
    ev.add_argument("--env", required=True, help="environment id, e.g. areal/Calculator-v0")
    ev.add_argument("--env-kwargs", default="{}", help="JSON object of env constructor kwargs")
    _agent_args(
        ev,
        "pkg.module:factory or path/to/file.py:factory returning an agent: an OpenAI "
        "Agents SDK Agent, an (async) callable taking an AgentTask, or an object with async "
        "run(task) (default: the built-in env-driven tool-calling loop)",
    )
    ev.add_argument(
        "--model", default=None, help="HF directory or hub id (default model if omitted)"
    )
    ev.add_argument("--adapter", default=None, help=_ADAPTER_HELP)
    ev.add_argument("--episodes", type=int, default=16, help="total episodes (tasks x k)")
    ev.add_argument("--k", type=int, default=1, help="samples per task, for pass@k and pass^k")
    ev.add_argument("--concurrency", type=int, default=64)
    ev.add_argument("--seed", type=int, default=0, help="task t uses seed SEED + t")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    ev.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all")
    ev.add_argument("--max-tokens", type=int, default=256)
    ev.add_argument("--max-turns", type=int, default=8)
    ev.add_argument("--timeout", type=float, default=600.0, help="per-episode time limit (s)")
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ev.add_argument("--device", default=None)
    ev.add_argument(
        "--out",
        default=None,
        help="write episodes.jsonl, report.json and the episode store episodes.db here "
        "(replacing them; with --store, or --ray, the episodes are recorded there instead)",
    )
    ev.add_argument("--store", default=None, help=_STORE_HELP)
    ev.add_argument(
        "--user-model",
        default=None,
        metavar="URL",
        help="envs with a simulated user (tau2): an OpenAI-compatible base URL whose model "
        "plays the user (default: the served model, through a path that is not recorded)",
    )
    _add_ray_args(ev, workers=True)
    add_backend_args(ev)
    ev.set_defaults(func=_eval, max_batch_size=64, admin_key=None)

    tr = sub.add_parser("train", help="asynchronous RL on an environment")
    tr.add_argument("--config", default=None, help="YAML file (optional)")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8")
    tr.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    tr.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="trainer ranks (FSDP2 on torch.distributed); the same as train.nproc=N",
    )
    tr.set_defaults(func=_train)

    dm = sub.add_parser("demos", help="write demonstrations of an env for a warm start (sft)")
    dm.add_argument("--env", required=True, help="an env whose class offers demos()")
    dm.add_argument("--n", type=int, default=160)
    dm.add_argument("--seed", type=int, default=0)
    dm.add_argument("--kind", default=None, help="env-specific (calculator: arithmetic|word|mixed)")
    dm.add_argument("--out", required=True, help="JSONL file to write")
    dm.add_argument("--env-kwargs", default="{}", help="JSON object of env constructor kwargs")
    _agent_args(
        dm,
        "render the demonstrations the way this agent's prompts look (its messages "
        "before the task, e.g. an Agents SDK agent's instructions, and its tool list, found by "
        "running it once): pkg.module:factory or path/to/file.py:factory",
    )
    dm.add_argument(
        "--model", default=None, help="the model whose chat template renders the agent's tools"
    )
    dm.set_defaults(func=_demos)

    envs = sub.add_parser("envs", help="list the registered environments")
    envs.set_defaults(func=_envs)

    mc = sub.add_parser(
        "mcp-serve",
        help="serve an env's tools as an MCP server (one env, one episode at a time; "
        "reset_task and submit_answer tools run the episode)",
    )
    mc.add_argument("--env", required=True, help="the env whose tools are served")
    mc.add_argument("--env-kwargs", default="{}", help="JSON object of env constructor kwargs")
    mc.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    mc.add_argument("--host", default="127.0.0.1", help="bind address (http)")
    mc.add_argument("--port", type=int, default=8000, help="port (http; the path is /mcp)")
    mc.add_argument("--seed", type=int, default=0, help="seed of the first episode's task")
    mc.set_defaults(func=_mcp_serve)

    wk = sub.add_parser(
        "worker",
        help="run an agent in this process on the tasks a trainer hands out (needs only "
        "httpx and openai)",
    )
    wk.add_argument(
        "--connect", required=True, metavar="URL", help="the trainer's proxy URL, http://HOST:PORT"
    )
    wk.add_argument(
        "--token", default=None, help="the trainer's worker token (default: $AREAL_WORKER_TOKEN)"
    )
    _agent_args(
        wk,
        "pkg.module:factory or path/to/file.py:factory returning the agent: an OpenAI "
        "Agents SDK Agent, an (async) callable taking a task, or an object with async run(task)",
        required=True,
    )
    wk.add_argument("--concurrency", type=int, default=1, help="tasks run at once")
    wk.add_argument(
        "--max-tasks", type=int, default=None, help="exit after this many tasks (default: never)"
    )
    wk.add_argument("--wait", type=float, default=20.0, help="long-poll wait per request (s)")
    wk.set_defaults(func=_worker)

    vw = sub.add_parser(
        "view", help="browse runs, episodes and tokens in the browser (a local web server)"
    )
    vw.add_argument(
        "sources",
        nargs="*",
        help="run directories, eval outputs, a directory of runs, or episode stores "
        "(a .db file or a postgresql:// URL); default: runs/",
    )
    vw.add_argument(
        "--host", default="127.0.0.1", help="bind address (anything but loopback needs a token)"
    )
    vw.add_argument("--port", type=int, default=8765)
    vw.add_argument(
        "--token",
        default=os.environ.get("AREAL_VIEW_TOKEN"),
        help="required on every request (default: $AREAL_VIEW_TOKEN; generated when --host "
        "is not loopback)",
    )
    vw.add_argument(
        "--import",
        dest="import_dir",
        metavar="RUN_DIR",
        default=None,
        help="build RUN_DIR/episodes.db from RUN_DIR/episodes.jsonl (older runs), then exit",
    )
    vw.add_argument(
        "--no-browser",
        action="store_true",
        help="do not open the page in a browser (opened when there is a display)",
    )
    vw.set_defaults(func=_view)
    return parser


def _add_ray_args(parser: argparse.ArgumentParser, *, workers: bool) -> None:
    where = "the engine and the rollout workers" if workers else "the engine"
    parser.add_argument(
        "--ray",
        action="store_true",
        help=f"run {where} as Ray actors on a Ray cluster (pip install 'areal-agents[ray]')",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="the cluster to join (implies --ray): HOST:PORT or auto (default: $RAY_ADDRESS, "
        "else a cluster started with `ray start` on this machine, else a new local one)",
    )
    parser.add_argument("--ray-engines", type=int, default=1, help="engine replicas (Ray)")
    if workers:
        parser.add_argument(
            "--ray-workers",
            type=int,
            default=None,
            help="rollout worker actors (Ray; default: one per node, at least 2)",
        )


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
    from areal_agents.rollout import cluster  # noqa: F401  (raises RayNotInstalled with the pip command)

    return True


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first flag: `train --config F a=1 --quiet b=2`
    # leaves b=2 over. Overrides on either side of a flag are all overrides.
    takes = getattr(args, "overrides", None) is not None
    if extra and takes and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides, extra = [*args.overrides, *extra], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except ArealError as exc:
        print(f"areal-agent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _load_proxy(args: argparse.Namespace) -> Any:
    from areal_agents.model import resolve_model
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy

    if args.backend != "embedded":  # a vLLM / SGLang server (see areal_agents.cli.backend)
        from areal_agents.cli.backend import load_server_engine

        engine, tokenizer = load_server_engine(args)
        return Proxy(engine, tokenizer, admin_key=args.admin_key, **_store_args(args))
    if args.engine_url:
        raise ConfigError("--engine-url needs --backend vllm or --backend sglang")
    path = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_dir(path)
    if _uses_ray(args):
        engine = _ray_engine(args, path)
    else:
        from areal_agents.engines.embedded import EmbeddedEngine

        print(f"loading {path} ...", file=sys.stderr)
        engine = EmbeddedEngine.from_pretrained(
            path,
            dtype=args.dtype,
            device=args.device,
            adapter=args.adapter,
            max_batch_size=args.max_batch_size,
        )
        engine._decode = tokenizer.decode
    return Proxy(engine, tokenizer, admin_key=args.admin_key, **_store_args(args))


def _store_args(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's ``store`` (``--store``) and ``session_idle_s`` (``--session-idle-s``)."""
    out: dict[str, Any] = {}
    idle = getattr(args, "session_idle_s", None)
    if idle is not None:
        if not idle > 0:
            raise ConfigError(f"--session-idle-s must be > 0, got {idle}")
        out["session_idle_s"] = idle
    if getattr(args, "store", None):
        from areal_agents.serve.store import EpisodeStore

        out["store"] = EpisodeStore(args.store)
        print(f"recording into {out['store'].url.split('@')[-1]}", file=sys.stderr)
    return out


def _ray_engine(args: argparse.Namespace, path: str) -> Any:
    """Engine actors on the Ray cluster, each loading the model on its own node."""
    from areal_agents.rollout.cluster import EmbeddedSpec, RayEngine

    spec = EmbeddedSpec(
        model=None if args.model is None else path,
        dtype=args.dtype,
        device=args.device,
        adapter=args.adapter,
        max_batch_size=args.max_batch_size,
    )
    print(f"starting {args.ray_engines} engine actor(s) for {path} on Ray ...", file=sys.stderr)
    return RayEngine.start(spec, replicas=args.ray_engines)


def _serve(args: argparse.Namespace) -> int:
    with _ray_session(args):
        proxy = _load_proxy(args)
        if args.smoke:
            return _smoke(proxy, args.host)
        from areal_agents.serve.server import serve_forever

        print(
            f"areal-agent proxy on http://{args.host}:{args.port}/v1  "
            f"(POST /sessions for a session key)",
            file=sys.stderr,
        )
        serve_forever(proxy, args.host, args.port)
    return 0


def _smoke(proxy: Any, host: str) -> int:
    """One recorded chat completion end to end, through the real HTTP stack."""
    import httpx
    from openai import OpenAI

    from areal_agents.serve.server import ProxyServer

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


def _eval(args: argparse.Namespace) -> int:
    import functools

    from tqdm import tqdm

    from areal_agents.envs.registry import make, probe
    from areal_agents.rollout.evaluate import evaluate, write_outputs

    use_ray = _uses_ray(args)
    env_kwargs = _json_object(args.env_kwargs, "--env-kwargs")
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
    try:  # unknown ids and bad kwargs fail before the model loads
        make(args.env, **env_kwargs).close()
    except TypeError as exc:
        raise ConfigError(f"--env-kwargs: {args.env} does not take them: {exc}") from None
    agent = _load_agent(args.agent, args.agent_kwargs, args.max_turns) if args.agent else None
    if not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("--top-p must be in (0, 1] and --top-k >= 0 (0 keeps every token)")
    sampling: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.top_p < 1:
        sampling["top_p"] = args.top_p
    if args.top_k:
        sampling["top_k"] = args.top_k
    db = _eval_store(args, use_ray)
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


def _eval_store(args: argparse.Namespace, use_ray: bool) -> Path | None:
    """With ``--out DIR`` and neither ``--store`` nor ``--ray``: the eval's proxy records
    into a fresh ``DIR/episodes.db`` (an earlier one is replaced, as the other outputs
    are); its path, else None."""
    if not args.out or args.store or use_ray:
        return None
    db = Path(args.out).expanduser() / "episodes.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    for part in (db, db.with_name("episodes.db-wal"), db.with_name("episodes.db-shm")):
        part.unlink(missing_ok=True)
    args.store = str(db)
    return db


def _takes_user(env_id: str) -> bool:
    """Whether ``env_id``'s constructor takes ``user_base_url`` (a simulated user, tau2)."""
    import inspect

    import gymnasium

    from areal_agents.envs.registry import make

    try:
        entry = gymnasium.spec(env_id).entry_point
    except gymnasium.error.Error:
        make(env_id)  # raises EnvNotFound with the nearest ids
        return False
    if isinstance(entry, str):
        import importlib

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
    import httpx

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
    import secrets

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
    whose workers each hold their own proxy."""
    settings = {
        "concurrency": args.concurrency,
        "max_turns": args.max_turns,
        "episode_timeout_s": args.timeout,
        "sampling": sampling,
    }
    if _uses_ray(args):
        from areal_agents.model import resolve_model
        from areal_agents.rollout.ray_runner import RayRunner

        if args.store:
            raise ConfigError(
                "--store: with --ray every worker holds a proxy of its own; drop one of them"
            )
        path = resolve_model(args.model)
        engine = _ray_engine(args, path)
        runner = RayRunner(engine, path, workers=args.ray_workers, **settings)

        async def close() -> None:
            await runner.close()
            await engine.close()

        yield runner, close
        return
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.server import ProxyServer

    proxy = _load_proxy(args)

    async def close_local() -> None:
        await proxy.engine.close()
        if proxy.store is not None:
            proxy.store.close()

    with ProxyServer.start(proxy) as server:
        yield Runner(proxy, base_url=server.base_url, **settings), close_local


@contextlib.contextmanager
def _ray_session(args: argparse.Namespace) -> Iterator[None]:
    """Joined to the Ray cluster for the command (when it uses Ray); leaves it afterwards."""
    if not _uses_ray(args):
        yield
        return
    from areal_agents.rollout.cluster import attached

    with attached(args.ray_address):
        yield


def _agent_args(parser: argparse.ArgumentParser, what: str, *, required: bool = False) -> None:
    """``--agent`` (``what`` is its help) and ``--agent-kwargs``."""
    parser.add_argument("--agent", default=None, required=required, help=what)
    parser.add_argument(
        "--agent-kwargs", default="{}", help="JSON object of keyword arguments of the factory"
    )


def _load_agent(spec: str, kwargs_json: str = "{}", max_turns: int | None = None) -> Any:
    """``--agent`` (and ``--agent-kwargs``) as the runner's agent (see ``task_agent``)."""
    from areal_agents.rollout.task_agent import load_agent

    return load_agent(spec, _json_object(kwargs_json, "--agent-kwargs"), max_turns=max_turns)


def _train(args: argparse.Namespace) -> int:
    from areal_agents.trainer.config import format_config, load_config

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"train.nproc={args.nproc}")
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        print(format_config(cfg))
        from areal_agents.trainer.memory import estimate_for_config

        print(f"# estimated training memory per rank:\n{estimate_for_config(cfg).format()}")
        return 0
    from areal_agents.trainer.loop import train

    print(view_hint(cfg.train.output_dir), flush=True)
    summary = train(cfg, resume=args.resume, quiet=args.quiet)
    keys = ("reward_mean", "success_rate", "staleness_mean", "train_tokens_per_s")
    print(" ".join(f"{k}={summary[k]:.3g}" for k in keys if k in summary))
    if summary.get("held_out"):
        print(summary["held_out"])
    print(f"final model: {summary.get('final_model')}")
    print(f"run directory: {cfg.train.output_dir} ({view_hint(cfg.train.output_dir)})")
    return 0


def _demos(args: argparse.Namespace) -> int:
    """The env's demonstrations as JSONL rows ``{"messages": [...]}``; with ``--agent``, the
    agent's leading messages are put before each and the row carries the agent's tool list
    (``"tools"``), which a warm start renders them with."""
    from areal_agents.envs.registry import make

    env_kwargs = _json_object(args.env_kwargs, "--env-kwargs")
    env = make(args.env, **env_kwargs)
    maker = getattr(env.unwrapped, "demos", None)
    env.close()
    if maker is None:
        raise ConfigError(
            f"{args.env} offers no demos(); write the JSONL yourself "
            "(one list of chat messages per line)"
        )
    kwargs = {"kind": args.kind} if args.kind else {}
    rows = maker(args.n, seed=args.seed, **kwargs)
    prefix: list[dict[str, Any]] = []
    tools = None
    if args.agent:
        from areal_agents.model import resolve_model
        from areal_agents.rollout.task_agent import observe_prompt
        from areal_agents.serve.chat import ChatTokenizer

        agent = _load_agent(args.agent, args.agent_kwargs)
        tokenizer = ChatTokenizer.from_dir(resolve_model(args.model))
        prefix, tools = asyncio.run(
            observe_prompt(agent, lambda: make(args.env, **env_kwargs), tokenizer, seed=args.seed)
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for messages in rows:
            row: dict[str, Any] = {"messages": [*prefix, *messages]}
            if tools is not None:
                row["tools"] = tools
            f.write(json.dumps(row) + "\n")
    how = f" as agent {args.agent} prompts ({len(tools or [])} tools)" if args.agent else ""
    print(f"wrote {len(rows)} demonstrations{how} to {args.out}")
    return 0


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _worker(args: argparse.Namespace) -> int:
    import logging

    from areal_agents.client import AgentWorker

    token = args.token or os.environ.get("AREAL_WORKER_TOKEN")
    if not token:
        raise ConfigError(
            "areal-agent worker needs the trainer's worker token: --token T or $AREAL_WORKER_TOKEN"
        )
    if args.concurrency < 1 or (args.max_tasks is not None and args.max_tasks < 1):
        raise ConfigError("--concurrency and --max-tasks must be >= 1")
    if os.getcwd() not in sys.path:  # the agent's module may sit where the worker starts
        sys.path.insert(0, os.getcwd())
    agent = _load_agent(args.agent, args.agent_kwargs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for quiet in ("httpx", "httpx2"):  # not a line per heartbeat and model call
        logging.getLogger(quiet).setLevel(logging.WARNING)
    worker = AgentWorker(args.connect, token, concurrency=args.concurrency, wait_s=args.wait)
    print(f"areal-agent worker {worker.worker_id}: tasks from {worker.url}", file=sys.stderr)
    done = worker.serve_sync(agent, max_tasks=args.max_tasks)
    print(f"areal-agent worker {worker.worker_id}: {done} result(s) posted", file=sys.stderr)
    return 0


def _view(args: argparse.Namespace) -> int:
    import secrets

    import uvicorn

    from areal_agents.view import RunSet, create_app, import_run

    if args.import_dir:
        counts = import_run(args.import_dir)
        print(
            f"imported {counts['imported']} episodes into {Path(args.import_dir) / 'episodes.db'}"
            f" ({counts['skipped']} already there, {counts['bad_lines']} unreadable lines)"
        )
        if not args.sources:
            return 0
    sources = args.sources or (["runs"] if Path("runs").is_dir() else [])
    if not sources:
        raise ConfigError(
            "areal-agent view: name a run directory (e.g. runs/quickstart), a directory of "
            "runs or an episode store; there is no runs/ here"
        )
    runs = RunSet(sources)
    token = args.token
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not token:
        token = secrets.token_urlsafe(18)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown_host}:{args.port}/" + (f"?token={token}" if token else "")
    app = create_app(runs, token=token)
    names = ", ".join(r.name for r in runs.runs()) or "none yet"
    print(f"view: {url}", flush=True)
    print(f"runs: {names}", flush=True)
    if not args.no_browser and (os.environ.get("DISPLAY") or sys.platform == "darwin"):
        import webbrowser

        webbrowser.open(url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def view_hint(run_dir: str | os.PathLike[str]) -> str:
    """The command that shows ``run_dir`` in the browser (train and eval print it)."""
    return f"see it in the browser: areal-agent view {run_dir}"


def _envs(args: argparse.Namespace) -> int:
    from areal_agents.envs.registry import list_envs

    rows = list_envs()
    width = max((len(i) for i, _ in rows), default=10)
    for env_id, description in rows:
        print(f"{env_id:<{width}}  {description}")
    return 0


def _mcp_serve(args: argparse.Namespace) -> int:
    from areal_agents.envs.mcp import serve

    serve(
        args.env,
        _json_object(args.env_kwargs, "--env-kwargs"),
        transport=args.transport,
        host=args.host,
        port=args.port,
        seed=args.seed,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
