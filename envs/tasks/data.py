"""Loading and validating a JSONL file of tasks for ``areal/Tasks-v0``.

One task per line, a JSON object::

    {"prompt": "What is 2 + 3?", "answer": "5"}
    {"id": "q7", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}],
     "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {...}}}],
     "split": "test", "answer": ["Paris", "paris, france"], "meta": {"source": "x"}}

Fields:

- ``messages`` (a non-empty list of chat messages, str content) or ``prompt`` (a string,
  which becomes one ``user`` message): exactly one of them;
- ``system`` (optional string): a system message placed first (not allowed when
  ``messages`` already holds a system message);
- ``tools`` (optional list): OpenAI function tool schemas, ``{"type": "function",
  "function": {"name", "description"?, "parameters"?}}``, names unique in the task;
- ``id`` (optional string or int; ``task_id`` is accepted as an alias): unique in the file,
  ``"line-<n>"`` when absent;
- ``split`` (optional string): the split the task belongs to (see :func:`select_split`);
- anything else (``answer``, metadata...) is kept as it is and reaches the score function.

Blank lines are skipped. Every problem of the file is reported at once, with line numbers,
in one :class:`areal_agents.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.envs.spaces import message_problem
from areal_agents.errors import ConfigError, ToolError
from areal_agents.tools.tool import Tool

__all__ = ["RESERVED_FIELDS", "Task", "load_tasks", "parse_tasks", "select_split"]

Message = dict[str, Any]

RESERVED_FIELDS = ("messages", "prompt", "system", "tools", "id", "task_id")
"""Fields read by the env; every other field of a task is one of its ``fields``."""

MAX_REPORTED = 50
"""At most this many problems are listed in the error (then a count of the rest)."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Task:
    """One validated task line.

    Attributes:
        task_id: The task's ``id`` (as a string), or ``"line-<n>"``.
        messages: The first messages of the episode (the system message first, if any).
        tool_schemas: The task's OpenAI tool schemas (descriptions and parameters filled
            in with ``""`` and an empty object schema when absent).
        fields: The line's other fields (``answer``, ``split``, metadata...).
        line: The line number in the file (1-based).
        raw: The JSON object as written, with ``id`` filled in; what the score function
            receives (as a copy).
    """

    task_id: str
    messages: list[Message]
    tool_schemas: list[dict[str, Any]]
    fields: dict[str, Any]
    line: int
    raw: dict[str, Any]
    tools: list[Tool] = field(default_factory=list, compare=False, repr=False)

    @property
    def split(self) -> str | None:
        """The task's ``split`` field, if it has one."""
        value = self.fields.get("split")
        return value if isinstance(value, str) else None

    def score_input(self) -> dict[str, Any]:
        """A fresh copy of :attr:`raw` for the score function (it may modify it freely)."""
        return copy.deepcopy(self.raw)


def load_tasks(path: str | os.PathLike[str]) -> list[Task]:
    """Read and validate a task file; see the module docstring for the format.

    Raises:
        ConfigError: the file is missing, empty, or has bad lines (all of them listed).
    """
    file = Path(path)
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(
            f"path: no task file at {str(path)!r}{where}; pass the path of a JSONL file "
            "with one task per line"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"path: cannot read {str(path)!r}: {exc}") from None
    return parse_tasks(text.splitlines(), source=str(path))


