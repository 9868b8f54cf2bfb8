"""Conformance checker for agent envs: ``check_env(env, seed=0)``.

Runs a few short episodes with scripted actions and checks the contract of
:mod:`areal_agents.envs.base`:

1. ``reset`` returns (a list of chat messages, info with ``"tools"`` and ``"task_id"``),
   and the observation is in ``observation_space``;
2. the tool schemas are valid OpenAI function schemas with unique names, and ``tools()``
   returns :class:`tools.Tool` objects with the same names;
3. ``reset`` with the same seed gives the same messages and task id;
4. a turn calling an unknown tool, and one with malformed JSON arguments, each give an
   ``"Error..."`` tool message with the right ``tool_call_id`` and an error in
   ``info["tool_results"]``, without raising;
5. a plain answer gives a finite float reward and bool ``terminated``/``truncated``;
6. plain answers end the episode within ``max_turns`` steps, with ``info["success"]``;
7. ``step`` after the end raises a clear error (``gymnasium.error.ResetNeeded`` or an
   :class:`areal_agents.errors.UserError`);
8. ``score(messages)`` on the finished conversation returns (finite float, info with a bool
   ``"success"``).

Every failed check is collected; :class:`EnvCheckError` lists them all.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from gymnasium.error import ResetNeeded

from areal_agents.envs.registry import make
from areal_agents.envs.spaces import message_problem
from areal_agents.errors import UserError
from areal_agents.tools.tool import Tool

__all__ = ["EnvCheckError", "check_env"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PLAIN_ANSWER = {"role": "assistant", "content": "I am not sure. The answer is 0."}


class EnvCheckError(AssertionError):
    """An env broke the agent-env contract; ``problems`` lists every failed check."""

    def __init__(self, env_name: str, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{env_name} failed {len(self.problems)} conformance check(s):\n{lines}")


class _Checker:
    def __init__(self, env: Any, seed: int) -> None:
        self.env = env
        self.seed = seed
        self.problems: list[str] = []

    def expect(self, condition: bool, problem: str) -> bool:
        if not condition:
            self.problems.append(problem)
        return condition

    def guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            self.problems.append(f"{what} raised {type(exc).__name__}: {exc}")
            return None

    # ---------------------------------------------------------------- checks

    def check_reset(self) -> tuple[Any, dict[str, Any]] | None:
        out = self.guarded("reset(seed=...)", lambda: self.env.reset(seed=self.seed))
        if out is None:
            return None
        if not self.expect(
            isinstance(out, tuple) and len(out) == 2, "reset must return (obs, info)"
        ):
            return None
        obs, info = out
        self.check_messages(obs, "reset observation")
        self.expect(self.env.observation_space.contains(obs), "observation_space rejects reset obs")
        if not self.expect(isinstance(info, dict), "reset info must be a dict"):
            return None
        self.expect(isinstance(info.get("task_id"), str), "reset info needs a str 'task_id'")
        if self.expect(isinstance(info.get("tools"), list), "reset info needs a list 'tools'"):
            for schema in info["tools"]:
                self.check_tool_schema(schema)
            names = [
                s.get("function", {}).get("name") for s in info["tools"] if isinstance(s, dict)
            ]
            self.expect(len(names) == len(set(names)), f"duplicate tool names: {names}")
        return obs, info

    def check_messages(self, obs: Any, what: str) -> None:
        if not self.expect(isinstance(obs, list), f"{what} must be a list of messages"):
            return
        for message in obs:
            problem = message_problem(message)
            self.expect(problem is None, f"{what}: {problem}: {message!r:.120}")

    def check_tool_schema(self, schema: Any) -> None:
        fn = schema.get("function") if isinstance(schema, dict) else None
        ok = isinstance(fn, dict) and schema.get("type") == "function"
        if not self.expect(
            ok, f"tool schema must be {{'type': 'function', 'function': ...}}: {schema!r:.120}"
        ):
            return
        assert isinstance(fn, dict)
        name = fn.get("name")
        self.expect(isinstance(name, str) and bool(_NAME_RE.match(name)), f"bad tool name {name!r}")
        self.expect(
            isinstance(fn.get("description"), str), f"tool {name!r} needs a str description"
        )
        params = fn.get("parameters")
        if not self.expect(
            isinstance(params, dict) and params.get("type") == "object",
            f"tool {name!r} parameters must be a JSON schema of type 'object'",
        ):
            return
        assert isinstance(params, dict)
        props = params.get("properties", {})
        self.expect(isinstance(props, dict), f"tool {name!r} 'properties' must be a dict")
        missing = set(params.get("required", [])) - set(props)
        self.expect(not missing, f"tool {name!r} requires undeclared properties {sorted(missing)}")
        self.expect(_json_roundtrips(schema), f"tool {name!r} schema is not JSON-serializable")

    def check_tools_method(self, info: dict[str, Any]) -> None:
        tools = self.guarded("tools()", self.env.tools)
        if tools is None:
            return
        ok = isinstance(tools, list) and all(isinstance(t, Tool) for t in tools)
        if self.expect(ok, "tools() must return a list of tools.Tool"):
            names = sorted(t.name for t in tools)
            schema_names = sorted(s["function"]["name"] for s in info.get("tools", []))
            self.expect(
                names == schema_names, f"tools() names {names} != info['tools'] {schema_names}"
            )

    def check_determinism(self, first: tuple[Any, Any]) -> None:
        again = self.guarded("reset(seed=...) again", lambda: self.env.reset(seed=self.seed))
        if again is None:
            return
        self.expect(again[0] == first[0], "reset with the same seed gave different messages")
        self.expect(
            again[1].get("task_id") == first[1].get("task_id"),
            "reset with the same seed gave a different task_id",
        )

    def check_step_output(self, out: Any, what: str) -> bool:
        if not self.expect(
            isinstance(out, tuple) and len(out) == 5, f"{what}: step must return 5 values"
        ):
            return False
        obs, reward, terminated, truncated, info = out
        self.check_messages(obs, f"{what} observation")
        self.expect(
            isinstance(reward, float) and math.isfinite(reward),
            f"{what}: reward must be a finite float, got {reward!r}",
        )
        self.expect(
            type(terminated) is bool and type(truncated) is bool,
            f"{what}: terminated/truncated must be bools, got {terminated!r}, {truncated!r}",
        )
        if self.expect(isinstance(info, dict), f"{what}: info must be a dict"):
            self.expect(
                isinstance(info.get("tool_results"), list), f"{what}: info needs 'tool_results'"
            )
            if terminated or truncated:
                self.expect(
                    isinstance(info.get("success"), bool),
                    f"{what}: info needs a bool 'success' when the episode ends",
                )
        return True

    def check_bad_tool_call(self, label: str, name: str, arguments: str) -> None:
        self.guarded("reset", lambda: self.env.reset(seed=self.seed))
        call_id = f"call_check_{label.replace(' ', '_')}"
        action = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        }
        out = self.guarded(f"step with {label}", lambda: self.env.step(action))
        if out is None or not self.check_step_output(out, f"step with {label}"):
            return
        replies = [m for m in out[0] if isinstance(m, dict) and m.get("tool_call_id") == call_id]
        if self.expect(len(replies) == 1, f"{label}: expected one tool message for {call_id}"):
            text = str(replies[0].get("content", ""))
            self.expect(
                text.startswith("Error"),
                f"{label}: tool message should start with 'Error', got {text!r:.80}",
            )
        errors = [r.get("error") for r in out[4].get("tool_results", []) if isinstance(r, dict)]
        self.expect(any(errors), f"{label}: info['tool_results'] should record the error")

    def check_episode_end(self) -> list[dict[str, Any]] | None:
        reset = self.guarded("reset", lambda: self.env.reset(seed=self.seed))
        if reset is None:
            return None
        messages = list(reset[0])
        max_turns = getattr(self.env, "max_turns", None)
        self.expect(isinstance(max_turns, int), "env needs an int attribute 'max_turns'")
        limit = max_turns if isinstance(max_turns, int) else 50
        for turn in range(1, limit + 1):
            out = self.guarded(
                f"step {turn} with a plain answer", lambda: self.env.step(dict(_PLAIN_ANSWER))
            )
            if out is None or not self.check_step_output(out, f"plain answer (step {turn})"):
                return None
            messages += [dict(_PLAIN_ANSWER), *out[0]]
            if out[2] or out[3]:
                return messages
        self.problems.append(f"episode did not end within max_turns={limit} steps")
        return None

    def check_step_after_end(self) -> None:
        try:
            self.env.step(dict(_PLAIN_ANSWER))
        except (ResetNeeded, UserError) as exc:
            self.expect(bool(str(exc)), "the error for stepping after the end needs a message")
        except Exception as exc:
            self.problems.append(
                "step after the end should raise gymnasium.error.ResetNeeded or a UserError, "
                f"got {type(exc).__name__}: {exc}"
            )
        else:
            self.problems.append("step after the end of the episode did not raise")

    def check_score(self, messages: list[dict[str, Any]]) -> None:
        out = self.guarded("score(messages)", lambda: self.env.score(messages))
        if out is None:
            return
        ok = isinstance(out, tuple) and len(out) == 2
        if self.expect(ok, "score must return (reward, info)"):
            reward, info = out
            self.expect(
                isinstance(reward, float) and math.isfinite(reward),
                f"score reward must be a finite float, got {reward!r}",
            )
            self.expect(
                isinstance(info, dict) and isinstance(info.get("success"), bool),
                "score info needs a bool 'success'",
            )


def _json_roundtrips(value: Any) -> bool:
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


def check_env(env: Any, seed: int = 0) -> None:
    """Check that ``env`` (an env or a registered id) follows the agent-env contract.

    Raises:
        EnvCheckError: listing every failed check.
    """
    if isinstance(env, str):
        env = make(env)
    checker = _Checker(env, seed)
    first = checker.check_reset()
    if first is not None:
        info = first[1]
        checker.check_tools_method(info)
        checker.check_determinism(first)
        tool_names = [s["function"]["name"] for s in info.get("tools", []) if "function" in s]
        checker.check_bad_tool_call("an unknown tool", "no_such_tool_xyz", "{}")
        if tool_names:
            checker.check_bad_tool_call("malformed JSON arguments", tool_names[0], '{"oops": ')
        messages = checker.check_episode_end()
        if messages is not None:
            checker.check_step_after_end()
            checker.check_score(messages)
    if checker.problems:
        raise EnvCheckError(type(env).__name__, checker.problems)
