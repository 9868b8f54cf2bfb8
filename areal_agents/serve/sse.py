"""Server-sent events: a finished answer replayed as a stream.

The proxy generates an answer whole, then streams it: :func:`chat_sse` as OpenAI
``chat.completion.chunk`` events (``POST /v1/chat/completions`` with ``stream: true``), and
:func:`responses_sse` as the Responses API's events (``POST /v1/responses``, see
:mod:`areal_agents.serve.responses`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


# ---------------------------------------------------------------------- chat completions
async def chat_sse(
    body: dict[str, Any],
    include_usage: bool,
    before_done: Callable[[], Awaitable[dict[str, Any] | None]] | None = None,
) -> AsyncIterator[str]:
    """Replay a finished completion as OpenAI chat.completion.chunk events; ``before_done``
    runs before ``[DONE]`` (the call is recorded there) and may return an error event
    instead (then the stream ends without ``[DONE]``)."""
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

    for ch in body["choices"]:
        i, msg = ch["index"], ch["message"]
        yield event(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if msg.get("reasoning_content"):
            yield event(
                [
                    {
                        "index": i,
                        "delta": {"reasoning_content": msg["reasoning_content"]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        if msg.get("content"):
            yield event(
                [
                    {
                        "index": i,
                        "delta": {"content": msg["content"]},
                        "logprobs": ch["logprobs"],
                        "finish_reason": None,
                    }
                ]
            )
        for k, tc in enumerate(msg.get("tool_calls") or []):
            delta = {
                "tool_calls": [
                    {"index": k, "id": tc["id"], "type": "function", "function": tc["function"]}
                ]
            }
            yield event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        yield event(
            [{"index": i, "delta": {}, "logprobs": None, "finish_reason": ch["finish_reason"]}]
        )
    if include_usage:
        yield event([], usage=body["usage"])
    if before_done is not None:
        failed = await before_done()
        if failed is not None:
            yield "data: " + json.dumps(failed) + "\n\n"
            return
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- Responses API
async def responses_sse(response: dict[str, Any]) -> AsyncIterator[str]:
    """Replay a finished Response as the Responses API's server-sent events."""
    for event in responses_events(response):
        yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def responses_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The event objects of a streamed ``response``, numbered by ``sequence_number``."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    started = {**response, "status": "in_progress", "output": [], "usage": None}
    started.update(completed_at=None, incomplete_details=None)
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        emit("response.output_item.added", output_index=index, item=_opened(item))
        _ITEM_EVENTS[item["type"]](emit, index, item)
        emit("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    emit(final, response=response)
    return events


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` as ``response.output_item.added`` announces it: in progress, no content yet."""
    opened = {**item, "status": "in_progress"}
    if item["type"] in ("message", "reasoning"):
        opened["content"] = []
    elif item["type"] == "function_call":
        opened["arguments"] = ""
    return opened


Emit = Callable[..., None]


def _reasoning_events(emit: Emit, index: int, item: dict[str, Any]) -> None:
    text = item["content"][0]["text"]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    emit("response.reasoning_text.delta", delta=text, **where)
    emit("response.reasoning_text.done", text=text, **where)


def _message_events(emit: Emit, index: int, item: dict[str, Any]) -> None:
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    emit("response.content_part.added", part={**part, "text": "", "logprobs": []}, **where)
    if part["text"]:
        emit("response.output_text.delta", delta=part["text"], logprobs=part["logprobs"], **where)
    emit("response.output_text.done", text=part["text"], logprobs=part["logprobs"], **where)
    emit("response.content_part.done", part=part, **where)


def _call_events(emit: Emit, index: int, item: dict[str, Any]) -> None:
    where = {"item_id": item["id"], "output_index": index}
    emit("response.function_call_arguments.delta", delta=item["arguments"], **where)
    emit("response.function_call_arguments.done", arguments=item["arguments"], **where)


_ITEM_EVENTS: dict[str, Callable[[Emit, int, dict[str, Any]], None]] = {
    "reasoning": _reasoning_events,
    "message": _message_events,
    "function_call": _call_events,
}
