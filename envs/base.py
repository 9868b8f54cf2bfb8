"""The base class of every areal environment: a Gymnasium env whose observations are chat
messages and whose actions are assistant messages.

The episode, step by step::

    obs, info = env.reset(seed=0)      # obs: [system, user, ...]; info["tools"], info["task_id"]
    obs, reward, terminated, truncated, info = env.step(assistant_message)
    # obs: the NEW messages (tool results, feedback, the simulated user's reply)

A subclass implements three hooks and inherits the rest:

- :meth:`AgentEnv._start` picks the task for ``reset`` and returns its first messages and
  ``info`` (with ``"task_id"``);
- :meth:`AgentEnv.tools` returns the episode's :class:`tools.Tool` objects;
- :meth:`AgentEnv._respond` answers an assistant message that has no tool calls (check a
  final answer, give feedback, let a simulated user reply) and says whether the task ended.

Optional hooks: :meth:`AgentEnv._tool_reward` (reward for a turn that made tool calls,
0 by default), :meth:`AgentEnv._tool_info` (extra ``info`` of such a turn, e.g. its
``state_key``) and :meth:`AgentEnv.score` (reward of a whole conversation, for frameworks
that run their own loop).

Semantics shared by every env:

- ``max_turns`` counts assistant messages (steps). When step ``max_turns`` ends without
  the task ending, ``truncated`` is True: a budget ran out, the task was not failed.
- Every tool call gets exactly one ``tool`` message with its ``tool_call_id``. An unknown
  tool name, malformed JSON arguments or a tool that raises produce an ``"Error: ..."``
  message the model reads; ``info["tool_results"]`` lists ``{"tool_call_id", "name",
  "error"}`` with ``error`` one of ``None``, ``"unknown_tool"``, ``"bad_tool_call"``,
  ``"bad_arguments"``, ``"tool_exception"``, ``"timeout"`` (and ``"mcp_error"`` for an MCP
  server that went away).
- :meth:`AgentEnv.add_tools` adds tools to every episode's own: ``envs.make(id, mcp=...)``
  adds an MCP server's this way (:mod:`areal_agents.envs.mcp`).
- When the episode ends, ``info["success"]`` (bool) is set.
- ``step`` before ``reset`` or after the end raises :class:`EpisodeEnded`.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from areal_agents.envs.spaces import AssistantMessage, ChatMessages
from areal_agents.errors import ConfigError, UserError
from areal_agents.tools.tool import Tool, ToolResult

__all__ = ["AgentEnv", "EpisodeEnded", "as_assistant_message", "run_tool_calls", "tool_schemas"]

Message = dict[str, Any]


class EpisodeEnded(UserError, ResetNeeded):
    """``step`` was called before ``reset`` or after the episode ended."""


def as_assistant_message(action: Any) -> Message:
    """Normalize an action to an assistant message dict (a bare str becomes its content).

    Raises ``TypeError`` for anything that is not a str or a message dict.
    """
    if isinstance(action, str):
        return {"role": "assistant", "content": action}
    if not isinstance(action, Mapping):
        raise TypeError(f"expected an assistant message dict or a str, got {type(action).__name__}")
    message = dict(action)
    role = message.setdefault("role", "assistant")
    if role != "assistant":
        raise TypeError(f"expected an assistant message, got role {role!r}")
    message.setdefault("content", None)
    return message


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The OpenAI tool schemas of ``tools``."""
    return [tool.schema for tool in tools]


def _check_unique(tools: Sequence[Tool], env_name: str) -> None:
    names = [t.name for t in tools]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ConfigError(
            f"{env_name}: added tool(s) {clashes} have the name of one of the env's own "
            "tools; give the MCP server a 'prefix' (e.g. prefix: mcp_) or leave them out "
            "with its 'tools' list"
        )


