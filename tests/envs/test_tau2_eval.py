"""``areal-agent eval`` on tau2 with no code: the served model plays the customer by default,
``--user-model URL`` names another endpoint, and a user that cannot answer fails the command
before its first episode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_eval_on_tau2_retail_runs_with_the_served_model_as_the_user(talking_model_dir, tmp_path):
    """On the tiny model with an output head of its own (the tied one answers the
    customer's prompt greedily with an empty message, which the up-front reset reports as
    the user model's failure) and an 8192-token context, as the default model has."""
    out = cli(
        "eval",
        "--env",
        "areal/Tau2Retail-v0",
        "--model",
        str(talking_model_dir),
        "--dtype",
        "float32",
        "--episodes",
        "2",
        "--max-tokens",
        "8",
        "--max-turns",
        "2",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        result = row["result"]
        assert result["end_reason"] != "env_error", result
        assert not result["error"] and not result["info"].get("error"), result
        assert row["completions"], "the agent was called"
        # the user simulator's calls are not part of the recorded episode
        assert all(
            "customer contacting" not in json.dumps(c["messages"]) for c in row["completions"]
        )


def test_eval_with_an_unreachable_user_model_fails_before_the_first_episode(tmp_path):
    out = cli(
        "eval",
        "--env",
        "areal/Tau2Retail-v0",
        "--user-model",
        "http://127.0.0.1:9/v1",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    assert out.returncode == 2
    assert "--user-model http://127.0.0.1:9/v1" in out.stderr
    assert "drop --user-model" in out.stderr
    assert "loading" not in out.stderr  # no model was loaded
    assert not Path(tmp_path / "episodes.jsonl").exists()


def test_user_model_on_an_env_without_a_user_is_refused():
    out = cli("eval", "--env", "areal/Calculator-v0", "--user-model", "http://x/v1", timeout=120)
    assert out.returncode == 2
    assert "has no simulated user" in out.stderr


def test_plain_kwargs_build_a_user_that_asks_the_endpoint_for_its_model():
    import asyncio

    import httpx

    from areal_agents.envs.tau2 import LLMUserSimulator, Tau2Env, get_domain
    from areal_agents.envs.tau2.user import GREETING
    from areal_agents.errors import ConfigError

    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path.endswith("/models"):
            data = [{"id": "served", "object": "model", "created": 0, "owned_by": "x"}]
            return httpx.Response(200, json={"object": "list", "data": data})
        body = json.loads(request.content)
        assert body["model"] == "served" and body["max_tokens"] == 16
        message = {"role": "assistant", "content": "###STOP###"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return httpx.Response(
            200,
            json={
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "served",
                "choices": [choice],
            },
        )

    env = Tau2Env("retail", user_base_url="http://fake/v1", user_max_tokens=16)
    user = env.user_simulator
    assert isinstance(user, LLMUserSimulator) and user.model is None

    async def ask() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            user._http_client = http
            task = get_domain("retail").data.task("0")
            first = await user.respond(task, [{"role": "assistant", "content": GREETING}])
            await user.respond(task, [{"role": "assistant", "content": GREETING}])
            return first

    assert asyncio.run(ask()) == "###STOP###"
    assert seen == ["/v1/models", "/v1/chat/completions", "/v1/chat/completions"]  # asked once
    with pytest.raises(ConfigError, match="not both"):
        Tau2Env("retail", user_base_url="http://x/v1", user_simulator=user)
    with pytest.raises(ConfigError, match="http"):
        Tau2Env("retail", user_base_url="localhost:8000")
