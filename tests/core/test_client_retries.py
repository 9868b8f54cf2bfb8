"""areal_agents.client's retries: which failures are repeated, after which pauses, and when
the client gives up. The link's requests are scripted and the pauses recorded, not slept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from areal_agents.client import AgentWorker, RemoteTool, TaskGone, WorkerError, WorkerTask

URL = "http://127.0.0.1:9"
REQUEST = httpx.Request("POST", URL)


def response(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, json={"error": {"message": f"HTTP {status}"}})


class Script:
    """Stands in for ``_Link.post``: answers (or raises) the scripted outcomes in turn."""

    def __init__(self, *outcomes: httpx.Response | Exception) -> None:
        self.outcomes: Iterator[httpx.Response | Exception] = iter(outcomes)
        self.calls = 0

    async def post(self, path: str, body: dict[str, Any], **_: Any) -> httpx.Response:
        self.calls += 1
        outcome = next(self.outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    recorded: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float, *args: Any) -> None:
        recorded.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return recorded


def connect_error() -> httpx.ConnectError:
    return httpx.ConnectError("refused", request=REQUEST)


def tool(script: Script) -> RemoteTool:
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    remote = RemoteTool(schema, "t1", None)  # type: ignore[arg-type]
    remote._link = script  # type: ignore[assignment]
    return remote


def worker(script: Script, **kwargs: Any) -> AgentWorker:
    w = AgentWorker(URL, "tok", **kwargs)
    w._link.post = script.post  # type: ignore[method-assign]
    return w


async def test_a_tool_call_repeats_only_requests_never_sent_at_most_four_times(pauses):
    ok = httpx.Response(200, json={"content": "42"})
    script = Script(connect_error(), httpx.ConnectTimeout("slow", request=REQUEST), ok)
    assert (await tool(script).acall("{}")).content == "42"
    assert pauses == [0.5, 1.0]

    pauses.clear()
    script = Script(*(connect_error() for _ in range(4)))
    with pytest.raises(TaskGone, match="tool 'calc': the trainer did not answer"):
        await tool(script).acall("{}")
    assert script.calls == 4 and pauses == [0.5, 1.0, 2.0]

    pauses.clear()
    script = Script(httpx.ReadError("reset", request=REQUEST), ok)  # may have run: no repeat
    with pytest.raises(TaskGone, match="ReadError"):
        await tool(script).acall("{}")
    assert script.calls == 1 and pauses == []


async def test_polls_back_off_to_the_cap_and_a_429_waits_its_retry_after_and_resets(pauses):
    task = {"id": "t1", "session": {"id": "s1", "api_key": "k", "base_url": URL + "/v1"}}
    script = Script(
        connect_error(),
        connect_error(),
        response(503),
        connect_error(),
        response(429, **{"Retry-After": "3"}),
        connect_error(),
        httpx.Response(200, json=task),
    )
    w = worker(script, max_backoff_s=1.5)
    got = await w._next_task()
    assert isinstance(got, WorkerTask) and got.id == "t1"
    assert pauses == [0.5, 1.0, 1.5, 1.5, 1.5, 0.5]  # Retry-After 3 capped at max_backoff_s
    assert w.counters == {"polls": 7, "connect_errors": 4, "polls_429": 1, "tasks": 1}


@pytest.mark.parametrize(
    ("status", "message"),
    [(401, "refused the worker token"), (404, "has no worker API"), (418, "refused the poll")],
)
async def test_a_poll_refusal_that_retrying_cannot_fix_raises_at_once(pauses, status, message):
    script = Script(response(status))
    with pytest.raises(WorkerError, match=message):
        await worker(script)._next_task()
    assert script.calls == 1 and pauses == []


async def test_posting_a_result_retries_transport_errors_then_stops_on_an_answer(pauses):
    task = WorkerTask("t1", "s1", "k", URL, "m", [], [])
    script = Script(connect_error(), httpx.ReadError("reset", request=REQUEST), response(200))
    w = worker(script)
    assert await w._post(task, "42", None)
    assert pauses == [0.5, 1.0] and w.counters["results"] == 1

    script = Script(response(409))
    assert not await worker(script)._post(task, "42", None)
    assert script.calls == 1