def run_tool_calls(
    tool_calls: Sequence[Any], tools: Sequence[Tool]
) -> tuple[list[Message], list[dict[str, Any]]]:
    """Execute an assistant message's tool calls; never raises for model mistakes.

    Returns one ``tool`` message per call (in order) and the matching
    ``{"tool_call_id", "name", "error"}`` records.
    """
    by_name = {tool.name: tool for tool in tools}
    messages: list[Message] = []
    records: list[dict[str, Any]] = []
    for call in tool_calls:
        call_id, name, result = _run_one(call, by_name)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result.content})
        records.append({"tool_call_id": call_id, "name": name, "error": result.error})
    return messages, records


def _run_one(call: Any, by_name: Mapping[str, Tool]) -> tuple[str, str, ToolResult]:
    call_id = call.get("id") if isinstance(call, Mapping) else None
    call_id = call_id if isinstance(call_id, str) and call_id else f"call_{uuid.uuid4().hex[:12]}"
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        result = ToolResult(
            'Error: malformed tool call; expected {"id": ..., "type": "function", '
            '"function": {"name": ..., "arguments": "<JSON object>"}}',
            error="bad_tool_call",
        )
        return call_id, "", result
    tool = by_name.get(name)
    if tool is None:
        available = ", ".join(sorted(by_name)) or "none"
        result = ToolResult(
            f"Error: unknown tool {name!r}; available tools: {available}", error="unknown_tool"
        )
        return call_id, name, result
    assert isinstance(function, Mapping)
    return call_id, name, tool.call(function.get("arguments"))