def parse_tasks(lines: Iterable[str], *, source: str = "<tasks>") -> list[Task]:
    """Validate task lines (one JSON object each; blank lines skipped).

    Raises:
        ConfigError: no task, or bad lines; ``problems`` lists each with its line number.
    """
    tasks: list[Task] = []
    problems: list[str] = []
    first_line_of: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        task, line_problems = _parse_line(text, number)
        problems += [f"line {number}: {p}" for p in line_problems]
        if task is None:
            continue
        if task.task_id in first_line_of:
            problems.append(
                f"line {number}: duplicate id {task.task_id!r} "
                f"(first used on line {first_line_of[task.task_id]})"
            )
            continue
        first_line_of[task.task_id] = number
        tasks.append(task)
    if problems:
        shown = problems[:MAX_REPORTED]
        if len(problems) > MAX_REPORTED:
            shown.append(f"... and {len(problems) - MAX_REPORTED} more problems")
        raise ConfigError(
            f"{source}: {len(problems)} problem(s) in the task file; fix these lines "
            "(each line is a JSON object with 'prompt' (a string) or 'messages' (a list of "
            "chat messages), and optional 'system', 'tools', 'id', 'split')",
            shown,
        )
    if not tasks:
        raise ConfigError(
            f"{source}: the task file is empty; write one JSON task per line, "
            'e.g. {"prompt": "What is 2 + 3?", "answer": "5"}'
        )
    return tasks


def _parse_line(text: str, number: int) -> tuple[Task | None, list[str]]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"invalid JSON ({exc.msg} at column {exc.colno})"]
    if not isinstance(row, dict):
        return None, [f"expected a JSON object, got {_json_type(row)}"]
    problems: list[str] = []
    messages = _messages(row, problems)
    schemas, tools = _tools(row.get("tools"), problems)
    task_id = _task_id(row, number, problems)
    split = row.get("split")
    if "split" in row and not (isinstance(split, str) and split):
        problems.append(f"'split' must be a non-empty string, got {split!r}")
    if problems or messages is None or task_id is None:
        return None, problems
    raw = dict(row)
    raw.pop("task_id", None)
    raw["id"] = row.get("id", task_id)
    fields = {k: v for k, v in row.items() if k not in RESERVED_FIELDS}
    task = Task(task_id, messages, schemas, fields, number, raw, tools)
    return task, []


def _messages(row: Mapping[str, Any], problems: list[str]) -> list[Message] | None:
    has_messages, has_prompt = "messages" in row, "prompt" in row
    if has_messages == has_prompt:
        problems.append(
            "give either 'messages' (a list of chat messages) or 'prompt' (a string)"
            if not has_messages
            else "has both 'messages' and 'prompt'; give one of them"
        )
        return None
    system = row.get("system")
    if "system" in row and not isinstance(system, str):
        problems.append(f"'system' must be a string, got {_json_type(system)}")
        return None
    if has_prompt:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            problems.append(f"'prompt' must be a non-empty string, got {prompt!r:.60}")
            return None
        messages: list[Message] = [{"role": "user", "content": prompt}]
    else:
        given = row["messages"]
        if not isinstance(given, list) or not given:
            problems.append(
                f"'messages' must be a non-empty list of chat messages, got {given!r:.60}"
            )
            return None
        bad = [(i, message_problem(m)) for i, m in enumerate(given)]
        bad = [(i, p) for i, p in bad if p is not None]
        if bad:
            problems += [f"messages[{i}]: {p}" for i, p in bad]
            return None
        messages = [dict(m) for m in given]
        if system is not None and any(m["role"] == "system" for m in messages):
            problems.append("has 'system' and a system message in 'messages'; give one of them")
            return None
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _tools(value: Any, problems: list[str]) -> tuple[list[dict[str, Any]], list[Tool]]:
    if value is None:
        return [], []
    if not isinstance(value, list):
        problems.append(f"'tools' must be a list of tool schemas, got {_json_type(value)}")
        return [], []
    schemas: list[dict[str, Any]] = []
    tools: list[Tool] = []
    for i, schema in enumerate(value):
        problem, tool = _tool(schema)
        if problem is not None:
            problems.append(f"tools[{i}]: {problem}")
            continue
        assert tool is not None
        if tool.name in {t.name for t in tools}:
            problems.append(f"tools[{i}]: duplicate tool name {tool.name!r}")
            continue
        tools.append(tool)
        schemas.append(tool.schema)
    return schemas, tools


