"""Issue 48: the normal end of an external run, against a real loopback server. The source
closes the worker hub and the server before the episode store, so the workers' calls still
in flight get the documented answers (409 ``session_ended`` for a model call of a cut
episode, 503 for a long-poll), never a 500 from a closed store."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from areal_agents import ChatTokenizer, FakeEngine, Proxy, envs
from areal_agents.envs.base import AgentEnv
from areal_agents.rollout.runner import Runner
from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.server import LoopServer
from areal_agents.serve.store import EpisodeStore
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.rollout import ExternalSource, SourceSettings

TOKEN = "wtok-shutdown-48"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Echo(AgentEnv):
    def _start(self, options):
        return [{"role": "user", "content": "Say something."}], {"task_id": "echo"}

    def tools(self):
        return []

    def _respond(self, message):
        return [], float(len(message.get("content") or "") % 2), True, {}

    def score(self, messages):
        return float(len(messages[-1].get("content") or "") % 2), {}


envs.register("test/ShutdownEcho-v0", Echo, description="shutdown test", override=True)


def slow_engine(tok: ChatTokenizer, delay_s: float) -> FakeEngine:
    end, rng = tok.token_id("<|im_end|>"), random.Random(0)
    assert end is not None

    def script(prompt_ids: Any, params: Any) -> list[int]:
        return [*tok.encode("ab " * rng.randint(1, 4)), end]

    return FakeEngine(script, delay_s=delay_s)


async def test_calls_in_flight_at_the_end_of_an_external_run_get_409_or_503(
    tiny_model_dir, tmp_path
):
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    store = EpisodeStore(tmp_path / "episodes.db")
    proxy = Proxy(
        slow_engine(tok, delay_s=1.5),
        tok,
        self_rewarding=False,
        open_sessions=False,
        store=store,
        restore=False,
    )
    hub = WorkerHub(proxy, TOKEN, heartbeat_timeout_s=30.0)
    server = LoopServer(proxy)
    runner = Runner(proxy, base_url=server.base_url)
    settings = SourceSettings.of(batch_size=1, group_size=2, eta=0)
    source = ExternalSource(
        settings, RunState(), runner, lambda: envs.make("test/ShutdownEcho-v0"), hub, server
    )
    source.store = store
    await source.start(version=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        tasks = [
            (await c.post("/workers/tasks/next", json={"wait_s": 10}, headers=AUTH)).json()
            for _ in range(2)  # the gate's one group: its two episodes
        ]
        key = {"Authorization": f"Bearer {tasks[0]['session']['api_key']}"}
        body = {"model": tasks[0]["model"], "messages": tasks[0]["messages"], "max_tokens": 4}
        in_flight = [
            asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=key)),
            asyncio.create_task(c.post("/workers/tasks/next", json={"wait_s": 30}, headers=AUTH)),
        ]
        await asyncio.sleep(0.5)  # the model call is in the engine, the poll is waiting
        await source.close()
        chat, poll = await asyncio.gather(*in_flight)
    assert chat.status_code == 409, chat.text
    assert chat.json()["error"]["code"] == "session_ended"
    assert poll.status_code == 503, poll.text
    assert proxy.counters["internal_error"] == 0
    reopened = EpisodeStore(tmp_path / "episodes.db")
    try:
        rows = {t["id"]: t for t in reopened.tasks()}
        assert {rows[t["id"]]["state"] for t in tasks} == {"withdrawn"}
        loaded = [reopened.load(sid) for sid in reopened.session_ids()]
        ends = {s.episode.end_reason for s in loaded if s is not None}
        assert len(loaded) == 2
        assert ends == {"cancelled"}
    finally:
        reopened.close()
