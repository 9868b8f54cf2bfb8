"""The worker API and its client: agents in other processes run the trainer's episodes.

Real components at small scale: the proxy app on a real loopback uvicorn (``ProxyServer``)
with a scripted ``FakeEngine`` over the real Qwen3 tokenizer, the ``Runner`` with
``agent=hub.remote_agent``, the real ``areal/Calculator-v0`` env, and ``AgentWorker`` in the
test's event loop (or the ``areal-agent worker`` command in a subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from areal_agents import envs  # noqa: F401  (registers the built-in envs)
from areal_agents.client import AgentWorker, RemoteTool, WorkerTask
from areal_agents.envs.registry import make
from areal_agents.errors import AgentLost
from areal_agents.rollout.runner import AgentTask, Runner
from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "wtok-test-7f3a9c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
make_calc = functools.partial(make, "areal/Calculator-v0", split="test", kind="arithmetic")


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def solver(tok: ChatTokenizer):
    """A scripted policy: call the calculator on the question's expression, then answer."""
    end = tok.token_id("<|im_end|>")

    def script(prompt_ids: list[int], params: Any) -> list[int]:
        text = tok.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            value = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S)[-1]
            reply = f"The answer is {value}."
        else:
            question = last_user.split("<|im_end|>")[0]
            exprs = re.findall(r"[\d][\d\s\+\-\*/\(\)\.]*[\d\)]", question)
            call = {"name": "calculator", "arguments": {"expression": max(exprs, key=len)}}
            reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return [*tok.encode(reply), end]

    return script


@dataclass
class Trainer:
    proxy: Proxy
    hub: WorkerHub
    server: ProxyServer
    runner: Runner

    def url(self, path: str) -> str:
        return f"{self.server.url}{path}"


@contextlib.contextmanager
def trainer(
    tok: ChatTokenizer, *, runner_timeout_s: float = 30.0, store: Any = None, **hub_kwargs: Any
) -> Iterator[Trainer]:
    proxy = Proxy(
        FakeEngine(solver(tok)), tok, self_rewarding=False, admin_key="admin-key", store=store
    )
    hub = WorkerHub(proxy, TOKEN, **hub_kwargs)
    with ProxyServer.start(proxy) as server:
        runner = Runner(proxy, base_url=server.base_url, episode_timeout_s=runner_timeout_s)
        try:
            yield Trainer(proxy, hub, server, runner)
        finally:
            hub.close()  # answers pending long-polls, so the server stops at once


async def calculator_agent(task: WorkerTask) -> str | None:
    """The same loop as an in-process agent: the model through the session, tools via acall."""
    schemas = [t.schema for t in task.tools]
    by_name = {t.name: t for t in task.tools}
    messages = list(task.messages)
    async with task.openai_client() as client:
        for _ in range(4):
            r = await client.chat.completions.create(
                model=task.model, messages=messages, tools=schemas
            )
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return msg.content
            for call in msg.tool_calls:
                out = await by_name[call.function.name].acall(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": out.content})
    return None


async def poll(t: Trainer, wait_s: float = 5.0, headers: dict[str, str] = AUTH) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(
            t.url("/workers/tasks/next"),
            json={"worker_id": "raw", "wait_s": wait_s},
            headers=headers,
        )


async def post(
    t: Trainer, path: str, body: dict[str, Any] | None = None, **kw: Any
) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(t.url(path), json=body or {}, headers=kw.get("headers", AUTH))


async def wait_until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def no_tasks_left() -> bool:
    return asyncio.all_tasks() == {asyncio.current_task()}


# ---------------------------------------------------------------------- full episodes
async def test_full_episode_through_a_worker_is_scored_by_the_env(tok):
    seen: dict[str, Any] = {}

    async def agent(task: WorkerTask) -> str | None:
        seen["task"] = task
        # the session key may read its trajectory but not reward itself
        async with httpx.AsyncClient() as c:
            key = {"Authorization": f"Bearer {task.api_key}"}
            base = task.base_url.removesuffix("/v1")
            seen["self_reward"] = await c.post(
                f"{base}/sessions/{task.session_id}/rewards",
                json={"value": 1000, "final": True},
                headers=key,
            )
        return await calculator_agent(task)

    with trainer(tok) as t:
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2)
        res, posted = await asyncio.gather(
            t.runner.run_episode(make_calc, seed=5, agent=t.hub.remote_agent),
            worker.serve(agent, max_tasks=1),
        )
        assert res.end_reason == "terminated", res.error
        assert res.success is True and res.reward == pytest.approx(1.0)
        assert posted == 1
        assert len(res.episode.completions) == 2  # both model calls recorded on the episode
        task: WorkerTask = seen["task"]
        assert task.session_id == res.episode.session_id
        assert task.group_id == res.episode.group_id and task.task_id == res.episode.task_id
        assert [tool.name for tool in task.tools] == ["calculator"]
        assert isinstance(task.tools[0], RemoteTool)
        assert task.info["task_id"] == task.task_id and "tools" not in task.info
        assert task.metadata is task.info
        r = seen["self_reward"]
        assert r.status_code == 403 and "rewards come from the environment" in r.text
        assert res.episode.final_reward == pytest.approx(1.0)
        c = t.hub.counters
        assert (c["handed_out"], c["results"], c["tool_calls"], c["lost"]) == (1, 1, 1, 0)
        assert t.hub.in_flight == t.hub.queued == 0
        assert os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"
    assert no_tasks_left()