def _tool(schema: Any) -> tuple[str | None, Tool | None]:
    expected = (
        'expected {"type": "function", "function": {"name": ..., "description": ..., '
        '"parameters": {"type": "object", ...}}}'
    )
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or schema.get("type", "function") != "function":
        return f"{expected}, got {json.dumps(schema)[:80]}", None
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        return f"tool name must match {_TOOL_NAME.pattern}, got {name!r}", None
    description = fn.get("description", "")
    if not isinstance(description, str):
        return f"tool {name!r}: 'description' must be a string", None
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return f"tool {name!r}: 'parameters' must be a JSON schema of type 'object'", None
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        return f"tool {name!r}: 'properties' must be an object", None
    required = parameters.get("required", [])
    if not isinstance(required, list) or not set(map(str, required)) <= set(properties):
        return f"tool {name!r}: 'required' must list declared properties, got {required!r}", None
    return None, Tool(name, description, parameters, _no_implementation(name))


def _no_implementation(name: str) -> Any:
    def call(**_: Any) -> str:
        raise ToolError(
            f"the tool {name!r} has no implementation in this environment "
            "(areal/Tasks-v0 tasks give tool schemas only); answer without it"
        )

    return call


def _task_id(row: Mapping[str, Any], number: int, problems: list[str]) -> str | None:
    ids = [row[k] for k in ("id", "task_id") if k in row]
    if len(ids) == 2 and ids[0] != ids[1]:
        problems.append(f"has both 'id' ({ids[0]!r}) and 'task_id' ({ids[1]!r}); give one")
        return None
    if not ids:
        return f"line-{number}"
    value = ids[0]
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        problems.append(f"'id' must be a non-empty string or an int, got {value!r}")
        return None
    return str(value)


def select_split(
    tasks: Sequence[Task], split: str, *, seed: int = 0, test_fraction: float = 0.2
) -> list[Task]:
    """The tasks of ``split``.

    - ``"all"``: every task;
    - when the tasks carry ``split`` fields (every task must then have one): the tasks whose
      field equals ``split`` (any name: ``"train"``, ``"test"``, ``"val"``...);
    - otherwise ``"train"`` or ``"test"``: a shuffle seeded by ``seed`` sends
      ``test_fraction`` of the tasks to ``"test"``, the rest to ``"train"``.

    Raises:
        ConfigError: an unknown split, a split with no task, or split fields on only
            some tasks.
    """
    if not isinstance(split, str):
        raise ConfigError(f"split: expected 'train', 'test' or 'all', got {split!r}")
    if split == "all":
        return list(tasks)
    missing = [t.line for t in tasks if t.split is None]
    if len(missing) < len(tasks):
        if missing:
            lines = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise ConfigError(
                f"split={split!r}: some tasks have a 'split' field and {len(missing)} do not "
                f"(lines {lines}); give every task a 'split', or none, or use split='all'"
            )
        chosen = [t for t in tasks if t.split == split]
        names = sorted({t.split for t in tasks if t.split is not None})
    else:
        if split not in ("train", "test"):
            raise ConfigError(
                f"split: expected 'train', 'test' or 'all' (the tasks have no 'split' "
                f"field), got {split!r}"
            )
        if not 0.0 <= test_fraction <= 1.0:
            raise ConfigError(f"test_fraction: expected a number in [0, 1], got {test_fraction!r}")
        order = list(range(len(tasks)))
        random.Random(seed).shuffle(order)
        test = set(order[: round(len(tasks) * test_fraction)])
        chosen = [t for i, t in enumerate(tasks) if (i in test) == (split == "test")]
        names = ["train", "test"]
    if not chosen:
        raise ConfigError(
            f"split {split!r} has no tasks; splits: {', '.join(names)} (or 'all' for every task)"
        )
    return chosen


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    for kind, name in names.items():
        if isinstance(value, kind):
            return name
    return "a number" if isinstance(value, int | float) else type(value).__name__
