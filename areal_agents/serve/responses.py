"""The OpenAI Responses API (``POST /v1/responses``) on top of the proxy's chat completions.

The OpenAI Agents SDK's default model class (``OpenAIResponsesModel``) and many agent
services call ``POST /v1/responses``. The proxy answers it by converting the request into a
chat completion request, running it through :meth:`Proxy.complete
<areal_agents.serve.proxy.Proxy.complete>` (so the call is recorded token-exactly as the same
:class:`~areal_agents.trajectory.Completion`, in the same episode tree as chat completions),
and converting the chat reply into a Response object (or its server-sent events).

Request → chat messages
-----------------------
* ``instructions`` → a system message first (not carried over from ``previous_response_id``,
  as in the OpenAI API).
* ``previous_response_id`` → the conversation of that response (the chat messages it was
  asked, without its instructions, plus its reply), then ``input``. Only responses of the
  same session that were created with ``store`` not false are known; the proxy keeps the
  last :data:`PER_SESSION` of each session, in memory, until the session is dropped. Anything
  else is a 404.
* ``input``: a string (one user message) or a list of items:

  - ``message`` (``type`` may be omitted) with role ``user``, ``system``, ``developer`` or
    ``assistant`` and content as a string or a list of ``input_text`` / ``output_text`` /
    ``refusal`` parts (joined); images, files and audio are refused (the model reads text);
  - ``function_call`` (``call_id``, ``name``, ``arguments``) → ``tool_calls`` of an assistant
    message; an assistant ``message`` and the ``function_call`` items after it form one
    assistant turn;
  - ``function_call_output`` (``call_id``, ``output`` as a string or text parts) → a
    ``tool`` message;
  - ``reasoning`` items are ignored (they only end the assistant turn before them);
  - ``item_reference`` and every other item type are refused with a 400.

  An assistant turn that is exactly a reply this proxy recorded in the session (the same
  text and calls, found by its ``call_id`` or ``msg_`` id) is replaced by the recorded
  message, reasoning included, so the next prompt renders the model's own tokens and the
  two completions merge into one training sample.
* ``tools``: function tools in the flat Responses form (``type``, ``name``, ``description``,
  ``parameters``, ``strict``) → chat tools; other tool types (web search, file search, MCP,
  computer use, ...) are refused with a 400 naming them. ``tool_choice``: ``auto``, ``none``,
  ``required`` or ``{"type": "function", "name": ...}``.
* Sampling: ``max_output_tokens`` (→ ``max_tokens``), ``temperature``, ``top_p``, and the
  extensions ``seed``, ``top_k`` and ``chat_template_kwargs`` as in the chat endpoint.
  ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` returns the sampled
  tokens' logprobs on a text-only reply.

Accepted and ignored (a local model cannot honour them): ``store`` (beyond keeping the
conversation for ``previous_response_id``), ``metadata`` (echoed), ``user``,
``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``prompt_cache_options``, ``service_tier``, ``reasoning`` (effort, summary), ``text.verbosity``,
``text.format`` of type ``json_schema`` / ``json_object`` (decoding is not constrained: the
client parses what the model wrote), ``truncation`` (a prompt over the context is a 400, never
cut), ``parallel_tool_calls`` (every parsed call is returned), ``tools[].strict``,
``max_tool_calls``, ``context_management``, ``stream_options``, other ``include`` values, and
unknown fields. Refused: ``background: true``, ``conversation`` and ``prompt`` (server-side
state this proxy does not keep). A known field of the wrong type is a 400 naming it.

Response
--------
``id`` (``resp_`` + the hex of the recorded completion's id), ``object: "response"``,
``status`` (``"completed"``, or ``"incomplete"`` with ``incomplete_details.reason =
"max_output_tokens"`` when the reply ran out of tokens), ``output`` (a ``reasoning`` item
when the model reasoned, a ``message`` item with one ``output_text`` part unless the reply is
only tool calls, then one ``function_call`` item per call, whose ``call_id`` is the chat
``tool_calls[].id`` the proxy generated), ``usage``, the echoed request settings, and the extra
top-level field ``completion_id``: the recorded completion, for ``POST
/sessions/{id}/rewards``.

With ``stream: true`` the same response is replayed as server-sent events
(:func:`~areal_agents.serve.sse.responses_sse`; ``event:`` and ``data:`` lines, each with a
``sequence_number``): ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, its content
events (``response.reasoning_text.delta/.done``; ``response.content_part.added``,
``response.output_text.delta/.done``, ``response.content_part.done``;
``response.function_call_arguments.delta/.done``) and ``response.output_item.done``, and last
``response.completed`` (``response.incomplete`` when incomplete).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.responses import Response as HttpResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_agents.serve.api_error import ApiError
from areal_agents.serve.core import ProxyCore
from areal_agents.serve.schemas import SEED_MAX, TOKENS_MAX
from areal_agents.serve.session import Session
from areal_agents.serve.sse import responses_sse
from areal_agents.trajectory import Completion, message_key

M = TypeVar("M", bound=BaseModel)

PER_SESSION = 256
"""How many responses per session ``previous_response_id`` can name (the latest ones)."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_IMAGE_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")
_TEXT_PARTS = ("input_text", "output_text", "text")


