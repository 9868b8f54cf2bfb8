"""Issue 48: in an env-scored run (``rollout.agents: external``) rewards and ends come from the
env only. The worker token reaches the ``/workers`` routes and nothing else (a reward or end
it posts is a 403), and the tools a worker hands its agent hold their task's tool key, never
the worker token."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

import httpx
import pytest

from areal_agents import envs  # noqa: F401  (registers the built-in envs)
from areal_agents.client import AgentWorker, WorkerTask
from areal_agents.envs.registry import make
from areal_agents.rollout.runner import Runner
from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

TOKEN = "wtok-issue48-token-9d1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
make_calc = functools.partial(make, "areal/Calculator-v0", split="test", kind="arithmetic")


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def solver(tok: ChatTokenizer) -> Any:
    """Call the calculator on the question's expression, then answer with its result."""
    end = tok.token_id("<|im_end|>")
    assert end is not None

    def script(prompt_ids: list[int], params: Any) -> list[int]:
        last_user = tok.decode(prompt_ids).rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            value = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S)[-1]
            return [*tok.encode(f"The answer is {value}."), end]
        exprs = re.findall(r"[\d][\d\s\+\-\*/\(\)\.]*[\d\)]", last_user.split("<|im_end|>")[0])
        call = {"name": "calculator", "arguments": {"expression": max(exprs, key=len)}}
        return [*tok.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>"), end]

    return script


def reachable_strings(root: Any) -> list[str]:
    """Every string reachable from ``root`` through attributes (``__dict__``, ``__slots__``),
    containers and closures: what agent code can get at without reading raw memory."""
    seen: set[int] = set()
    found: list[str] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, int | float | bool | type(None) | type):
            continue
        seen.add(id(obj))
        if isinstance(obj, str | bytes):
            found.append(obj if isinstance(obj, str) else obj.decode("latin-1"))
            continue
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
            continue
        if isinstance(obj, list | tuple | set | frozenset):
            todo += list(obj)
            continue
        if isinstance(obj, asyncio.AbstractEventLoop):
            continue  # the loop holds every task of the process, the test's own included
        todo += list(getattr(obj, "__dict__", {}).values())
        for name in getattr(type(obj), "__slots__", ()):
            todo.append(getattr(obj, name, None))
        for cell in getattr(obj, "__closure__", None) or ():
            todo.append(cell.cell_contents)
        for attr in ("__func__", "__self__", "__wrapped__"):
            if hasattr(obj, attr):
                todo.append(getattr(obj, attr))
    return found


async def test_the_worker_token_cannot_post_rewards_or_ends_in_an_env_scored_run(tok):
    """A worker posted +5.0 as a final reward and its episode trained with it: now the
    token's reward, end and delete on any session are refused (403, naming the fix)."""
    proxy = Proxy(FakeEngine(solver(tok)), tok, self_rewarding=False, open_sessions=False)
    WorkerHub(proxy, TOKEN)
    session = proxy.sessions.create(group_id="g0")
    transport = httpx.ASGITransport(app=proxy.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        for method, path, body in (
            ("POST", f"/sessions/{session.id}/rewards", {"value": 5.0, "final": True}),
            ("POST", f"/sessions/{session.id}/rewards", {"value": 5.0}),
            ("POST", f"/sessions/{session.id}/end", {"final_reward": 5.0}),
            ("DELETE", f"/sessions/{session.id}", None),
            ("POST", "/sessions", {}),
        ):
            r = await c.request(method, path, json=body, headers=AUTH)
            assert r.status_code == 403, (method, path, r.text)
            assert "/workers/tasks/{id}/result" in r.json()["error"]["message"]
    ep = session.episode
    assert ep.final_reward is None and not ep.ended and proxy.sessions.get(session.id)


async def test_tools_handed_to_the_agent_hold_a_task_key_not_the_worker_token(tok):
    """The agent's task and tools carry no trace of the worker token (on the old code,
    ``task.tools[0]._link.headers`` held it); the tools still work, with their task's tool
    key, and that key can do nothing else: not post the task's result, not call another
    task's tools, not reach a session."""
    proxy = Proxy(FakeEngine(solver(tok)), tok, self_rewarding=False)
    hub = WorkerHub(proxy, TOKEN, heartbeat_timeout_s=10.0)
    seen: dict[str, Any] = {}

    async def agent(task: WorkerTask) -> str | None:
        seen.setdefault("tasks", []).append(task)
        seen.setdefault("strings", []).extend(reachable_strings(task))
        schemas = [t.schema for t in task.tools]
        messages = list(task.messages)
        async with task.openai_client() as client:
            for _ in range(3):
                r = await client.chat.completions.create(
                    model=task.model, messages=messages, tools=schemas
                )
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    return msg.content
                for call in msg.tool_calls:
                    out = await task.tools[0].acall(call.function.arguments)
                    seen.setdefault("tool_results", []).append(out)
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": out.content}
                    )
        return None

    with ProxyServer.start(proxy) as server:
        runner = Runner(proxy, base_url=server.base_url, episode_timeout_s=30)
        worker = AgentWorker(server.url, TOKEN, concurrency=2, wait_s=1.0)
        serving = asyncio.create_task(worker.serve(agent, max_tasks=2))
        try:
            results = await asyncio.wait_for(
                runner.run_group(make_calc, 2, seed=3, agent=hub.remote_agent), 60
            )
            await asyncio.wait_for(serving, 30)
            assert all(r.ok for r in results), [r.error for r in results]
            assert seen["tool_results"] and all(r.ok for r in seen["tool_results"])
            assert not [s for s in seen["strings"] if TOKEN in s], "the token is reachable"
            first, second = seen["tasks"]
            key = first.tools[0]._link._headers["Authorization"]
            async with httpx.AsyncClient(base_url=server.url) as c:
                answers = [
                    await c.post(f"/workers/tasks/{first.id}/result", json={}, headers=h)
                    for h in ({"Authorization": key},)
                ]
                answers.append(
                    await c.post(
                        f"/workers/tasks/{second.id}/tools/calculator",
                        json={"arguments": {"expression": "1+1"}},
                        headers={"Authorization": key},
                    )
                )
                answers.append(
                    await c.get(f"/sessions/{first.session_id}", headers={"Authorization": key})
                )
            assert [a.status_code for a in answers] == [401, 401, 401], [a.text for a in answers]
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            hub.close()