class AgentEnv(gymnasium.Env[list[Message], Message]):
    """Base class of areal environments (see the module docstring for the contract).

    Args:
        max_turns: Number of assistant messages after which the episode is truncated.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's convention)
    observation_space: spaces.Space[list[Message]] = ChatMessages()
    action_space: spaces.Space[Message] = AssistantMessage()

    def __init__(self, *, max_turns: int = 8) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        self.max_turns = max_turns
        self.turns = 0
        self.messages: list[Message] = []
        self._active = False
        self._tools: list[Tool] = []
        self._added_tools: list[Tool] = []
        self._closers: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ hooks

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        """Pick the task (``options`` may hold ``task_id``/``task_index``; otherwise draw
        from ``self.np_random``) and return its first messages and info (``"task_id"``)."""
        raise NotImplementedError

    def num_tasks(self) -> int | None:
        """How many tasks ``reset(options={"task_index": i})`` picks from, or None when the
        env has no fixed pool (evaluation then draws tasks by seed, possibly repeating)."""
        return None

    def tools(self) -> list[Tool]:
        """The tools of the current episode, bound to its state (call after ``reset``),
        followed by those added with :meth:`add_tools` (MCP tools, say)."""
        return list(self._tools) + list(getattr(self, "_added_tools", ()))

    def add_tools(
        self, tools: Sequence[Tool], *, on_close: Callable[[], None] | None = None
    ) -> None:
        """Offer ``tools`` in every episode besides the env's own (after them, in order).

        ``on_close`` runs when the env is closed (ending a connection the tools use).
        ``envs.make(id, mcp=...)`` adds an MCP server's tools this way. A name that clashes
        with one of the env's own tools fails the next ``reset`` with a ``ConfigError``."""
        if not hasattr(self, "_added_tools"):  # a subclass that skipped AgentEnv.__init__
            self._added_tools, self._closers = [], []
        taken = {t.name for t in self._added_tools}
        for tool in tools:
            if tool.name in taken:
                raise ConfigError(f"tool {tool.name!r} is added twice; give one a 'prefix'")
            taken.add(tool.name)
        self._added_tools.extend(tools)
        if on_close is not None:
            self._closers.append(on_close)

    def close(self) -> None:
        """Release what :meth:`add_tools` asked to release; subclasses call ``super()``."""
        closers, self._closers = list(getattr(self, "_closers", ())), []
        for closer in closers:
            with contextlib.suppress(Exception):  # closing is best effort
                closer()
        super().close()

    def _respond(self, message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        """Answer an assistant message without tool calls.

        Returns (new messages, reward, terminated, info); set ``info["success"]`` when the
        task ends."""
        raise NotImplementedError

    def _tool_reward(self, message: Message, records: list[dict[str, Any]]) -> float:
        """Reward of a turn that made tool calls (0 by default)."""
        return 0.0

    def _tool_info(self, message: Message, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Extra ``info`` of a turn that made tool calls (after :meth:`_tool_reward`), e.g.
        ``{"state_key": ...}`` naming the state the turn leaves the episode in."""
        return {}

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a whole conversation produced by an agent's own loop.

        Returns (reward, info with ``"success"``). Subclasses override this. An env whose
        tool turns earn rewards when it is stepped (``_tool_reward``) returns the same ones
        here as ``info["tool_rewards"]`` (:meth:`tool_turn_rewards`), so that an agent's
        episode earns what the same conversation earns env-driven."""
        raise NotImplementedError(f"{type(self).__name__} does not implement score()")

    def tool_turn_rewards(self, messages: Sequence[Message]) -> dict[str, float]:
        """The rewards :meth:`_tool_reward` gives the tool turns of ``messages``, replayed
        in order: ``{id of the turn's first tool call: reward}`` for each nonzero one.

        The runner attaches each reward to the completion that made that call, as in an
        env-driven episode. A tool result counts as an error when its content starts with
        ``"Error"`` (what :func:`run_tool_calls` and the agent integrations report)."""
        results = {
            m.get("tool_call_id"): str(m.get("content") or "")
            for m in messages
            if m.get("role") == "tool"
        }
        out: dict[str, float] = {}
        for m in messages:
            calls = [c for c in m.get("tool_calls") or [] if isinstance(c, Mapping)]
            if m.get("role") != "assistant" or not calls:
                continue
            records = [
                {
                    "tool_call_id": c.get("id"),
                    "name": (c.get("function") or {}).get("name"),
                    "error": None
                    if c.get("id") in results and not results[c.get("id")].startswith("Error")
                    else "error",
                }
                for c in calls
            ]
            reward = self._tool_reward(dict(m), records)
            if reward and calls[0].get("id"):
                out[str(calls[0]["id"])] = float(reward)
        return out

    # ------------------------------------------------------------------ gymnasium API

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode; returns (the task's messages, info with "tools", "task_id")."""
        super().reset(seed=seed)
        self.turns = 0
        first, info = self._start(dict(options or {}))
        self.messages = [dict(m) for m in first]
        self._active = True
        info = dict(info)
        tools = self.tools()
        if getattr(self, "_added_tools", None):
            _check_unique(tools, type(self).__name__)
        info["tools"] = tool_schemas(tools)
        info["task_id"] = str(info.get("task_id", ""))
        return [dict(m) for m in first], info

    def step(
        self, action: Message | str
    ) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """Apply one assistant message; returns (new messages, reward, terminated,
        truncated, info)."""
        if not self._active:
            raise EpisodeEnded(
                "step() called before reset() or after the episode ended "
                "(terminated or truncated); call reset() to start a new episode"
            )
        message = as_assistant_message(action)
        self.messages.append(message)
        self.turns += 1
        calls = message.get("tool_calls") or []
        if isinstance(calls, Mapping):  # a single call not wrapped in a list
            calls = [calls]
        info: dict[str, Any]
        if calls:
            new, records = run_tool_calls(calls, self.tools())
            reward, terminated = self._tool_reward(message, records), False
            info = self._tool_info(message, records)
        else:
            new, reward, terminated, info = self._respond(message)
            records = []
        info = {"tool_results": records, **info}
        truncated = not terminated and self.turns >= self.max_turns
        if terminated or truncated:
            self._active = False
            info.setdefault("success", False)
        self.messages.extend(new)
        reward = float(reward)
        assert math.isfinite(reward), f"{type(self).__name__} produced a non-finite reward"
        return new, reward, bool(terminated), bool(truncated), info

    def render(self) -> None:
        """Print the conversation so far."""
        for message in self.messages:
            text = message.get("content") or json.dumps(message.get("tool_calls"))
            print(f"[{message['role']}] {text}")
