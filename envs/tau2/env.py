"""``Tau2Env``: tau²-style customer service (retail, airline) with a simulated user.

Registered as ``areal/Tau2Retail-v0`` and ``areal/Tau2Airline-v0``. One episode is one task:

1. ``reset`` gives the agent's system prompt (instructions and the domain policy), the
   agent's greeting and the simulated customer's first message; ``info["tools"]`` holds the
   domain's tools, bound to a private database for this episode.
2. ``step(assistant_message)``: tool calls run against the episode's database and each
   gives a ``tool`` message; a plain reply goes to the user simulator, whose answer is the
   next observation.
3. The episode ends (``terminated``) when the customer writes ``###STOP###``,
   ``###TRANSFER###`` or ``###OUT-OF-SCOPE###``, when the agent calls
   ``transfer_to_human_agents``, or when the agent writes ``###STOP###``. The final reward
   is the benchmark's (see :mod:`areal_agents.envs.tau2.reward`). It is ``truncated`` after
   ``max_turns`` assistant messages (reward 0).

A user-simulator failure is data, not an exception: the episode ends with reward 0 and
``info["error"] = {"kind": "env_error", "message": ...}``; a failure while producing the
first message is reported in ``reset``'s info and ends the episode at the first step.

Example:
    >>> from areal_agents.envs.tau2 import ScriptedUserSimulator, Tau2Env
    >>> env = Tau2Env("retail", user_simulator=ScriptedUserSimulator(["Hi", "###STOP###"]))
    >>> obs, info = env.reset(options={"task_id": "0"})  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from areal_agents.envs.base import AgentEnv
from areal_agents.envs.tau2.data import DOMAINS, Task
from areal_agents.envs.tau2.db import Database
from areal_agents.envs.tau2.domain import Domain, get_domain
from areal_agents.envs.tau2.generic import TRANSFER_TOOL
from areal_agents.envs.tau2.reward import RewardInfo, dense_write_credit, evaluate
from areal_agents.envs.tau2.user import GREETING, STOP, LLMUserSimulator, UserSimulator, stop_token
from areal_agents.errors import ConfigError, UserError

T = TypeVar("T")
Message = dict[str, Any]

AGENT_INSTRUCTIONS = """\
You are a customer-service agent. Help the user according to the policy below.
In each turn, either send a message to the user or make tool calls, not both.
Follow the policy strictly and always write tool arguments as valid JSON."""

_SPLITS = (None, "train", "test", "base")
_TOKEN_REASONS = {"###STOP###": "user_stop", "###TRANSFER###": "transfer"}


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, inside or outside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="tau2-user-simulator")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class Tau2Env(AgentEnv):
    """A tau² customer-service domain as an agent env (see the module docstring).

    Args:
        domain: ``"retail"`` or ``"airline"``.
        split: ``"train"``, ``"test"`` (the benchmark's ``split_tasks.json``), ``"base"`` or
            ``None`` (all tasks).
        user_simulator: Plays the customer: an
            :class:`~areal_agents.envs.tau2.user.LLMUserSimulator`, a
            :class:`~areal_agents.envs.tau2.user.ProxyUserSimulator` or a
            :class:`~areal_agents.envs.tau2.user.ScriptedUserSimulator`. Required before
            ``reset`` unless ``user_base_url`` is given.
        user_base_url: Instead of ``user_simulator`` (for settings that are plain data:
            ``--env-kwargs``, ``env.kwargs``): an OpenAI-compatible base URL whose model
            plays the customer (an ``LLMUserSimulator``). When neither is given,
            ``areal-agent eval`` lets the served model play the customer and ``areal-agent
            train`` the run's own model (a ``ProxyUserSimulator``); neither is recorded.
        user_model: The model name to request there; ``None``: the first one it lists.
            Only with ``user_base_url``.
        user_api_key: Its API key (``None``: ``"EMPTY"``). Only with ``user_base_url``.
        user_max_tokens: Cap on each customer message (``None``: the server's default).
            Not with ``user_simulator`` (``areal-agent train`` applies it to the run's own
            model as the customer).
        max_turns: Assistant messages after which the episode is truncated.
        dense_reward: Add per-turn shaping for writes that match gold write actions.
        dense_weight: Total shaping an episode can earn when ``dense_reward`` is on.
    """

    def __init__(
        self,
        domain: str = "retail",
        split: str | None = None,
        user_simulator: UserSimulator | None = None,
        max_turns: int = 50,
        dense_reward: bool = False,
        dense_weight: float = 0.1,
        user_base_url: str | None = None,
        user_model: str | None = None,
        user_api_key: str | None = None,
        user_max_tokens: int | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns)
        if user_base_url is not None and user_simulator is not None:
            raise ConfigError(
                "Tau2Env: give user_simulator or user_base_url, not both (user_base_url "
                "builds an LLMUserSimulator)"
            )
        stray = [n for n, v in (("user_model", user_model), ("user_api_key", user_api_key)) if v]
        if user_base_url is None and stray:
            raise ConfigError(
                f"Tau2Env: {' and '.join(stray)} without user_base_url: they go with the "
                "customer's endpoint (user_base_url='http://HOST:PORT/v1'); give "
                "user_base_url too, or drop them"
            )
        if user_simulator is not None and user_max_tokens is not None:
            raise ConfigError(
                "Tau2Env: user_max_tokens caps the customer built from user_base_url; with "
                "user_simulator, set the cap on the simulator (max_tokens=) and drop it"
            )
        if user_base_url is not None:
            if not isinstance(user_base_url, str) or not user_base_url.startswith("http"):
                raise ConfigError(
                    "Tau2Env: user_base_url must be an http(s) URL of an OpenAI-compatible "
                    f"endpoint, e.g. 'http://127.0.0.1:8000/v1', got {user_base_url!r}"
                )
            user_simulator = LLMUserSimulator(
                user_base_url, user_api_key, user_model, max_tokens=user_max_tokens
            )
        if domain not in DOMAINS:
            raise ConfigError(f"Tau2Env: expected domain in {DOMAINS}, got {domain!r}")
        if split not in _SPLITS:
            raise ConfigError(f"Tau2Env: expected split in {_SPLITS}, got {split!r}")
        if user_simulator is not None and not isinstance(user_simulator, UserSimulator):
            raise ConfigError(
                "Tau2Env: user_simulator must be a UserSimulator (LLMUserSimulator or "
                f"ScriptedUserSimulator), got {type(user_simulator).__name__}"
            )
        self.domain_name = domain
        self.split = split
        self.user_simulator = user_simulator
        self.dense_reward = dense_reward
        self.dense_weight = dense_weight
        self.task: Task | None = None
        self.db: Database | None = None
        self.result: RewardInfo | None = None
        self._matched: set[int] = set()
        self._transferred = False
        self._error: dict[str, str] | None = None

    @property
    def domain(self) -> Domain:
        """The domain (its data is loaded, and downloaded if needed, on first use)."""
        return get_domain(self.domain_name)

    def task_ids(self) -> tuple[str, ...]:
        """The ids of the tasks this env draws from (its split)."""
        return self.domain.data.task_ids(self.split)

    # ------------------------------------------------------------------ AgentEnv hooks

    def num_tasks(self) -> int:
        return len(self.task_ids())

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        if self.user_simulator is None:
            raise ConfigError(
                "Tau2Env needs a user simulator: give user_base_url='http://HOST:PORT/v1' "
                "(any OpenAI-compatible endpoint plays the customer; areal-agent train and "
                "areal-agent eval use the run's own model by default, or "
                "env.kwargs.user_base_url / --user-model URL), or pass "
                "user_simulator=LLMUserSimulator(...), ProxyUserSimulator(proxy) or "
                "ScriptedUserSimulator([...]) to the constructor or to make()"
            )
        domain = self.domain
        self.task = domain.data.task(self._pick_task(options))
        self.db = domain.new_database()
        self._tools = domain.tools(self.db)
        self._matched, self._transferred, self._error, self.result = set(), False, None, None
        system = f"{AGENT_INSTRUCTIONS}\n\n<policy>\n{domain.data.policy}\n</policy>"
        greeting: Message = {"role": "assistant", "content": GREETING}
        messages: list[Message] = [{"role": "system", "content": system}, greeting]
        info: dict[str, Any] = {"task_id": self.task.id, "domain": domain.name, "split": self.split}
        reply = self._ask_user([greeting])
        if reply is not None:
            messages.append({"role": "user", "content": reply})
        else:
            info["error"] = dict(self._error or {})
        return messages, info

    def _pick_task(self, options: Mapping[str, Any]) -> str:
        ids = self.task_ids()
        if options.get("task_id") is not None:
            task_id = str(options["task_id"])
            if task_id not in ids:
                raise UserError(
                    f"task_id {task_id!r} is not in tau2 {self.domain_name} split "
                    f"{self.split!r} ({len(ids)} tasks, e.g. {list(ids[:5])})"
                )
            return task_id
        if options.get("task_index") is not None:
            index = options["task_index"]
            if not isinstance(index, int) or not -len(ids) <= index < len(ids):
                raise UserError(f"task_index must be an int in [0, {len(ids)}), got {index!r}")
            return ids[index]
        return ids[int(self.np_random.integers(len(ids)))]

    def _respond(self, message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        if self._error is not None:  # the user simulator failed at reset
            return [], 0.0, True, self._finish("env_error", completed=False)
        if STOP in str(message.get("content") or ""):
            return [], 0.0, True, self._finish("agent_stop")
        reply = self._ask_user(self._dialogue())
        if reply is None:
            return [], 0.0, True, self._finish("env_error", completed=False)
        new = [{"role": "user", "content": reply}]
        token = stop_token(reply)
        if token is None:
            return new, 0.0, False, {}
        info = self._finish(_TOKEN_REASONS.get(token, "out_of_scope"))
        return new, float(info["final_reward"]), True, info

    def _tool_reward(self, message: Message, records: list[dict[str, Any]]) -> float:
        calls = {c.get("id"): c for c in message.get("tool_calls") or [] if isinstance(c, dict)}
        reward = 0.0
        for record in records:
            if record["error"] is not None:
                continue
            if record["name"] == TRANSFER_TOOL:
                self._transferred = True
            if self.dense_reward and self.task is not None:
                function = calls.get(record["tool_call_id"], {}).get("function") or {}
                reward += dense_write_credit(
                    self.domain,
                    self.task,
                    record["name"],
                    function.get("arguments"),
                    self._matched,
                    weight=self.dense_weight,
                )
        return reward

    def step(
        self, action: Message | str
    ) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """Apply one assistant message (see the module docstring for how episodes end)."""
        self._transferred = False
        obs, reward, terminated, truncated, info = super().step(action)
        if self._error is not None and not terminated:  # the user simulator failed at reset
            self._active = False
            info.update(self._finish("env_error", completed=False))
            return obs, reward, True, False, info
        if self._transferred and not terminated:
            self._active = False
            info.update(self._finish("transfer"))
            return obs, reward + float(info["final_reward"]), True, False, info
        if truncated and not terminated:
            info.update(self._finish("max_turns", completed=False))
        return obs, reward, terminated, truncated, info

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a conversation an agent ran itself with :meth:`tools` (after ``reset``).

        The database is this episode's, as the agent's tool calls left it; the messages
        matter only for the ``COMMUNICATE`` check.
        """
        if self.task is None or self.db is None:
            raise UserError("score() needs an episode: call reset() first, then run the tools")
        result = evaluate(self.domain, self.task, self.db, messages)
        return result.reward, {"success": result.reward == 1.0, "reward_info": result.as_dict()}

    # ------------------------------------------------------------------ helpers

    def _dialogue(self) -> list[Message]:
        """The conversation as the customer sees it: text messages, no tool traffic."""
        return [
            {"role": m["role"], "content": m.get("content")}
            for m in self.messages
            if m.get("role") in ("assistant", "user")
            and not m.get("tool_calls")
            and m.get("content")
        ]

    def _ask_user(self, dialogue: list[Message]) -> str | None:
        """The user simulator's reply, or ``None`` with ``self._error`` set if it failed."""
        assert self.task is not None and self.user_simulator is not None
        try:
            reply = _run_sync(self.user_simulator.respond(self.task, dialogue))
        except Exception as exc:
            self._error = {"kind": "env_error", "message": f"{type(exc).__name__}: {exc}"}
            return None
        if not isinstance(reply, str):
            self._error = {
                "kind": "env_error",
                "message": f"user simulator returned {type(reply).__name__}, expected str",
            }
            return None
        return reply

    def _finish(self, reason: str, *, completed: bool = True) -> dict[str, Any]:
        """End-of-episode info: score the episode and say why it ended."""
        assert self.task is not None and self.db is not None
        note = "" if completed else f"ended by {reason}"
        self.result = evaluate(
            self.domain, self.task, self.db, self.messages, completed=completed, note=note
        )
        info: dict[str, Any] = {
            "termination": reason,
            "success": self.result.reward == 1.0,
            "final_reward": self.result.reward,
            "reward_info": self.result.as_dict(),
        }
        if self._error is not None:
            info["error"] = dict(self._error)
        return info
