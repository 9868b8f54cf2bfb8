"""Score functions for ``areal/Tasks-v0``: resolving ``"pkg.module:fn"``, reading what a
function returns, and the built-in :func:`exact_match`.

A score function is called as ``fn(task, final_answer, episode)``:

- ``task``: the task's JSON object (a fresh copy, with ``id`` filled in);
- ``final_answer``: the content of the assistant's last message (``""`` when it has none);
- ``episode``: the conversation so far, a list of chat messages ending with that message.

It returns a number (a bool counts as 0 or 1), and optionally more:

- ``reward``: ``info["success"]`` is ``reward > 0``;
- ``(reward, info)``: ``info`` (a dict) is merged into the episode's info; a bool
  ``info["success"]`` overrides ``reward > 0``;
- ``{"reward": r, "success": b, ...}``: the same, as one dict (``success`` optional).

Anything else (a string, None, NaN), or an exception inside the function, makes the episode
fail with an :class:`areal_agents.errors.EnvError` (recorded by the runner as ``env_error``;
the run goes on).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import numbers
import pkgutil
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from areal_agents.errors import ConfigError, EnvError, check_import_name

__all__ = ["ScoreFn", "exact_match", "extract_answer", "normalize", "read_outcome", "resolve_score"]

ScoreFn = Callable[[dict[str, Any], str, list[dict[str, Any]]], Any]


def resolve_score(spec: str | ScoreFn) -> tuple[ScoreFn, str]:
    """The score function named by ``spec`` (``"pkg.module:fn"``, or a callable) and its name.

    Raises:
        ConfigError: a malformed string, a module that cannot be imported, a missing
            attribute (with the nearest names), or an attribute that is not a function of
            ``(task, final_answer, episode)``.
    """
    if callable(spec) and not isinstance(spec, str):
        name = f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"
        _check_signature(spec, name)
        return spec, name
    if not isinstance(spec, str):
        raise ConfigError(
            f"score: expected an import string 'package.module:function', got {spec!r}"
        )
    module_name, sep, attr = spec.strip().partition(":")
    check_import_name(spec, "score")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"score: expected 'package.module:function' (a module path, a colon, the "
            f"function's name), got {spec!r}; e.g. score='my_pkg.rewards:score'"
        )
    module = _import(module_name, spec)
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            names = [n for n in dir(fn) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"score={spec!r}: {module_name!r} has no attribute {part!r}.{hint} "
                f"Define def {part}(task, final_answer, episode) in {module_name}, "
                "or fix the name after the colon."
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(
            f"score={spec!r}: {attr!r} is a {type(fn).__name__}, not a function; point it at "
            "a function fn(task, final_answer, episode)"
        )
    _check_signature(fn, spec)
    return fn, spec.strip()


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name != missing and not module_name.startswith(missing + "."):
            raise ConfigError(
                f"score={spec!r}: importing {module_name!r} failed because it imports "
                f"{missing!r}, which is not installed: {exc}"
            ) from None
        hint = _module_hint(missing)
        raise ConfigError(
            f"score={spec!r}: no module named {missing!r}.{hint} Install the package that "
            "holds it, or run from the directory that contains it (or add that directory "
            "to PYTHONPATH)."
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"score={spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None


def _module_hint(missing: str) -> str:
    parent, _, leaf = missing.rpartition(".")
    try:
        if parent:
            path = (sys.modules.get(parent) or importlib.import_module(parent)).__path__
            names = [m.name for m in pkgutil.iter_modules(path)]
        else:
            names = [m.name for m in pkgutil.iter_modules()] + list(sys.builtin_module_names)
    except Exception:
        return ""
    close = difflib.get_close_matches(leaf, names, n=3)
    prefix = f"{parent}." if parent else ""
    return f" Did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"score={name!r} is an async function; score functions must be synchronous"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    try:
        signature.bind({}, "", [])
    except TypeError as exc:
        raise ConfigError(
            f"score={name!r} cannot be called as fn(task, final_answer, episode) "
            f"(signature {signature}): {exc}"
        ) from None


def read_outcome(value: Any, name: str) -> tuple[float, dict[str, Any]]:
    """(reward, info with ``"success"``) from what score function ``name`` returned.

    Raises:
        EnvError: the value is not a number, ``(number, dict)`` or a dict with ``reward``.
    """
    expected = "a number, (reward, info dict) or {'reward': ..., 'success': ...}"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        reward, extra = value[0], dict(value[1])
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise EnvError(
                f"score function {name} returned a dict without 'reward': {value!r:.200}"
            )
        extra = dict(value)
        reward = extra.pop("reward")
    else:
        reward, extra = value, {}
    if not isinstance(reward, numbers.Real):
        raise EnvError(
            f"score function {name} must return {expected}; got {type(reward).__name__} "
            f"{reward!r:.100}"
        )
    reward = float(reward)
    if not math.isfinite(reward):
        raise EnvError(f"score function {name} returned a non-finite reward {reward!r}")
    success = extra.pop("success", None)
    if success is None:
        success = reward > 0
    elif not isinstance(success, bool):
        raise EnvError(
            f"score function {name}: 'success' must be a bool, got {type(success).__name__}"
        )
    return reward, {**extra, "success": success, "final_reward": reward}


# ---------------------------------------------------------------------------- exact match

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER = re.compile(r"\banswer(?:\s+is\b\s*:?|\s*[:=])\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")


def extract_answer(text: str) -> str:
    """The answer written in ``text``: the last ``\\boxed{X}``, else what follows the last
    "answer:" / "answer is" on its line, else the whole text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1])
    for line in reversed(text.splitlines()):
        found = list(_ANSWER.finditer(line))
        if found:
            return found[-1].group(1)
    return text


def normalize(text: str) -> str:
    """Lowercase, whitespace collapsed, surrounding quotes, ``*`` and a final ``.`` removed;
    numbers written with thousands commas or trailing zeros (``1,000.50``) as ``1000.5``."""
    text = " ".join(str(text).split()).casefold()
    text = text.strip("\"'`* ").rstrip(".").strip("\"'`* ")
    if _NUMBER.match(text):
        number = float(text.replace(",", ""))
        return str(int(number)) if number.is_integer() else repr(number)
    return text


def exact_match(task: Mapping[str, Any], final_answer: str, episode: Sequence[Any]) -> float:
    """1.0 when the final answer matches the task's ``answer`` (a string, a number, or a list
    of accepted answers), else 0.0.

    The answer is read from the final message with :func:`extract_answer` and both sides
    are compared after :func:`normalize`: ``"The answer is 1,200."`` matches ``1200``.

    Raises:
        ValueError: the task has no ``answer`` field.
    """
    if "answer" not in task:
        raise ValueError(
            f"exact_match needs an 'answer' field on each task (a string, a number or a "
            f"list of them); task {task.get('id')!r} has none"
        )
    gold = task["answer"]
    accepted = gold if isinstance(gold, list) else [gold]
    predicted = normalize(extract_answer(final_answer))
    return 1.0 if any(predicted == normalize(str(a)) for a in accepted) else 0.0