async def test_worker_tasks_and_their_episodes_are_written_to_the_store(tok, tmp_path):
    from areal_agents.serve.store import EpisodeStore

    store = EpisodeStore(tmp_path / "episodes.db")
    with trainer(tok, store=store) as t:
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2, worker_id="w-1")
        res, _ = await asyncio.gather(
            t.runner.run_episode(make_calc, seed=5, agent=t.hub.remote_agent),
            worker.serve(calculator_agent, max_tasks=1),
        )
        assert res.end_reason == "terminated", res.error
    await store.flush()
    (row,) = store.tasks()
    assert row["state"] == "done" and row["worker_id"] == "w-1"
    assert row["session_id"] == res.episode.session_id and row["task_id"] == res.episode.task_id
    assert row["handed_at"] and row["finished_at"] >= row["handed_at"]
    kept = store.load(res.episode.session_id)
    assert kept is not None and len(kept.episode.completions) == 2
    store.close()


async def test_group_with_concurrent_worker_and_sync_agent(tok):
    def sync_agent(task: WorkerTask) -> str:  # a plain function: runs on a thread
        result = task.tools[0].call('{"expression": "2+3"}')
        assert result.ok and result.content == "5"
        return "The answer is 5."

    with trainer(tok) as t:
        worker = AgentWorker(t.server.url, TOKEN, concurrency=3, wait_s=2)
        results, posted = await asyncio.gather(
            t.runner.run_group(make_calc, 3, seed=1, agent=t.hub.remote_agent),
            worker.serve(sync_agent, max_tasks=3),
        )
    assert posted == 3 and [r.end_reason for r in results] == ["terminated"] * 3
    assert len({r.episode.group_id for r in results}) == 1
    assert no_tasks_left()


async def test_an_agent_that_raises_is_an_agent_error_and_the_worker_goes_on(tok):
    calls = []

    async def flaky(task: WorkerTask) -> str | None:
        calls.append(task.id)
        if len(calls) == 1:
            raise ValueError("boom in the agent")
        return await calculator_agent(task)

    with trainer(tok) as t:
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2)
        first = await asyncio.gather(
            t.runner.run_episode(make_calc, seed=7, agent=t.hub.remote_agent),
            t.runner.run_episode(make_calc, seed=8, agent=t.hub.remote_agent),
            worker.serve(flaky, max_tasks=2),
        )
    reasons = sorted(r.end_reason for r in first[:2])
    assert reasons == ["agent_error", "terminated"] and first[2] == 2
    bad = next(r for r in first[:2] if r.end_reason == "agent_error")
    assert "ValueError: boom in the agent" in bad.error
    assert worker.counters["agent_errors"] == 1


