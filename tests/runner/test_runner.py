"""The episode runner: env-driven and agent-driven episodes through a proxy, failures as data."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest

from areal_agents import envs  # noqa: F401  (registers the built-in envs)
from areal_agents.envs.base import AgentEnv
from areal_agents.envs.math import CalculatorEnv
from areal_agents.rollout.runner import Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.tools.tool import ToolResult, function_tool


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def solver(tok: ChatTokenizer, *, wrong_first: bool = False):
    """A scripted policy: call the calculator on the question's expression, then answer.

    It reads the prompt (decoded) to decide, like a model would; with ``wrong_first`` the
    first answer is off by one (to exercise retry feedback).
    """
    end = tok.token_id("<|im_end|>")
    answers: dict[str, int] = {}

    def script(prompt_ids, params):
        text = tok.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            value = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S)[-1]
            key = text[:200]
            n = answers.get(key, 0)
            answers[key] = n + 1
            shown = str(int(float(value)) + 1) if wrong_first and n == 0 else value
            reply = f"The answer is {shown}."
        elif "not correct" in last_user:
            value = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)[-1]
            reply = f"The answer is {value}."
        else:
            question = last_user.split("<|im_end|>")[0]
            expr = re.findall(r"[\d][\d\s\+\-\*/\(\)\.]*[\d\)]", question)
            expr = max(expr, key=len) if expr else "1+1"
            call = {"name": "calculator", "arguments": {"expression": expr}}
            reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return [*tok.encode(reply), end]

    return script


async def tool_agent(task):
    """An agent's own loop on the plain openai client: call the model with the task's tools,
    run the tool calls, until a reply without calls (its content is the final answer)."""
    client = task.openai_client()
    messages, by_name = list(task.messages), {t.name: t for t in task.tools}
    for _ in range(4):
        r = await client.chat.completions.create(
            model=task.model, messages=messages, tools=[t.schema for t in task.tools]
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            out: ToolResult = await by_name[call.function.name].acall(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.content})
    return None


async def test_env_driven_episode_records_per_turn_rewards(tok):
    proxy = Proxy(FakeEngine(solver(tok, wrong_first=True)), tok)
    runner = Runner(proxy, max_turns=6)

    def make():
        return CalculatorEnv(
            split="test", kind="arithmetic", max_attempts=2, tool_call_reward=0.1, wrong_reward=-0.5
        )

    res = await runner.run_episode(make, seed=3)
    assert res.end_reason == "terminated", res.error
    assert res.success is True
    ep = res.episode
    # turns: tool call (+0.1), wrong answer (-0.5, feedback), correct answer (+1.0)
    assert [c.reward for c in ep.completions] == pytest.approx([0.1, -0.5, 1.0])
    assert res.reward == pytest.approx(0.6)
    assert [c.parent_id for c in ep.completions] == [
        None,
        ep.completions[0].id,
        ep.completions[1].id,
    ]
    # G3 = 1.0 ; G2 = -0.5 + 0.9 * 1.0 = 0.4 ; G1 = 0.1 + 0.9 * 0.4 = 0.46
    g = ep.returns(gamma=0.9)
    assert [g[c.id] for c in ep.completions] == pytest.approx([0.46, 0.4, 1.0])
    assert len(proxy.sessions) == 0  # the runner does not leak sessions


async def test_group_shares_group_id_and_task(tok):
    proxy = Proxy(FakeEngine(solver(tok)), tok)
    runner = Runner(proxy)
    results = await runner.run_group(
        lambda: CalculatorEnv(split="test", kind="arithmetic"), 4, seed=11
    )
    assert len({r.episode.group_id for r in results}) == 1
    assert len({r.episode.task_id for r in results}) == 1
    assert all(r.success for r in results)


class _FlakyToolEnv(AgentEnv):
    """Episode k's tool dies (raises inside env.step) when k is in ``broken``."""

    broken: ClassVar[set[int]] = set()

    def __init__(self, index: int) -> None:
        super().__init__(max_turns=4)
        self.index = index

    def _start(self, options):
        return [{"role": "user", "content": "What is 2+3?"}], {"task_id": "t"}

    def tools(self):
        @function_tool
        def calculator(expression: str) -> str:
            """Evaluate arithmetic.

            Args:
                expression: the expression.
            """
            return "5"

        return [calculator]

    def step(self, action):
        if self.index in self.broken:
            raise RuntimeError("tool process was killed")
        return super().step(action)

    def _respond(self, message):
        return [], 1.0, True, {"success": True}


