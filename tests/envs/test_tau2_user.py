"""``LLMUserSimulator`` against a fake OpenAI-compatible server: a real FastAPI app served
by uvicorn on loopback (and once through ``httpx.MockTransport``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_agents.envs.tau2 import LLMUserSimulator, ScriptedUserSimulator, Tau2Env, get_domain
from areal_agents.envs.tau2.user import GREETING, GUIDELINES, stop_token


def _completion(content: str, model: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def fake_reply(body: dict[str, Any]) -> str:
    """The fake customer: asks to cancel, then stops once the agent says it is done."""
    last = body["messages"][-1]["content"]
    if "cancelled" in last:
        return "Great, thank you! ###STOP###"
    if "transferring" in last:
        return "###TRANSFER###"
    return "Hi, I'd like to cancel my order #W8855135."


class FakeServer:
    """A uvicorn server in a thread, serving ``/v1/chat/completions``."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail = False
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append({"body": body, "auth": request.headers.get("authorization")})
            if self.fail:
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
            return JSONResponse(_completion(fake_reply(body), body["model"]))

        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _reset(server: FakeServer) -> None:
    server.requests.clear()
    server.fail = False


def test_llm_user_drives_an_episode_to_its_stop_token(server: FakeServer) -> None:
    user = LLMUserSimulator(server.base_url, "sk-test", "fake-model", max_retries=0)
    env = Tau2Env("retail", user_simulator=user)
    obs, info = env.reset(options={"task_id": "57"})
    assert obs[-1] == {"role": "user", "content": "Hi, I'd like to cancel my order #W8855135."}

    first = server.requests[0]
    assert first["auth"] == "Bearer sk-test" and first["body"]["model"] == "fake-model"
    system = first["body"]["messages"][0]
    task = get_domain("retail").data.task("57")
    assert system["role"] == "system" and GUIDELINES in system["content"]
    assert task.instructions in system["content"]
    assert first["body"]["messages"][1:] == [{"role": "user", "content": GREETING}]

    env.step(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "find_user_id_by_email", "arguments": '{"email": "x@y"}'},
                }
            ],
        }
    )
    assert len(server.requests) == 1  # tool calls never reach the user
    obs, reward, terminated, _, info = env.step("Which order do you mean?")
    assert not terminated
    obs, reward, terminated, _, info = env.step("I cannot do that; nothing was cancelled.")
    assert obs == [{"role": "user", "content": "Great, thank you! ###STOP###"}]
    assert terminated and info["termination"] == "user_stop" and reward == 1.0
    # the customer's own earlier messages come back with the assistant role
    roles = [m["role"] for m in server.requests[-1]["body"]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]


def test_transfer_token_from_the_llm_user(server: FakeServer) -> None:
    env = Tau2Env("airline", user_simulator=LLMUserSimulator(server.base_url, None, "m"))
    env.reset(options={"task_id": "0"})
    _, _, terminated, _, info = env.step("I am transferring you to a human agent.")
    assert terminated and info["termination"] == "transfer"


def test_server_failure_is_an_env_error_not_an_exception(server: FakeServer) -> None:
    user = LLMUserSimulator(server.base_url, "k", "m", max_retries=0)
    env = Tau2Env("retail", user_simulator=user)
    env.reset(options={"task_id": "57"})
    server.fail = True
    _, reward, terminated, _, info = env.step("Hello?")
    assert terminated and reward == 0.0 and not info["success"]
    assert info["error"]["kind"] == "env_error" and "500" in info["error"]["message"]


def test_unreachable_endpoint_at_reset_is_recorded() -> None:
    user = LLMUserSimulator("http://127.0.0.1:9/v1", "k", "m", max_retries=0, timeout_s=2)
    env = Tau2Env("retail", user_simulator=user)
    obs, info = env.reset(options={"task_id": "57"})
    assert info["error"]["kind"] == "env_error" and [m["role"] for m in obs][-1] == "assistant"
    _, reward, terminated, _, info = env.step("Hello?")
    assert terminated and reward == 0.0 and info["termination"] == "env_error"


async def test_env_steps_inside_a_running_event_loop(server: FakeServer) -> None:
    env = Tau2Env("retail", user_simulator=LLMUserSimulator(server.base_url, "k", "m"))
    obs, _ = await asyncio.to_thread(env.reset, options={"task_id": "57"})
    obs, _, terminated, _, _ = env.step("Your order is cancelled.")  # called from the loop
    assert terminated and obs[0]["content"].endswith("###STOP###")


async def test_llm_user_through_an_httpx_mock_transport() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json=_completion("###OUT-OF-SCOPE###", body["model"]))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        user = LLMUserSimulator("http://fake/v1", "k", "m", http_client=http, temperature=0.5)
        task = get_domain("airline").data.task("0")
        reply = await user.respond(task, [{"role": "assistant", "content": GREETING}])
        assert stop_token(reply) == "###OUT-OF-SCOPE###"
        again = await user.respond(task, [{"role": "assistant", "content": GREETING}])
        assert again == reply and not http.is_closed  # the caller's client stays open
    assert seen[0]["temperature"] == 0.5


async def test_empty_reply_is_an_env_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_completion("", "m"))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        user = LLMUserSimulator("http://fake/v1", "k", "m", http_client=http)
        from areal_agents.errors import EnvError

        with pytest.raises(EnvError, match="empty"):
            await user.respond(get_domain("airline").data.task("0"), [])


def test_simulator_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="base_url"):
        LLMUserSimulator(None, "k", "m")
    with pytest.raises(TypeError):
        ScriptedUserSimulator("###STOP###")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ScriptedUserSimulator([])
