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
  would hide ``tools()`` and ``score()``);
- ids that name where an env is (:func:`resolve_id`): ``"pkg.module:ClassName"`` imports the
  module and registers the class under that string, in whichever process makes it first
  (Ray rollout workers included: the id travels, each process resolves it); gymnasium's own
  ``"pkg.module:Name-v0"`` imports the module (which registers its envs) and looks the id up.
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
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from areal_agents.envs.mcp import add_mcp_tools
from areal_agents.errors import ArealError, ConfigError, EnvNotFound, check_import_name

__all__ = [
    "ENTRY_POINT_GROUP",
    "list_envs",
    "load_plugins",
    "make",
    "probe",
    "register",
    "resolve_id",
]

ENTRY_POINT_GROUP = "areal_agents.envs"

_DESCRIPTIONS: dict[str, str] = {}
_FROM_CLASS: set[str] = set()  # ids registered by resolve_id's "module:Class" form
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
    """(id, one-line description) of every areal env: built-ins and plugins, sorted; not
    the ``"module:ClassName"`` ids made so far (:func:`resolve_id`), which plain
    ``gymnasium.make`` cannot make (it reads them as its own ``"module:Name-v0"`` form).

    Imports no env module."""
    load_plugins()
    return sorted(
        (id, desc)
        for id, desc in _DESCRIPTIONS.items()
        if id in gymnasium.registry and id not in _FROM_CLASS
    )


def make(id: str, **kwargs: Any) -> Any:
    """Create the env ``id`` names; ``kwargs`` override the registered defaults.

    ``id`` is a registered id (``"areal/Calculator-v0"``), or where an env is:
    ``"pkg.module:ClassName"`` (the class, registered under that string) or gymnasium's
    ``"pkg.module:Name-v0"`` (an id the module registers when imported); see
    :func:`resolve_id` for how the two are told apart.

    ``mcp`` is not passed to the env: it adds the tools of one MCP server (a mapping, see
    :mod:`areal_agents.tools.mcp_client`) or of several (a list of mappings) to the env's own,
    in every episode: ``make("areal/Search-v0", mcp={"command": ["python", "server.py"]})``,
    or ``env.kwargs.mcp`` in a training config.

    Raises:
        EnvNotFound: ``id`` is not registered (the message suggests the nearest ids), or
            the module or class it names cannot be found.
        ConfigError: ``mcp`` is malformed, or a server cannot be started or reached; the
            module ``id`` names fails to import, or names no ``gymnasium.Env`` subclass.
    """
    spec = gymnasium.registry[resolve_id(id)]
    servers = kwargs.pop("mcp", None)
    # the spec itself, not its id: gymnasium.make would read "module:Class" as its own form
    env = gymnasium.make(spec, disable_env_checker=True, **kwargs).unwrapped
    if servers is not None:
        try:
            add_mcp_tools(env, servers, where=f"env {id}: mcp")
        except BaseException:
            with contextlib.suppress(Exception):
                env.close()
            raise
    return env


def resolve_id(id: str) -> str:
    """The registered id that ``id`` names, importing and registering what it names first.

    The rule, in order:

    1. a registered id (a built-in's, a plugin's, one registered earlier in this process)
       is itself;
    2. an id without ``:`` is looked up among the plugins' (else :class:`EnvNotFound`);
    3. ``"module:Name"``: the module is imported (``module`` is a dotted module name, found
       on ``sys.path``: ``PYTHONPATH``, the installed packages). When ``Name`` is a Python
       identifier and the module has an attribute of that name, it is the **class form**:
       the attribute must be a ``gymnasium.Env`` subclass, and is registered under ``id``
       itself (episodes and stores record ``"mypkg.envs:MyEnv"``; ``env.kwargs`` go to its
       constructor). Otherwise it is **gymnasium's form**: ``Name`` is an id that importing
       the module registered (``Name-v0``, ``ns/Name-v0``), and that id is returned.

    So ``mymod:MyEnv`` is a class (identifiers have no ``-``) and ``mymod:MyEnv-v0`` an id.
    Every process resolves the same string the same way, so an id made in Ray rollout
    workers only needs the module importable there too (``PYTHONPATH`` or installed).

    Raises:
        EnvNotFound: no such id; the module is not importable, or has neither a class nor
            a registered id of that name (the message says which, and the fix).
        ConfigError: the module raised while importing; the attribute is not a
            ``gymnasium.Env`` subclass; the module has its pre-0.2.0 name.
    """
    if id in gymnasium.registry:
        return id
    module_name, sep, name = id.partition(":")
    if not sep:
        load_plugins()
        if id in gymnasium.registry:
            return id
        raise EnvNotFound(_not_found_message(id))
    if not name:
        raise EnvNotFound(f"env id {id!r}: expected 'pkg.module:ClassName' (or a registered id)")
    check_import_name(id, f"env id {id!r}")
    module = _import_env_module(id, module_name)
    if name.isidentifier() and hasattr(module, name):
        _register_class(id, getattr(module, name))
        return id
    if name in gymnasium.registry:
        return name
    where = f"{module_name!r} ({getattr(module, '__file__', None) or 'a namespace package'})"
    if name.isidentifier():
        classes = [
            n
            for n, v in vars(module).items()
            if _is_env_class(v) and v.__module__ == module.__name__  # defined there
        ]
        close = difflib.get_close_matches(name, classes, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(f'{module_name}:{c}') for c in close)}?"
        raise EnvNotFound(
            f"env id {id!r}: module {where} has no class {name!r} (and registers no env id "
            f"{name!r}).{hint if close else ''} Its env classes: {', '.join(classes) or 'none'}."
        )
    raise EnvNotFound(
        f"env id {id!r}: importing {where} registered no env {name!r} (gymnasium's "
        f"'module:Name-vN' form looks up an id the module registers; 'module:ClassName' "
        f"names a class). {_not_found_message(name)}"
    )


