"""The ``areal-agent`` command line: the parser and the entry point.

    areal-agent serve [--model M] [--port P] [--smoke]   the recording proxy + embedded engine
    ... [--backend vllm|sglang [--engine-url URL ...]]    a vLLM / SGLang server (started or given)
    areal-agent eval --env ID [--episodes N --k K ...]    evaluate an agent, write a report
    ... [--ray [--ray-address HOST:PORT]]                 engines and rollouts on a Ray cluster
    areal-agent train [--config FILE] [a.b=c ...]         asynchronous RL
    areal-agent train --resume RUN [a.b=c ...]            continue a stopped or failed run
    areal-agent runs [DIR]                                the runs in DIR (default runs/)
    areal-agent status RUN | logs RUN [-f] | stop RUN     one run: its state, its log, stop it
    areal-agent demos --env ID --n N --out FILE [--agent F] demonstrations for a warm start
    areal-agent envs                                      registered environments
    areal-agent mcp-serve --env ID [--transport stdio|http] serve an env's tools over MCP
    areal-agent worker --connect URL --agent MOD:FACTORY  run an agent for a trainer's tasks

The commands live in the modules of this package, one per family: :mod:`.serve` (``serve``,
``eval``; server-backed engines in :mod:`.backend`), :mod:`.train` (``train``, ``demos``),
:mod:`.envs` (``envs``, ``mcp-serve``), :mod:`.runs` (``runs``, ``status``, ``logs``,
``stop``), :mod:`.view` and :mod:`.worker`. A command's module is
imported when the command runs, so ``--help`` loads none of them and ``worker`` only its own
(httpx and openai, no torch, no fastapi). :func:`main` sets ``OMP_WAIT_POLICY=passive``
unless the environment has it, before any command imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from areal_agents.errors import ArealError

# Each command's implementation, as "module:function" in this package; imported on use.
_COMMANDS: dict[str, str] = {
    "serve": "serve:serve_command",
    "eval": "serve:eval_command",
    "train": "train:train_command",
    "demos": "train:demos_command",
    "envs": "envs:envs_command",
    "mcp-serve": "envs:mcp_serve_command",
    "worker": "worker:worker_command",
    "view": "view:view_command",
    "runs": "runs:runs_command",
    "status": "runs:status_command",
    "logs": "runs:logs_command",
    "stop": "runs:stop_command",
}

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
    parser.add_argument("--version", action=_Version, help="print the version and exit")
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
        "--no-self-rewarding",
        dest="self_rewarding",
        action="store_false",
        help="a session's own key may only call the model and read its session: rewards, "
        "ends and deletes need --admin-key (default: the session key may post its rewards)",
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
    _add_backend_args(serve)

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
        "(replacing them; with --store the episodes are recorded there instead)",
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
    _add_backend_args(ev)
    ev.set_defaults(max_batch_size=64, admin_key=None)

    tr = sub.add_parser("train", help="asynchronous RL on an environment")
    tr.add_argument("--config", default=None, help="YAML file (optional)")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8")
    tr.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN",
        help="continue from the last checkpoint: of RUN (a run directory, or a run's name in "
        "runs/), with its own config.yaml plus the overrides given now; without RUN, of the "
        "config's train.output_dir",
    )
    tr.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="trainer ranks (FSDP2 on torch.distributed); the same as train.nproc=N",
    )
    _add_backend_args(tr, training=True)

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

    sub.add_parser("envs", help="list the registered environments")

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
    _add_run_commands(sub)
    return parser


def _add_run_commands(sub: Any) -> None:
    """``runs``, ``status``, ``logs``, ``stop``: the runs of ``train``, from the shell."""
    rs = sub.add_parser(
        "runs", help="list the training runs in a directory: status, step, held-out result"
    )
    rs.add_argument("dir", nargs="?", default="runs", help="a directory of runs (default: runs/)")
    rs.add_argument("--json", action="store_true", help="one JSON object per run")
    st = sub.add_parser(
        "status", help="one run: its config, progress, last metrics and held-out results"
    )
    st.add_argument("run", help="a run directory, or a run's name in runs/")
    st.add_argument("--json", action="store_true", help="as one JSON object")
    lg = sub.add_parser("logs", help="a run's log (RUN_DIR/train.log)")
    lg.add_argument("run", help="a run directory, or a run's name in runs/")
    lg.add_argument(
        "-f", "--follow", action="store_true", help="then what it writes, until the run ends"
    )
    lg.add_argument("-n", "--lines", type=int, default=None, help="only the last N lines")
    sp = sub.add_parser(
        "stop",
        help="stop a run after its current step (it checkpoints; `train --resume RUN` "
        "continues it); asked again, at once (SIGTERM)",
    )
    sp.add_argument("run", help="a run directory, or a run's name in runs/")
    sp.add_argument("--wait", action="store_true", help="return once the run has ended")


class _Version(argparse.Action):
    """``--version``: the version of the package that runs (``areal_agents.__version__``;
    an editable install's metadata keeps the version it was installed at)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from areal_agents import __version__  # noqa: PLC0415  only when asked

        print(f"areal-agent {__version__}")
        parser.exit()


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


def _agent_args(parser: argparse.ArgumentParser, what: str, *, required: bool = False) -> None:
    """``--agent`` (``what`` is its help) and ``--agent-kwargs``."""
    parser.add_argument("--agent", default=None, required=required, help=what)
    parser.add_argument(
        "--agent-kwargs", default="{}", help="JSON object of keyword arguments of the factory"
    )


_BACKENDS = ("embedded", "vllm", "sglang")


def _add_backend_args(parser: argparse.ArgumentParser, *, training: bool = False) -> None:
    """The inference backend's flags: the command-line spelling of a training config's
    ``engine`` section (``--backend`` engine.backend, ``--engine-url`` engine.urls,
    ``--engine-python`` engine.launch.python, ``--engine-args`` engine.launch.args). For
    ``train`` they are overrides of that section (unset: the config's own values)."""
    group = parser.add_argument_group(
        "inference backend" + (" (the config's engine section)" if training else "")
    )
    group.add_argument(
        "--backend",
        choices=_BACKENDS,
        default=None if training else "embedded",
        help="embedded: transformers in this process (default); vllm / sglang: servers "
        "started here or given by --engine-url (engine.backend)",
    )
    group.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="attach to a running vLLM / SGLang server instead of starting one (repeat for "
        "several servers; a session's calls stay on one server) (engine.urls)",
    )
    group.add_argument(
        "--engine-python",
        default=None,
        help="Python of the server's environment (default: $AREAL_VLLM_PYTHON / "
        "$AREAL_SGLANG_PYTHON, else .venv-vllm / .venv-sglang) (engine.launch.python)",
    )
    group.add_argument(
        "--engine-args",
        default=None if training else "",
        help="extra flags for a started server, one quoted string (engine.launch.args)",
    )
    if training:
        return
    group.add_argument("--engine-port", type=int, default=0, help="port of a started server")
    group.add_argument("--engine-log", default=None, help="log file of a started server")
    group.add_argument(
        "--engine-timeout", type=float, default=900.0, help="seconds a started server may take"
    )
    group.add_argument(
        "--lora-rank",
        type=int,
        default=16,
        help="largest LoRA rank a started server accepts (vLLM: rounded up to a rank it takes)",
    )


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM ends a command the way Ctrl-C does: its cleanup runs (servers it started are
    stopped, the store is flushed); Python's default would exit without it."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # Before a command imports torch: OpenMP threads waiting for work sleep instead of
    # spinning on a core that another process (the engine, the trainer) needs. The
    # processes a command starts (Ray's, engine servers) inherit it; a user's value stays.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
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
        return int(_command(args.command)(args) or 0)
    except ArealError as exc:
        print(f"areal-agent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _command(name: str) -> Callable[[argparse.Namespace], int | None]:
    """The function that runs command ``name``, importing its module (see the docstring)."""
    module, _, function = _COMMANDS[name].partition(":")
    found = getattr(importlib.import_module(f"areal_agents.cli.{module}"), function)
    return found  # type: ignore[no-any-return]


if __name__ == "__main__":
    raise SystemExit(main())
