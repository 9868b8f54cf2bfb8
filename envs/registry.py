"""The environment registry: gymnasium's registry, plus descriptions and plugin discovery.

Environments live in gymnasium's own registry (``gymnasium.make`` works on every id).
This module adds:

- :func:`register`: ``gymnasium.register`` plus a one-line description for
  :func:`list_envs`;
- built-in envs under the ``areal`` namespace, registered by entry-point string when
  ``envs`` is imported (their modules are imported only by :func:`make`);
- third-party envs discovered through the package entry-point group ``areal_agents.envs``.
  Each entry point is either a callable that registers envs (it calls
  :func:`envs.register`), or an env class registered under the entry point's name::

      [project.entry-points."areal_agents.envs"]
      "myorg/Maze-v0" = "myorg_envs.maze:MazeEnv"          # an env class
      myorg = "myorg_envs:register_all"                   # a function that registers

  A plugin that fails to load is reported with a warning and skipped.
- :func:`make`, which raises :class:`areal_agents.errors.EnvNotFound` with
  "Did you mean ...?" for an unknown id and returns the env itself (gymnasium's wrappers
  would hide ``tools()`` and ``score()``).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium

from areal_agents.envs.mcp import add_mcp_tools
from areal_agents.errors import ArealError, ConfigError, EnvNotFound, check_import_name

__all__ = ["ENTRY_POINT_GROUP", "list_envs", "load_plugins", "make", "probe", "register"]

ENTRY_POINT_GROUP = "areal_agents.envs"

_DESCRIPTIONS: dict[str, str] = {}
_plugins_loaded = False

_BUILTINS: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "areal/Math-v0",
        "areal_agents.envs.math.env:MathEnv",
        {},
        "GSM8K-style word problems, multi-turn, with a calculator (and optional python) tool",
    ),
    (
        "areal/Calculator-v0",
        "areal_agents.envs.math.env:CalculatorEnv",
        {},
        "Two-turn calculator tool use: call calculator(expression), then answer",
    ),
    (
        "areal/Search-v0",
        "areal_agents.envs.search.env:SearchEnv",
        {},
        "Multi-hop question answering over a local corpus with a retriever tool",
    ),
    (
        "areal/Research-v0",
        "areal_agents.envs.search.research:ResearchEnv",
        {},
        "Open-ended research questions over the search corpus: many facts, many turns",
    ),
    (
        "areal/Tau2Retail-v0",
        "areal_agents.envs.tau2.env:Tau2Env",
        {"domain": "retail"},
        "tau2-style retail customer service with a simulated user; database-state reward",
    ),
    (
        "areal/Tau2Airline-v0",
        "areal_agents.envs.tau2.env:Tau2Env",
        {"domain": "airline"},
        "tau2-style airline customer service with a simulated user; database-state reward",
    ),
    (
        "areal/Tasks-v0",
        "areal_agents.envs.tasks.env:TasksEnv",
        {},
        "Your own tasks from a JSONL file (path=...), scored by your function (score='pkg.mod:fn')",
    ),
]


def register(
    id: str,
    entry_point: str | Callable[..., gymnasium.Env],
    *,
    description: str = "",
    kwargs: dict[str, Any] | None = None,
    override: bool = False,
) -> None:
    """Register an env in gymnasium's registry with a one-line description.

    Args:
        id: ``"namespace/Name-vN"`` (or ``"Name-vN"``).
        entry_point: ``"module.path:ClassName"`` or a callable returning the env.
        description: One line shown by :func:`list_envs`; the class docstring's first line
            when empty and ``entry_point`` is a class.
        kwargs: Default constructor kwargs (``make`` kwargs override them).
        override: Replace an existing registration instead of raising ``ValueError``.

    Raises:
        ConfigError: ``entry_point`` names a module by its pre-0.2.0 name
            (``"envs.math.env:MathEnv"``); the message names the new one.
    """
    if isinstance(entry_point, str):
        check_import_name(entry_point, f"entry point of {id!r}")
    if id in gymnasium.registry and not override:
        if _DESCRIPTIONS.get(id) is not None and gymnasium.registry[id].entry_point == entry_point:
            return  # the same registration again (a re-import): nothing to do
        raise ValueError(f"env id {id!r} is already registered; pass override=True to replace it")
    if not description and inspect.isclass(entry_point):
        description = (inspect.getdoc(entry_point) or "").strip().split("\n")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium warns when overriding
        gymnasium.register(id, entry_point=entry_point, kwargs=dict(kwargs or {}))
    _DESCRIPTIONS[id] = description


def _register_builtins() -> None:
    for id, entry_point, kwargs, description in _BUILTINS:
        register(id, entry_point, kwargs=kwargs, description=description)


def load_plugins(*, force: bool = False) -> list[str]:
    """Load third-party envs from the ``areal_agents.envs`` entry-point group.

    Runs once per process (again with ``force=True``). Returns the ids it added.
    """
    global _plugins_loaded
    if _plugins_loaded and not force:
        return []
    _plugins_loaded = True
    before = set(gymnasium.registry)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            _load_plugin(entry_point)
        except Exception as exc:
            warnings.warn(
                f"skipping env plugin {entry_point.name!r} ({entry_point.value}): "
                f"{type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
    added = sorted(set(gymnasium.registry) - before)
    for id in added:
        _DESCRIPTIONS.setdefault(id, "")
    return added


def _load_plugin(entry_point: importlib.metadata.EntryPoint) -> None:
    obj = entry_point.load()
    if inspect.isclass(obj) and issubclass(obj, gymnasium.Env):
        register(entry_point.name, obj, override=True)
    elif callable(obj):
        obj()
    else:
        raise TypeError(f"expected an env class or a registering function, got {obj!r}")


def list_envs() -> list[tuple[str, str]]:
    """(id, one-line description) of every areal env: built-ins and plugins, sorted.

    Imports no env module."""
    load_plugins()
    return sorted((id, desc) for id, desc in _DESCRIPTIONS.items() if id in gymnasium.registry)


def make(id: str, **kwargs: Any) -> Any:
    """Create the env registered as ``id``; ``kwargs`` override the registered defaults.

    ``mcp`` is not passed to the env: it adds the tools of one MCP server (a mapping, see
    :mod:`areal_agents.tools.mcp_client`) or of several (a list of mappings) to the env's own,
    in every episode: ``make("areal/Search-v0", mcp={"command": ["python", "server.py"]})``,
    or ``env.kwargs.mcp`` in a training config.

    Raises:
        EnvNotFound: ``id`` is not registered (the message suggests the nearest ids).
        ConfigError: ``mcp`` is malformed, or a server cannot be started or reached.
    """
    if id not in gymnasium.registry:
        load_plugins()
    if id not in gymnasium.registry:
        raise EnvNotFound(_not_found_message(id))
    servers = kwargs.pop("mcp", None)
    env = gymnasium.make(id, disable_env_checker=True, **kwargs).unwrapped
    if servers is not None:
        try:
            add_mcp_tools(env, servers, where=f"env {id}: mcp")
        except BaseException:
            with contextlib.suppress(Exception):
                env.close()
            raise
    return env


def probe(make_env: Callable[[], Any], *, seed: int | None, what: str) -> None:
    """Make one env with ``make_env`` and reset it with ``seed``, once, before a run's first
    episode: a configuration error (bad constructor kwargs, a missing part such as tau2's
    user simulator, a reset that reports ``info["error"]``) then fails the command with its
    message, instead of ending every episode as ``env_error``.

    Raises:
        ConfigError: the message starts with ``what`` (where the env's settings come from,
            e.g. ``"--env-kwargs"`` or ``"env.kwargs"``) and carries the env's own error.
        EnvNotFound: the id is not registered.
    """
    try:
        env = make_env()
    except EnvNotFound:
        raise
    except ArealError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"{what}: cannot make the env: {type(exc).__name__}: {exc}") from None
    try:
        _, info = env.reset(seed=seed)
    except ArealError as exc:
        raise ConfigError(f"{what}: the env's first reset failed: {exc}") from None
    except Exception as exc:
        raise ConfigError(
            f"{what}: the env's first reset failed: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        with contextlib.suppress(Exception):  # closing is best effort
            env.close()
    error = info.get("error") if isinstance(info, dict) else None
    if error:
        message = error.get("message", error) if isinstance(error, dict) else error
        raise ConfigError(f"{what}: the env's first reset reported an error: {message}")


def _not_found_message(id: str) -> str:
    ours = sorted(_DESCRIPTIONS)
    candidates = ours + sorted(set(gymnasium.registry) - set(ours))
    close = _close_ids(id, candidates)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"No environment registered as {id!r}.{hint} "
        "List the ids with envs.list_envs() or `areal-agent envs`; "
        "register your own with envs.register(id, entry_point)."
    )


def _close_ids(id: str, candidates: list[str]) -> list[str]:
    """Up to 3 registered ids near ``id``, ignoring case (and the namespace if it has none)."""
    keys: dict[str, list[str]] = {}
    for candidate in candidates:
        keys.setdefault(candidate.lower(), []).append(candidate)
        if "/" not in id:
            keys.setdefault(candidate.split("/")[-1].lower(), []).append(candidate)
    found: list[str] = []
    for key in difflib.get_close_matches(id.lower(), list(keys), n=3, cutoff=0.75):
        found += [c for c in keys[key] if c not in found]
    return found[:3]
