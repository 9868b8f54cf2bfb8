"""Group sources (trainer/rollout.py): one conformance test that every source passes, on a
scripted engine behind the real proxy, plus the pieces that only some sources have."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from areal_agents import ChatTokenizer, FakeEngine, Proxy, envs
from areal_agents.envs.base import AgentEnv
from areal_agents.rollout.runner import AgentTask, Runner
from areal_agents.serve.server import LoopServer
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.rollout import (
    AgentSource,
    EnvSource,
    ExternalSource,
    GroupSource,
    SourceSettings,
)

G, B = 3, 2


class Parity(AgentEnv):
    """One turn: reward = parity of the reply's length (so groups are rarely uniform)."""

    def _start(self, options):
        self.task = int(self.np_random.integers(1_000_000))
        return [{"role": "user", "content": f"Task {self.task}: say something."}], {
            "task_id": str(self.task)
        }

    def tools(self):
        return []

    def _respond(self, message):
        reward = float(len(message.get("content") or "") % 2)
        return [], reward, True, {"success": reward > 0}

    def score(self, messages):
        reward = float(len(messages[-1].get("content") or "") % 2)
        return reward, {"success": reward > 0}


envs.register("test/SourceParity-v0", Parity, description="rollout test", override=True)


def make_env() -> Any:
    return envs.make("test/SourceParity-v0")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ChatTokenizer.from_dir(tiny_model_dir)


def fake_engine(tokenizer: ChatTokenizer, delay_s: float = 0.0) -> FakeEngine:
    """Replies of 1-6 random words, ended by <|im_end|>."""
    end = tokenizer.token_id("<|im_end|>")
    rng = random.Random(0)

    def script(prompt_ids, params):
        words = " ".join("ab"[: rng.randint(1, 2)] for _ in range(rng.randint(1, 6)))
        return [*tokenizer.encode(words), end]

    return FakeEngine(script, delay_s=delay_s)


async def agent(task: AgentTask) -> str | None:
    """An in-process agent: one call through the session's OpenAI endpoint."""
    async with task.openai_client() as client:
        reply = await client.chat.completions.create(
            model=task.model, messages=task.messages, max_tokens=8
        )
    return reply.choices[0].message.content


def settings(**kw: Any) -> SourceSettings:
    return SourceSettings.of(**{"batch_size": B, "group_size": G, "eta": 0, **kw})


@contextlib.asynccontextmanager
async def source_of(kind: str, tokenizer, state: RunState, **kw: Any) -> AsyncIterator[Any]:
    """A started source of ``kind`` over a scripted engine, closed afterwards."""
    engine = fake_engine(tokenizer, delay_s=0.01)
    proxy = Proxy(engine, tokenizer, self_rewarding=kind != "external")
    s = settings(**kw)
    server = LoopServer(proxy)
    worker_task = None
    if kind == "env":
        src: GroupSource = EnvSource(s, state, Runner(proxy), make_env)
    else:
        runner = Runner(proxy, base_url=server.base_url)  # the source serves it from start()
        if kind == "agent":
            src = AgentSource(s, state, runner, make_env, agent, server)
        else:
            from areal_agents.client import AgentWorker
            from areal_agents.rollout.workers import WorkerHub

            hub = WorkerHub(proxy, "tok", heartbeat_timeout_s=5.0)
            src = ExternalSource(s, state, runner, make_env, hub, server)
            worker = AgentWorker(server.url, "tok", concurrency=8, wait_s=1.0)
    await src.start(version=state.step)
    if kind == "external":
        worker_task = asyncio.create_task(worker.serve(agent))
    try:
        yield src
    finally:
        await src.close()
        if worker_task is not None:
            worker_task.cancel()
            await asyncio.gather(worker_task, return_exceptions=True)


KINDS = ["env", "agent", "external"]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_source_yields_whole_groups_within_the_gate(kind, tokenizer, check_source):
    """Conformance (tests/conftest.py ``check_source``; tests/ray runs it on RaySource)."""
    state = RunState()
    async with source_of(kind, tokenizer, state) as src:
        await check_source(src, state, B, G)