# ---------------------------------------------------------------------- the HTTP API
async def test_long_poll_gets_a_task_queued_during_the_wait_and_api_errors(tok):
    with trainer(tok) as t:
        waiting = asyncio.create_task(poll(t, wait_s=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        started = time.monotonic()
        episode = asyncio.create_task(
            t.runner.run_episode(make_calc, seed=2, agent=t.hub.remote_agent)
        )
        r = await waiting
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 3
        body = r.json()
        assert set(body) >= {"id", "session", "messages", "tools", "task_id", "group_id"}
        assert body["tools"][0]["function"]["name"] == "calculator"
        assert body["heartbeat_s"] == pytest.approx(t.hub.heartbeat_timeout_s / 3)
        assert body["metadata"]["kind"] == "arithmetic"
        assert t.hub.in_flight == 1
        tid = body["id"]

        ok = await post(
            t, f"/workers/tasks/{tid}/tools/calculator", {"arguments": {"expression": "6*7"}}
        )
        assert ok.json() == {"content": "42", "error": None}
        bad = await post(t, f"/workers/tasks/{tid}/tools/calculator", {"arguments": "{not json"})
        assert bad.status_code == 200 and bad.json()["error"] == "bad_arguments"
        unknown = await post(t, f"/workers/tasks/{tid}/tools/search", {"arguments": {}})
        assert unknown.status_code == 404 and "its tools: calculator" in unknown.text
        assert (await post(t, f"/workers/tasks/{tid}/heartbeat")).json()["ok"] is True

        done = await post(t, f"/workers/tasks/{tid}/result", {"final_answer": "The answer is 42."})
        assert done.status_code == 200, done.text
        res = await episode
        assert res.end_reason == "terminated"  # the env scored the worker's answer
        again = await post(t, f"/workers/tasks/{tid}/result", {"final_answer": "x"})
        assert again.status_code == 409 and "already has a result" in again.text
        assert (await post(t, f"/workers/tasks/{tid}/heartbeat")).status_code == 409
        missing = await post(t, "/workers/tasks/wtask-nope/heartbeat")
        assert missing.status_code == 404 and "POST /workers/tasks/next" in missing.text
        malformed = await post(t, f"/workers/tasks/{tid}/result", {"answer": 1})
        assert malformed.status_code == 400


async def test_no_task_is_a_429_with_retry_after_and_the_wait_is_capped(tok):
    with trainer(tok, max_wait_s=0.3) as t:
        started = time.monotonic()
        r = await poll(t, wait_s=100)
        assert time.monotonic() - started < 3
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        assert "staleness gate" in r.json()["error"]["message"]
        assert t.hub.counters["polls_429"] == 1


async def test_wrong_token_is_a_401_naming_where_the_token_comes_from(tok):
    with trainer(tok) as t:
        for path in (
            "/workers/tasks/next",
            "/workers/tasks/x/heartbeat",
            "/workers/tasks/x/result",
        ):
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Bearer é".encode()},
            ):
                r = await post(t, path, {}, headers=headers)
                assert r.status_code == 401, (path, r.text)
                assert "--token" in r.text and "AREAL_WORKER_TOKEN" in r.text
        # the worker refuses to go on with a wrong token instead of retrying forever
        from areal_agents.client import WorkerError

        with pytest.raises(WorkerError, match="refused the worker token"):
            await AgentWorker(t.server.url, "wrong", wait_s=0.2).serve(calculator_agent)


# ---------------------------------------------------------------------- loss
async def test_worker_that_stops_heartbeating_is_lost_and_the_group_goes_on(tok):
    with trainer(tok, heartbeat_timeout_s=0.6) as t:
        group = asyncio.create_task(
            t.runner.run_group(make_calc, 2, seed=3, agent=t.hub.remote_agent)
        )
        r = await poll(t)  # a worker that takes a task, calls the model once, then goes silent
        silent = r.json()
        session = silent["session"]
        async with openai.AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"]
        ) as client:
            await client.chat.completions.create(
                model="m", messages=silent["messages"], max_tokens=8
            )
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2)
        results, _ = await asyncio.gather(group, worker.serve(calculator_agent, max_tasks=1))
        lost = [x for x in results if x.end_reason == "agent_lost"]
        assert len(lost) == 1 and "no heartbeat" in lost[0].error and "0.6" in lost[0].error
        assert len(lost[0].episode.completions) == 1  # what it did before is kept
        assert [x.success for x in results if x is not lost[0]] == [True]
        late = await post(t, f"/workers/tasks/{silent['id']}/heartbeat")
        assert late.status_code == 409 and "no heartbeat" in late.text
        assert t.hub.counters["lost"] == 1