async def test_failing_env_step_is_a_counted_reason_and_others_finish(tok):
    proxy = Proxy(FakeEngine(solver(tok)), tok)
    runner = Runner(proxy)
    _FlakyToolEnv.broken = {2}
    counter = iter(range(100))
    results = await runner.run_group(lambda: _FlakyToolEnv(next(counter)), 5)
    reasons = sorted(r.end_reason for r in results)
    assert reasons == ["env_error", "terminated", "terminated", "terminated", "terminated"]
    bad = next(r for r in results if r.end_reason == "env_error")
    assert "tool process was killed" in bad.error
    assert bad.episode.errors[0]["kind"] == "env_error"
    assert bad.episode.completions, "the completion before the failure is kept"


async def test_episode_timeout_and_model_failure_are_recorded(tok):
    slow = Proxy(FakeEngine(solver(tok), delay_s=0.5), tok)
    res = await Runner(slow, episode_timeout_s=0.1).run_episode(lambda: CalculatorEnv())
    assert res.end_reason == "timeout" and "0.1 s" in res.error

    def broken(prompt_ids, params):
        raise RuntimeError("CUDA out of memory")

    res = await Runner(Proxy(FakeEngine(broken), tok)).run_episode(lambda: CalculatorEnv())
    assert res.end_reason == "backend_error" and "out of memory" in res.error


async def test_agent_driven_episode_is_scored_by_env(tok):
    from areal_agents.serve.server import ProxyServer

    proxy = Proxy(FakeEngine(solver(tok)), tok)
    with ProxyServer.start(proxy) as server:
        runner = Runner(proxy, base_url=server.base_url)

        res = await runner.run_episode(
            lambda: CalculatorEnv(split="test", kind="arithmetic"), seed=5, agent=tool_agent
        )
    assert res.end_reason == "terminated", res.error
    assert res.success is True and res.reward == pytest.approx(1.0)
    assert len(res.episode.completions) == 2
    assert res.episode.returns(1.0)[res.episode.completions[0].id] == pytest.approx(1.0)


async def test_evaluation_tasks_are_distinct_pool_entries(tok):
    """`areal-agent eval` walks a seeded permutation of the env's pool: 24 tasks of a
    24-task pool are the whole pool once; more tasks than the pool repeat it, reshuffled;
    an env without a fixed pool falls back to seeds."""
    from areal_agents.rollout.evaluate import evaluate, task_indices

    proxy = Proxy(FakeEngine(solver(tok)), tok)
    runner = Runner(proxy)

    def make():
        return CalculatorEnv(split="test", kind="arithmetic", num_tasks=24)

    report, groups = await evaluate(runner, make, env_id="calc", episodes=24, seed=5)
    ids = [g[0].episode.task_id for g in groups]
    assert sorted(ids) == sorted(make().pool[i].task_id for i in range(24))
    assert report.distinct_tasks == 24 and report.episodes == 24
    assert "distinct tasks" in report.table()
    # seeded: the same seed gives the same order, another seed another one
    assert task_indices(make, 24, 5) == task_indices(make, 24, 5)
    assert task_indices(make, 24, 5) != task_indices(make, 24, 6)
    # more tasks than the pool holds: every entry once, then again
    forty = task_indices(make, 40, 0)
    assert forty is not None and sorted(forty[:24]) == list(range(24))
    assert len(set(forty[24:])) == 16
    # an env with no fixed pool: seeds pick the tasks
    assert task_indices(lambda: _FlakyToolEnv(0), 4, 0) is None