# ---------------------------------------------------------------------- wire schemas
class _Wire(BaseModel):
    """Known fields are type-checked strictly; unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Part(_Wire):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Wire):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: str | None = None


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[_Part]


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Wire):
    type: Literal["text", "json_schema", "json_object"]


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Wire):
    """``reasoning``: echoed in the response, so only the values OpenAI's ``Reasoning`` type
    accepts are taken (anything else is a 400 naming the field)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Wire):
    """The body of ``POST /v1/responses`` (see the module docstring for what is honoured)."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=0, le=TOKENS_MAX)
    # extensions, as in the chat completions endpoint
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    top_k: int | None = Field(default=None, ge=-1, le=TOKENS_MAX)
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------- the endpoint
async def respond(
    proxy: ProxyCore,
    session: Session | None,
    req: ResponsesRequest,
    *,
    agent: str | None = None,
    request: Request | None = None,
) -> HttpResponse:
    """Answer one ``POST /v1/responses`` (recorded into ``session``; None: not recorded;
    ``agent`` names the calling agent). With the HTTP ``request``, a client that disconnects
    before the answer is ready cancels the generation and nothing is recorded; the call is
    committed to the proxy's store (and the conversation kept for ``previous_response_id``)
    before the answer is sent."""
    _refuse_server_state(req)
    prior = await _prior_conversation(proxy, session, req.previous_response_id)
    turn = input_messages(req.input, session)
    if not prior and not turn:
        raise ApiError(
            400, "the request has no input: send input (a string or items)", param="input"
        )
    tools = chat_tools(req.tools)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = chat_request(req, [*system, *prior, *turn], tools)
    proxy.counters["responses_calls"] += 1
    work = proxy.reply(session, chat, agent=agent)
    reply = await (proxy.until_disconnect(request, work) if request is not None else work)
    body = reply.body
    choice = body["choices"][0]
    response = response_object(req, body, time.time())
    proxy.record(reply)  # first: a session ended or deleted meanwhile is a 409, nothing kept
    if session is not None and req.store is not False:
        conversation = [*prior, *turn, choice["message"]]
        STORE.put(session, response["id"], conversation)
        if proxy.store is not None:
            proxy.store.put_response(session.id, response["id"], conversation)
    await proxy.commit(reply)
    if req.stream:
        return StreamingResponse(responses_sse(response), media_type="text/event-stream")
    return JSONResponse(response)


def _refuse_server_state(req: ResponsesRequest) -> None:
    extra = req.model_extra or {}
    if req.background:
        raise ApiError(
            400, "background responses are not supported: drop background", param="background"
        )
    for name, what in (
        ("conversation", "server-side conversations"),
        ("prompt", "stored prompt templates"),
    ):
        if extra.get(name) is not None:
            raise ApiError(
                400,
                f"{name} is not supported: this proxy keeps no {what}; send the text as "
                "instructions and input (or continue with previous_response_id)",
                param=name,
            )


async def _prior_conversation(
    proxy: ProxyCore, session: Session | None, response_id: str | None
) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if session is None:
        raise ApiError(
            400,
            "previous_response_id needs a session key: the proxy keeps responses per session",
            param="previous_response_id",
        )
    conversation = STORE.get(session, response_id)
    if conversation is None and proxy.store is not None:  # a response of an earlier process
        conversation = await asyncio.to_thread(proxy.store.response, session.id, response_id)
    if conversation is None:
        raise ApiError(
            404,
            f"previous_response_id {response_id!r} is not a stored response of this session "
            f"(only this session's last {PER_SESSION} responses made without store=false "
            "are kept); send the conversation as input items instead",
            kind="not_found_error",
            param="previous_response_id",
        )
    return list(conversation)


# ---------------------------------------------------------------------- request → chat
def input_messages(
    items: str | list[dict[str, Any]] | None, session: Session | None = None
) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (see the module docstring)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    turn: list[tuple[str, Any, str]] = []  # the current assistant turn: (kind, item, where)

    def flush() -> None:
        if turn:
            out.append(_assistant_message(turn, session))
            turn.clear()

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            msg = _check(MessageItem, item, where)
            if msg.role == "assistant":
                if turn:  # one message per assistant turn, before its calls
                    flush()
                turn.append(("message", msg, where))
                continue
            flush()
            out.append({"role": msg.role, "content": _text(msg.content, f"{where}.content")})
        elif kind == "function_call":
            turn.append(("call", _check(FunctionCallItem, item, where), where))
        elif kind == "function_call_output":
            flush()
            result = _check(FunctionCallOutputItem, item, where)
            content = _text(result.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": content})
        elif kind == "reasoning":
            flush()  # a reasoning item opens the next assistant turn
        else:
            raise _unsupported_item(kind, where)
    flush()
    return out


def _unsupported_item(kind: Any, where: str) -> ApiError:
    if kind == "item_reference":
        return ApiError(
            400,
            f"{where}: item_reference is not supported: the proxy keeps no items by id; send "
            "the item itself, or continue a stored response with previous_response_id",
            param=where,
        )
    if kind is None:
        return ApiError(400, f"{where}: an input item needs a type (or a role)", param=where)
    return ApiError(
        400,
        f"{where}: input items of type {kind!r} are not supported; send message, "
        "function_call, function_call_output or reasoning items",
        param=f"{where}.type",
    )


def _text(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in _IMAGE_PARTS:
            raise ApiError(
                400,
                f"{where}.{k}: content of type {part.type!r} is not supported: only text is "
                "supported (input_text / output_text parts); this model reads text",
                param=f"{where}.{k}.type",
            )
        else:
            raise ApiError(
                400,
                f"{where}.{k}: a content part of type {part.type!r} with no text; send "
                "input_text / output_text parts with a text field",
                param=f"{where}.{k}",
            )
    return "".join(texts)


def _assistant_message(turn: list[tuple[str, Any, str]], session: Session | None) -> dict[str, Any]:
    """One assistant chat message from its items; the recorded one when it is the same."""
    texts = [_text(item.content, f"{where}.content") for k, item, where in turn if k == "message"]
    calls = [item for k, item, _ in turn if k == "call"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    recorded = _recorded_reply(turn, session)
    if recorded is not None and message_key(recorded.message) == message_key(message):
        return _with_call_ids(recorded.message, calls)
    return message


def _recorded_reply(turn: list[tuple[str, Any, str]], session: Session | None) -> Completion | None:
    if session is None:
        return None
    episode = session.episode
    for kind, item, _ in turn:
        if kind == "call":
            return episode.by_tool_call(item.call_id)
        if item.id and item.id.startswith("msg_"):
            return episode.by_id("chatcmpl-" + item.id[len("msg_") :])
    return None


def _with_call_ids(message: dict[str, Any], calls: list[FunctionCallItem]) -> dict[str, Any]:
    """A copy of a recorded reply, its tool calls under the ids the client sent back."""
    out = dict(message)
    if calls:
        out["tool_calls"] = [
            {**tc, "id": c.call_id, "function": dict(tc["function"])}
            for tc, c in zip(message.get("tool_calls") or [], calls, strict=True)
        ]
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools (the form the Agents SDK's chat model sends)."""
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind != "function":
            raise ApiError(
                400,
                f"tools.{i}: tools of type {kind!r} are not supported: the model can only "
                "call function tools (type 'function', with name and parameters); run that "
                "tool yourself and expose it as a function tool",
                param=f"tools.{i}.type",
            )
        tool = _check(FunctionTool, raw, f"tools.{i}")
        function: dict[str, Any] = {"name": tool.name, "description": tool.description or ""}
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if not isinstance(name, str) or name not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {name!r}, which is not in tools {names}",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": name}}
    what = choice.get("type") if isinstance(choice, dict) else choice
    raise ApiError(
        400,
        f"tool_choice {what!r} is not supported: use 'auto', 'none', 'required' or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def chat_request(
    req: ResponsesRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The chat completion request body for ``req`` with these messages and tools."""
    chat: dict[str, Any] = {"messages": messages, "n": 1}
    choice = _chat_tool_choice(req.tool_choice, tools)
    settings = {
        "model": req.model,
        "tools": tools,
        "tool_choice": choice,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "seed": req.seed,
        "top_k": req.top_k,
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    chat.update({k: v for k, v in settings.items() if v is not None})
    if LOGPROBS_INCLUDE in (req.include or []):
        chat["logprobs"] = True
        if req.top_logprobs:
            chat["top_logprobs"] = req.top_logprobs
    return chat


def _check(model: type[M], data: Any, where: str) -> M:
    """``data`` validated as ``model``; a 400 naming the field (``where`` + its path)."""
    if not isinstance(data, dict):
        raise ApiError(
            400, f"{where} must be a JSON object, got {type(data).__name__}", param=where
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        fields = [".".join([where, *(str(p) for p in e["loc"])]) for e in errors]
        problems = "; ".join(f"{f}: {e['msg']}" for f, e in zip(fields, errors, strict=True))
        raise ApiError(400, f"invalid request: {problems}", param=fields[0]) from None


# ---------------------------------------------------------------------- chat → Response
def response_object(req: ResponsesRequest, body: dict[str, Any], now: float) -> dict[str, Any]:
    """The Response object for the chat completion ``body`` answering ``req``."""
    choice = body["choices"][0]
    completion_id: str = choice.get("completion_id") or body["id"]
    hexid = completion_id.removeprefix("chatcmpl-")
    incomplete = choice["finish_reason"] == "length"
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    usage = body["usage"]
    return {
        "id": f"resp_{hexid}",
        "object": "response",
        "created_at": body["created"],
        "completed_at": None if incomplete else now,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": body["model"],
        "output": output_items(choice["message"], hexid, incomplete, logprobs),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "metadata": req.metadata or {},
        "tools": [_echo_tool(t) for t in req.tools or []],
        "tool_choice": _echo_tool_choice(req.tool_choice),
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "top_logprobs": req.top_logprobs or 0,
        "reasoning": _echo_reasoning(req.reasoning),
        "text": _echo_text(req.text),
        "truncation": req.truncation or "disabled",
        "store": req.store is not False,
        "background": False,
        "service_tier": "default",
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
        "completion_id": completion_id,
    }


def output_items(
    message: dict[str, Any], hexid: str, incomplete: bool, logprobs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The output items of one assistant message: reasoning, message, function calls."""
    status = "incomplete" if incomplete else "completed"
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{hexid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": status,
            }
        )
    if text or not calls:
        plain = not reasoning and not calls  # the logprobs cover exactly this text
        part = {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": logprobs if plain else [],
        }
        items.append(
            {
                "type": "message",
                "id": f"msg_{hexid}",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        )
    for tc in calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + tc["id"].removeprefix("call_"),
                "call_id": tc["id"],
                "name": tc["function"]["name"],
                "arguments": tc["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    keys = ("type", "name", "description", "parameters", "strict")
    return {k: tool.get(k) for k in keys}


def _echo_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice.get("name")}
    return choice or "auto"


def _echo_reasoning(reasoning: ReasoningConfig | None) -> dict[str, Any]:
    return reasoning.model_dump() if reasoning else {"effort": None, "summary": None}


def _echo_text(text: TextConfig | None) -> dict[str, Any]:
    out: dict[str, Any] = {"format": {"type": "text"}, "verbosity": "medium"}
    if text is not None:
        if text.format is not None:
            out["format"] = text.format.model_dump()
        if text.verbosity is not None:
            out["verbosity"] = text.verbosity
    return out


# ---------------------------------------------------------------------- the store
class ResponseStore:
    """The conversation behind each response, per session, for ``previous_response_id``.

    A session's entry goes when the session object does (removed from the proxy's
    :class:`~areal_agents.serve.session.SessionStore` and no longer referenced), or at once with
    :meth:`forget`; each session keeps its latest ``per_session`` responses.
    """

    def __init__(self, per_session: int = PER_SESSION) -> None:
        self.per_session = per_session
        self._by_session: dict[str, OrderedDict[str, list[dict[str, Any]]]] = {}

    def __len__(self) -> int:
        return len(self._by_session)

    def put(self, session: Session, response_id: str, conversation: list[dict[str, Any]]) -> None:
        kept = self._by_session.get(session.id)
        if kept is None:
            kept = self._by_session[session.id] = OrderedDict()
            weakref.finalize(session, self._by_session.pop, session.id, None)
        kept[response_id] = conversation
        while len(kept) > self.per_session:
            kept.popitem(last=False)

    def get(self, session: Session, response_id: str) -> list[dict[str, Any]] | None:
        kept = self._by_session.get(session.id)
        return None if kept is None else kept.get(response_id)

    def count(self, session_id: str) -> int:
        """How many responses of ``session_id`` are kept."""
        return len(self._by_session.get(session_id, {}))

    def forget(self, session_id: str) -> None:
        self._by_session.pop(session_id, None)


STORE = ResponseStore()
"""The process's response store (session ids are unique across proxies)."""
