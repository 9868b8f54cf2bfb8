"""A tau² domain: its data, its tools, and the target database state of each task."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_agents.envs.tau2 import airline, retail
from areal_agents.envs.tau2.data import DOMAINS, DomainData, Task, load_domain
from areal_agents.envs.tau2.db import Database
from areal_agents.tools.tool import Tool

logger = logging.getLogger(__name__)

_TOOLS: dict[str, tuple[Callable[[Database], list[Tool]], frozenset[str]]] = {
    "retail": (retail.retail_tools, retail.WRITE_TOOLS),
    "airline": (airline.airline_tools, airline.WRITE_TOOLS),
}


@dataclass(frozen=True)
class Domain:
    """One domain: data plus tools. Get it with :func:`get_domain`.

    Attributes:
        name: ``"retail"`` or ``"airline"``.
        data: Policy, pristine database, tasks and splits.
        write_tools: Names of the tools that change the database.
    """

    name: str
    data: DomainData = field(repr=False)
    write_tools: frozenset[str] = field(repr=False)
    _bind: Callable[[Database], list[Tool]] = field(repr=False)
    _gold: dict[str, Database] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def new_database(self) -> Database:
        """A fresh private database for one episode (the pristine state)."""
        return Database(self.data.db)

    def tools(self, db: Database) -> list[Tool]:
        """The domain's tools bound to ``db``, sorted by name."""
        return self._bind(db)

    def replay(self, task: Task, db: Database) -> list[str]:
        """Apply ``task``'s gold actions to ``db``; returns the errors of failed actions.

        As in the benchmark, a failing gold action is skipped (some tasks include one on
        purpose: the user first gives a wrong detail, or asks for something not allowed).
        """
        by_name = {tool.name: tool for tool in self.tools(db)}
        errors = []
        for action in task.actions:
            tool = by_name.get(action.name)
            if tool is None:
                errors.append(f"{action.name}: unknown tool")
                continue
            result = tool.call(dict(action.arguments))
            if not result.ok:
                errors.append(f"{action.name}: {result.content}")
        for error in errors:
            logger.debug("tau2 %s task %s: gold action failed: %s", self.name, task.id, error)
        return errors

    def gold_database(self, task: Task) -> Database:
        """The database after replaying ``task``'s gold actions on a fresh copy (cached).

        The result is shared: read it, never write to it.
        """
        with self._lock:
            cached = self._gold.get(task.id)
        if cached is not None:
            return cached
        db = self.new_database()
        self.replay(task, db)
        with self._lock:
            return self._gold.setdefault(task.id, db)


@functools.cache
def get_domain(name: str) -> Domain:
    """The domain ``name`` (loaded once per process; downloads the data on first use).

    Raises:
        ValueError: If ``name`` is not ``"retail"`` or ``"airline"``.
    """
    if name not in DOMAINS:
        raise ValueError(f"expected a tau2 domain in {DOMAINS}, got {name!r}")
    bind, write_tools = _TOOLS[name]
    return Domain(name=name, data=load_domain(name), write_tools=write_tools, _bind=bind)