def _import_env_module(id: str, module_name: str) -> Any:
    """The module of a ``"module:Name"`` env id, with errors that say how to fix them."""
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise EnvNotFound(
            f"env id {id!r}: {module_name!r} is not a module name; write 'pkg.module:ClassName' "
            "with the directory that holds pkg (or module.py) on PYTHONPATH"
        )
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise ConfigError(
                f"env id {id!r}: importing module {module_name!r} failed: {exc}"
            ) from None
        if "." in exc.name:  # the package is there, its submodule is not
            raise EnvNotFound(
                f"env id {id!r}: no module named {exc.name!r}; check the dotted module path "
                "(pkg.module:ClassName)"
            ) from None
        raise EnvNotFound(
            f"env id {id!r}: no module named {exc.name!r} here; put the directory that "
            f"holds {exc.name}.py (or the package folder {exc.name}/) on PYTHONPATH, e.g. "
            f"`PYTHONPATH=path/to/dir areal-agent ...`, or pip install its package"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"env id {id!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None


def _is_env_class(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, gymnasium.Env)


def _register_class(id: str, obj: Any) -> None:
    """Register the class of a ``"module:ClassName"`` id under the id itself."""
    if not _is_env_class(obj):
        what = "a class" if inspect.isclass(obj) else f"an object of type {type(obj).__name__}"
        raise ConfigError(
            f"env id {id!r}: that is {what}, not a gymnasium.Env subclass; name a class "
            "derived from areal_agents.envs.AgentEnv (see docs/envs.md), or register a "
            "factory with envs.register('myorg/Name-v0', factory) and use that id"
        )
    register(id, obj)
    _FROM_CLASS.add(id)


def probe(make_env: Callable[[], Any], *, seed: int | None, what: str) -> None:
    """Make one env with ``make_env`` and reset it with ``seed``, once, before a run's first
    episode: a configuration error (bad constructor kwargs, a missing part such as tau2's
    user simulator, a reset that reports ``info["error"]``) then fails the command with its
    message, instead of ending every episode as ``env_error``. An env made from a
    ``"module:ClassName"`` id (:func:`resolve_id`) first goes through gymnasium's env
    checker (``gymnasium.utils.env_checker.check_env``: its spaces, seeding, ``step``).

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
        _gymnasium_check(env, what)
        _, info = env.reset(seed=seed)
    except ConfigError:
        raise
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


def _gymnasium_check(env: Any, what: str) -> None:
    """Gymnasium's env checker, for an env of a ``"module:ClassName"`` id (others: nothing)."""
    id = getattr(getattr(env, "spec", None), "id", None)
    if id not in _FROM_CLASS:
        return
    try:
        gymnasium_check_env(env, skip_render_check=True, skip_close_check=True)
    except Exception as exc:
        raise ConfigError(
            f"{what}: {id} fails gymnasium's env checker: {type(exc).__name__}: {exc} "
            "(run areal_agents.envs.check_env on it for the agent-env contract; see "
            "docs/envs.md)"
        ) from None


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