@pytest.mark.parametrize("kind", KINDS)
async def test_every_source_redoes_unfinished_groups_first_after_a_resume(kind, tokenizer):
    """A checkpoint at step 1 that started groups 0-3, consumed 0 and skipped 2: with eta = 0
    the gate has room for (0 + 1 + 1) * 2 - 1 = 3 groups, and they are 1 and 3 again (with
    the tasks they had) and then the new group 4; 0 and 2 never come back. (Which of them
    finishes first is a race, so the batch is compared as a set.)"""
    state = RunState(step=1, next_group=4, consumed_groups=[0], skipped_groups=[2])
    async with source_of(kind, tokenizer, state) as src:
        got = await src.next_batch(3)
    assert sorted(g.number for g in got) == [1, 3, 4]
    assert state.next_group == 5
    fresh = RunState()
    async with source_of(kind, tokenizer, fresh, batch_size=5) as src:
        ref = {g.number: g for g in await src.next_batch(5)}
    for g in got:
        assert g.episodes[0].episode.task_id == ref[g.number].episodes[0].episode.task_id


@pytest.mark.parametrize("kind", KINDS)
async def test_every_source_closes_without_leaving_work_behind(kind, tokenizer):
    state = RunState()
    before = set(asyncio.all_tasks())
    async with source_of(kind, tokenizer, state, eta=3) as src:
        await src.next_batch(1)
    await asyncio.sleep(0.05)
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [asyncio.current_task()] or not left


async def test_a_producer_error_reaches_next_batch(tokenizer):
    """An error outside any episode (here: the env cannot be made) ends the run's wait with
    that error instead of waiting forever."""

    def broken() -> Any:
        raise RuntimeError("no env")

    proxy = Proxy(fake_engine(tokenizer), tokenizer)
    src = EnvSource(settings(), RunState(), Runner(proxy), broken)
    await src.start(version=0)
    with pytest.raises(Exception, match="no env"):
        await asyncio.wait_for(src.next_batch(1), 10)
    await src.close()


class Broken(Parity):
    """Resets, then fails on every reply: each episode ends as ``env_error``."""

    def _respond(self, message):
        raise ValueError("the env's database is gone")


envs.register("test/SourceBroken-v0", Broken, description="rollout test", override=True)


async def test_a_run_whose_every_episode_fails_stops_with_the_reason(tokenizer):
    """Failed episodes are counted and the run goes on, but not for ever: once every episode
    of ``failed_groups_to_stop`` groups in a row failed, the wait for a batch raises with the
    end reasons and the last error (it used to wait, generating failures, without end)."""
    from areal_agents.trainer.rollout import RolloutStalled

    proxy = Proxy(fake_engine(tokenizer), tokenizer)
    src = EnvSource(
        settings(), RunState(), Runner(proxy), lambda: envs.make("test/SourceBroken-v0")
    )
    src.failed_groups_to_stop = 3
    await src.start(version=0)
    with pytest.raises(RolloutStalled) as err:
        await asyncio.wait_for(src.next_batch(1), 30)
    message = str(err.value)
    assert "no episode of the last 3 groups ended normally (9 episodes: env_error x9)" in message
    assert "the env's database is gone" in message
    assert src.dropped["env_error"] >= 9  # each failure was counted on the way
    await src.close()


async def test_failed_groups_between_good_ones_do_not_stop_the_run(tokenizer):
    src = EnvSource(
        settings(), RunState(), Runner(Proxy(fake_engine(tokenizer), tokenizer)), make_env
    )
    src.failed_groups_to_stop = 2
    ok = await src.episodes(0, 1, 0)
    failed = [dataclasses.replace(ok[0], end_reason="env_error", error="boom")]
    src._failure = asyncio.get_running_loop().create_future()
    for results in (failed, ok, failed, ok, failed):
        src._check_progress(results)
    assert not src._failure.done()
    src._check_progress(failed)
    assert src._failure.done() and "the last 2 groups" in str(src._failure.exception())