async def test_slow_worker_past_episode_timeout_is_lost_and_its_agent_stopped(tok):
    async def slow(task: WorkerTask) -> str:
        await asyncio.sleep(30)
        return "too late"

    with trainer(tok, heartbeat_timeout_s=0.9, episode_timeout_s=0.5) as t:
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2)
        started = time.monotonic()
        res, posted = await asyncio.gather(
            t.runner.run_episode(make_calc, seed=4, agent=t.hub.remote_agent),
            worker.serve(slow, max_tasks=1),
        )
        assert res.end_reason == "agent_lost" and "episode_timeout_s=0.5" in res.error
        assert posted == 0 and worker.counters["gone"] == 1  # its heartbeat got the 409
        assert time.monotonic() - started < 5
    assert no_tasks_left()


async def test_cancelling_remote_agent_withdraws_the_task(tok):
    with trainer(tok, max_wait_s=0.2) as t:
        task = AgentTask(
            messages=[{"role": "user", "content": "hi"}],
            tools=[],
            base_url="u",
            api_key="k",
            model="m",
        )
        waiting = asyncio.create_task(t.hub.remote_agent(task))
        await wait_until(lambda: t.hub.queued == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert t.hub.queued == 0 and t.hub.counters["withdrawn"] == 1
        assert (await poll(t, wait_s=0.1)).status_code == 429  # nothing to hand out

        # handed out, then the runner's episode timeout cancels it: the worker gets a 409
        t.runner.episode_timeout_s = 0.5
        episode = asyncio.create_task(t.runner.run_episode(make_calc, agent=t.hub.remote_agent))
        body = (await poll(t, wait_s=5)).json()
        res = await episode
        assert res.end_reason == "timeout"
        late = await post(t, f"/workers/tasks/{body['id']}/result", {"final_answer": "x"})
        assert late.status_code == 409 and "withdrew" in late.text
        assert t.hub.in_flight == 0 and t.hub.counters["withdrawn"] == 2

        t.hub.close()  # a closed hub fails new episodes at once instead of waiting
        with pytest.raises(AgentLost, match="closed"):
            await t.hub.remote_agent(task)
    assert no_tasks_left()


@pytest.mark.slow
async def test_worker_process_killed_with_sigkill_is_lost_within_the_heartbeat_timeout(
    tok, tmp_path
):
    (tmp_path / "hanging_agent.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def make():
                async def agent(task):
                    async with task.openai_client() as client:
                        await client.chat.completions.create(
                            model=task.model, messages=task.messages, max_tokens=4
                        )
                    print("CALLED", flush=True)
                    await asyncio.sleep(3600)

                return agent
            """
        )
    )
    stderr = tmp_path / "worker.err"
    with trainer(tok, heartbeat_timeout_s=1.5) as t, stderr.open("w") as err:
        command = [
            sys.executable,
            "-m",
            "areal_agents.cli.main",
            "worker",
            "--connect",
            t.server.url,
        ]
        proc = subprocess.Popen(
            [*command, "--agent", "hanging_agent:make", "--wait", "2"],
            env={**os.environ, "PYTHONPATH": str(tmp_path), "AREAL_WORKER_TOKEN": TOKEN},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert proc.stdout is not None
        try:
            episode = asyncio.create_task(
                t.runner.run_episode(make_calc, seed=6, agent=t.hub.remote_agent)
            )
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert line.strip() == "CALLED", stderr.read_text()
            await asyncio.sleep(2.0)  # longer than the timeout: its heartbeats keep it alive
            assert not episode.done(), stderr.read_text()
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            res = await asyncio.wait_for(episode, 10)
            assert res.end_reason == "agent_lost" and "heartbeat_timeout_s=1.5" in res.error
            assert time.monotonic() - killed < 1.5 + 0.5
            assert len(res.episode.completions) == 1
            assert t.hub.counters["heartbeats"] >= 3
        finally:
            proc.kill()
            proc.communicate(timeout=10)


# ---------------------------------------------------------------------- key permissions
async def test_session_keys_cannot_reward_end_or_delete_without_self_rewarding(tok):
    proxy = Proxy(FakeEngine(solver(tok)), tok, self_rewarding=False, admin_key="admin")
    WorkerHub(proxy, TOKEN)
    transport = httpx.ASGITransport(app=proxy.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        made = (await c.post("/sessions", headers={"Authorization": "Bearer admin"})).json()
        sid, mine = made["id"], {"Authorization": f"Bearer {made['api_key']}"}
        chat = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "What is 2+3?"}]},
            headers=mine,
        )
        assert chat.status_code == 200, chat.text
        assert (await c.get(f"/sessions/{sid}", headers=mine)).status_code == 200
        assert (await c.get(f"/sessions/{sid}/trajectory", headers=mine)).status_code == 200
        for method, path, body in (
            ("POST", f"/sessions/{sid}/rewards", {"value": 1000, "final": True}),
            ("POST", f"/sessions/{sid}/rewards", {"value": 1000}),
            ("POST", f"/sessions/{sid}/end", {"final_reward": 1000}),
            ("DELETE", f"/sessions/{sid}", None),
        ):
            r = await c.request(method, path, json=body, headers=mine)
            assert r.status_code == 403, (path, r.text)
            assert "rewards come from the environment" in r.json()["error"]["message"]
        ep = proxy.sessions.get(sid).episode
        assert ep.final_reward is None and ep.completions[0].reward == 0 and not ep.ended
        # neither may the worker token (the env scores: tests/core/test_worker_token.py);
        # the admin key may
        r = await c.post(f"/sessions/{sid}/rewards", json={"value": 0.5}, headers=AUTH)
        assert r.status_code == 403
        admin = {"Authorization": "Bearer admin"}
        r = await c.post(f"/sessions/{sid}/rewards", json={"value": 0.5}, headers=admin)
        assert r.status_code == 200
        assert (await c.post(f"/sessions/{sid}/end", headers=admin)).status_code == 200
        assert (await c.delete(f"/sessions/{sid}", headers=admin)).status_code == 200


async def test_self_rewarding_default_keeps_session_keys_managing_their_session(tok):
    proxy = Proxy(FakeEngine(solver(tok)), tok)
    assert proxy.self_rewarding is True
    transport = httpx.ASGITransport(app=proxy.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        made = (await c.post("/sessions")).json()
        sid, mine = made["id"], {"Authorization": f"Bearer {made['api_key']}"}
        r = await c.post(f"/sessions/{sid}/rewards", json={"value": 2, "final": True}, headers=mine)
        assert r.status_code == 200, r.text
        assert (await c.post(f"/sessions/{sid}/end", headers=mine)).status_code == 200
        assert (await c.delete(f"/sessions/{sid}", headers=mine)).status_code == 200
        other = (await c.post("/sessions")).json()
        r = await c.post(f"/sessions/{other['id']}/rewards", json={"value": 1}, headers=mine)
        assert r.status_code == 401  # the deleted session's key is no key at all


# ---------------------------------------------------------------------- the command line
def test_worker_command_help_and_missing_token():
    run = functools.partial(
        subprocess.run,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "AREAL_WORKER_TOKEN"},
    )
    out = run([sys.executable, "-m", "areal_agents.cli.main", "worker", "--help"])
    assert out.returncode == 0 and "--connect" in out.stdout and "AREAL_WORKER_TOKEN" in out.stdout
    out = run(
        [
            sys.executable,
            "-m",
            "areal_agents.cli.main",
            "worker",
            "--connect",
            "http://x",
            "--agent",
            "m:f",
        ]
    )
    assert out.returncode == 2 and "worker token" in out.stderr


async def test_the_readme_openai_worker_example_solves_calculator_episodes(tok):
    """examples/agents/openai_worker.py (shown verbatim in the README, at most 25 lines) as
    the worker's agent, loaded the way ``areal-agent worker --agent FILE:make_agent`` does."""
    from areal_agents.rollout.task_agent import load_agent

    path = ROOT / "examples" / "agents" / "openai_worker.py"
    source = path.read_text()
    assert len(source.splitlines()) <= 25
    assert source in (ROOT / "README.md").read_text(), "the README shows another version"
    agent = load_agent(f"{path}:make_agent")
    with trainer(tok) as t:
        worker = AgentWorker(t.server.url, TOKEN, wait_s=2, concurrency=2)
        results, posted = await asyncio.gather(
            t.runner.run_group(make_calc, 2, seed=3, agent=t.hub.remote_agent),
            worker.serve(agent, max_tasks=2),
        )
    assert posted == 2
    for res in results:
        assert (res.end_reason, res.success) == ("terminated", True), res.error
        assert len(res.episode.completions) == 2