async def test_sampling_by_kind_overrides_per_task_kind(tok):
    seen: list[float] = []

    def script(prompt_ids, params):
        seen.append(params.temperature)
        return solver(tok)(prompt_ids, params)

    runner = Runner(
        Proxy(FakeEngine(script), tok),
        sampling={"temperature": 0.7, "max_tokens": 64},
        sampling_by_kind={"arithmetic": {"temperature": 1.0}},
    )

    def make():
        return CalculatorEnv(split="test", kind="mixed", word_fraction=0.5)

    results = [await runner.run_episode(make, seed=s) for s in range(8)]
    kinds = {r.info["task"]["kind"] for r in results}
    assert kinds == {"arithmetic", "word"}  # both kinds drawn
    for r in results:
        want = 1.0 if r.info["task"]["kind"] == "arithmetic" else 0.7
        assert r.episode.completions, r.error
        assert [c.sampling["temperature"] for c in r.episode.completions] == [want] * len(
            r.episode.completions
        )
    assert sorted(set(seen)) == [0.7, 1.0]  # what the engine was asked for


async def test_agent_calls_that_set_no_sampling_get_the_runs_per_kind_defaults(tok):
    """An agent that leaves sampling to the server samples as the run says (per task kind);
    what its calls do set wins."""
    from areal_agents.serve.server import ProxyServer

    proxy = Proxy(FakeEngine(solver(tok)), tok)
    with ProxyServer.start(proxy) as server:
        runner = Runner(
            proxy,
            base_url=server.base_url,
            sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 48},
            sampling_by_kind={"arithmetic": {"temperature": 1.0}},
        )

        def agent_setting(temperature: float | None):
            async def agent(task):
                client = task.openai_client()
                extra = {} if temperature is None else {"temperature": temperature}
                r = await client.chat.completions.create(
                    model=task.model, messages=list(task.messages), **extra
                )
                return r.choices[0].message.content

            return agent

        def make():
            return CalculatorEnv(split="test", kind="mixed", word_fraction=0.5)

        unset = [
            await runner.run_episode(make, seed=s, agent=agent_setting(None)) for s in range(8)
        ]
        fixed = await runner.run_episode(make, seed=0, agent=agent_setting(0.25))
    assert {r.info["task"]["kind"] for r in unset} == {"arithmetic", "word"}
    for r in unset:
        (call,) = r.episode.completions
        want = 1.0 if r.info["task"]["kind"] == "arithmetic" else 0.7
        assert call.sampling["temperature"] == want, r.error
        assert call.sampling["top_p"] == 0.9
    (call,) = fixed.episode.completions
    assert call.sampling["temperature"] == 0.25 and call.sampling["top_p"] == 0.9


async def test_an_agents_episode_earns_the_tool_rewards_an_env_driven_one_does(tok):
    """score() replays the tool turns: the grounded-call credit of the calculator env lands
    on the completion that made the call, and the episode's total equals env-driven's."""
    from areal_agents.serve.server import ProxyServer

    def make():
        return CalculatorEnv(
            split="test", kind="arithmetic", grounded_call_reward=0.1, grounded_ops_reward=0.3
        )

    proxy = Proxy(FakeEngine(solver(tok)), tok)
    driven = await Runner(proxy).run_episode(make, seed=5)
    with ProxyServer.start(proxy) as server:
        runner = Runner(proxy, base_url=server.base_url)

        agentic = await runner.run_episode(make, seed=5, agent=tool_agent)
    assert driven.success and agentic.success, (driven.error, agentic.error)
    assert agentic.reward == pytest.approx(driven.reward) == pytest.approx(1.4)
    first = agentic.episode.completions[0]
    assert first.message["tool_calls"] and first.reward == pytest.approx(0.4)
    assert agentic.info["tool_rewards"] == {first.message["tool_calls"][0]["id"]: 0.4}
    assert agentic.episode.final_reward == pytest.approx(1.0)
