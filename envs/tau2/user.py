"""User simulators: who plays the customer in a tau² conversation.

A user simulator turns the conversation so far into the customer's next message. It is
stateless between calls (the env passes the whole visible conversation every time), so one
simulator object can serve many concurrent episodes. The customer ends the conversation by
writing one of the benchmark's tokens:

- ``###STOP###``: the customer's goal is met (or they give up);
- ``###TRANSFER###``: the customer was transferred to a human agent;
- ``###OUT-OF-SCOPE###``: the scenario does not say how to go on.

Three simulators ship:

- :class:`LLMUserSimulator` plays the user from the task's scenario through any
  OpenAI-compatible endpoint with the async ``openai`` client;
- :class:`ProxyUserSimulator` plays it with a proxy's own engine, in process and recorded in
  no session (a training run's default customer: the model being trained);
- :class:`ScriptedUserSimulator` replays fixed turns (tests, demos, conformance checks).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import openai

from areal_agents.envs.tau2.data import Task
from areal_agents.errors import EnvError

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)
"""The tokens with which the simulated user ends the conversation."""

GREETING = "Hi! How can I help you today?"
"""The agent's first message, as in the benchmark; the user answers it."""

Message = dict[str, Any]

GUIDELINES = """\
You are a customer contacting a customer-service agent. Play this customer realistically,
following the scenario below.

Rules:
- Write one message at a time, as the customer would, in natural language.
- Follow the scenario's instructions closely. Do not invent facts the scenario does not
  give you: anything it does not mention is unknown to you.
- Do not recite the instructions word for word; put things in your own words.
- Reveal information step by step: give a detail when the agent asks for it.

Ending the conversation:
- When the goal of the scenario is met, reply with exactly ###STOP###.
- If you are transferred to another (human) agent, reply with exactly ###TRANSFER###.
- If the scenario does not tell you enough to go on, reply with exactly ###OUT-OF-SCOPE###.
"""


def stop_token(text: str | None) -> str | None:
    """The first stop token found in ``text``, or ``None``."""
    for token in STOP_TOKENS:
        if text and token in text:
            return token
    return None


def user_system_prompt(task: Task) -> str:
    """The user simulator's system prompt for ``task``: guidelines, persona and scenario."""
    persona = f"<persona>\n{task.persona}\n</persona>\n" if task.persona else ""
    return f"{GUIDELINES}\n{persona}<scenario>\n{task.instructions}\n</scenario>"


def customer_messages(task: Task, conversation: Sequence[Message]) -> list[Message]:
    """The chat messages a model playing the customer gets: the system prompt, then the
    dialogue with roles flipped (the agent's messages as ``user``, the customer's own as
    ``assistant``)."""
    messages: list[Message] = [{"role": "system", "content": user_system_prompt(task)}]
    for message in conversation:
        role = message.get("role")
        if role in ("assistant", "user") and message.get("content"):
            flipped = "user" if role == "assistant" else "assistant"
            messages.append({"role": flipped, "content": str(message["content"])})
    return messages


def _reply_text(content: Any, model: Any) -> str:
    """The customer's message out of a model's reply, or EnvError when it is empty."""
    if not content or not str(content).strip():
        raise EnvError(f"user simulator model {model!r} returned an empty message")
    return str(content).strip()


class UserSimulator(abc.ABC):
    """Plays the customer. Subclasses implement :meth:`respond`."""

    @abc.abstractmethod
    async def respond(self, task: Task, conversation: Sequence[Message]) -> str:
        """The customer's next message.

        Args:
            task: The task whose scenario the customer follows.
            conversation: The visible dialogue so far, in order: ``assistant`` messages
                (the agent's replies, starting with :data:`GREETING`) and ``user`` messages
                (the customer's earlier replies). Tool calls and results are not included.

        Raises:
            EnvError: If no reply can be produced (the env records it; the episode ends).
        """


class ScriptedUserSimulator(UserSimulator):
    """Replies with fixed turns, in order; after the last one it replies ``###STOP###``.

    The reply is chosen by the number of user messages already in the conversation, so the
    simulator holds no state and can be shared between episodes.

    Args:
        turns: The customer's messages, first one first.

    Example:
        >>> import asyncio
        >>> user = ScriptedUserSimulator(["I want to cancel an order.", "###STOP###"])
        >>> asyncio.run(user.respond(None, [{"role": "assistant", "content": GREETING}]))
        'I want to cancel an order.'
    """

    def __init__(self, turns: Sequence[str]) -> None:
        if isinstance(turns, str) or not all(isinstance(t, str) for t in turns):
            raise TypeError(f"expected a list of str turns, got {turns!r:.80}")
        if not turns:
            raise ValueError("expected at least one scripted user turn, got none")
        self.turns = list(turns)

    async def respond(self, task: Task | None, conversation: Sequence[Message]) -> str:
        """The next scripted turn (``###STOP###`` once the script is used up)."""
        index = sum(1 for message in conversation if message.get("role") == "user")
        return self.turns[index] if index < len(self.turns) else STOP


class LLMUserSimulator(UserSimulator):
    """Plays the customer with a chat model behind any OpenAI-compatible endpoint.

    The model sees the guidelines and the task's scenario as its system prompt and the
    dialogue with roles flipped (the agent's messages as ``user``, the customer's own as
    ``assistant``). Any failure (connection, HTTP error, empty reply) raises
    :class:`~areal_agents.errors.EnvError`, which the env records as the episode's error.

    Args:
        base_url: The endpoint's base URL, such as ``"http://127.0.0.1:8000/v1"`` (may be
            ``None`` when ``client`` is given).
        api_key: The endpoint's API key (``None``: ``"EMPTY"``, for servers that ignore it).
        model: The model name to request; ``None``: the first model the endpoint lists
            (``GET /models``), asked once.
        temperature: Sampling temperature (0 keeps the customer consistent).
        max_tokens: Cap on the reply's length, or ``None`` for the server's default.
        timeout_s: Per-request timeout in seconds.
        max_retries: Retries of the ``openai`` client on transient errors.
        extra_body: Extra fields sent with every request (server-specific options).
        client: An ``openai.AsyncOpenAI`` to use instead of building one per request; it
            must be used from a single event loop.
        http_client: An ``httpx.AsyncClient`` for the ``openai`` client (for example with
            a fake transport in tests).
    """

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        model: str | None,
        *,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        extra_body: Mapping[str, Any] | None = None,
        client: Any = None,
        http_client: Any = None,
    ) -> None:
        if client is None and not base_url:
            raise ValueError(
                "LLMUserSimulator needs base_url (an OpenAI-compatible endpoint such as "
                "'http://127.0.0.1:8000/v1') or a ready openai.AsyncOpenAI as client="
            )
        self.base_url = base_url
        self.api_key = api_key or "EMPTY"
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.extra_body = dict(extra_body or {})
        self._client = client
        self._http_client = http_client

    def _new_client(self) -> Any:
        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout_s,
            max_retries=self.max_retries,
            http_client=self._http_client,
        )

    def messages_for(self, task: Task, conversation: Sequence[Message]) -> list[Message]:
        """The chat messages sent to the model (:func:`customer_messages`)."""
        return customer_messages(task, conversation)

    async def _model_name(self, client: Any) -> str:
        """``model``, else the first model ``client``'s endpoint lists (then kept)."""
        if self.model is None:
            listed = [m.id async for m in client.models.list()]
            if not listed:
                raise EnvError(f"user simulator endpoint {self.base_url} lists no model")
            self.model = str(listed[0])
        return self.model

    async def respond(self, task: Task, conversation: Sequence[Message]) -> str:
        """Ask the model for the customer's next message."""
        request: dict[str, Any] = {
            "messages": self.messages_for(task, conversation),
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        if self.extra_body:
            request["extra_body"] = self.extra_body
        try:
            if self._client is not None:
                request["model"] = await self._model_name(self._client)
                completion = await self._client.chat.completions.create(**request)
            elif self._http_client is not None:  # the caller owns (and closes) it
                client = self._new_client()
                request["model"] = await self._model_name(client)
                completion = await client.chat.completions.create(**request)
            else:  # a client per request: safe across event loops, closed right after
                async with self._new_client() as client:
                    request["model"] = await self._model_name(client)
                    completion = await client.chat.completions.create(**request)
        except openai.OpenAIError as exc:
            raise EnvError(f"user simulator request to {self.base_url} failed: {exc}") from exc
        choices = getattr(completion, "choices", None) or []
        return _reply_text(choices[0].message.content if choices else None, self.model)


class ProxyUserSimulator(UserSimulator):
    """Plays the customer with a proxy's own engine, in process: each reply is one
    ``proxy.complete(None, request)``, answered by the proxy's model through its chat
    template and recorded in **no** session. In a training run (the default customer of
    ``areal-agent train`` when ``env.kwargs`` names none) the customer is therefore the
    model being trained, at the weights the engine holds, and its calls are never trained,
    never part of the agent's episodes (only the customer's text reaches the agent's
    prompts, as ``user`` messages) and never counted as episodes.

    Args:
        proxy: A :class:`~areal_agents.serve.proxy.Proxy` (anything with ``async
            complete(session, request)`` and ``model_name``).
        temperature: Sampling temperature (0 keeps the customer consistent).
        max_tokens: Cap on each customer message (``None``: the proxy's default).
        loop: The event loop the proxy serves on. A reply asked for on another loop (the
            env steps on worker threads, each with a loop of its own) is generated on this
            one and awaited; ``None``, or a loop that is not running: on the caller's loop
            (the embedded engine answers any loop).
    """

    def __init__(
        self,
        proxy: Any,
        *,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not callable(getattr(proxy, "complete", None)):
            raise TypeError(
                f"ProxyUserSimulator needs a Proxy (with complete()), got {type(proxy).__name__}"
            )
        self.proxy = proxy
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.loop = loop

    async def respond(self, task: Task, conversation: Sequence[Message]) -> str:
        """Ask the proxy's model for the customer's next message (not recorded)."""
        request: dict[str, Any] = {
            "model": self.proxy.model_name,
            "messages": customer_messages(task, conversation),
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        home = self.loop
        try:
            if home is not None and home.is_running() and home is not asyncio.get_running_loop():
                future = asyncio.run_coroutine_threadsafe(self.proxy.complete(None, request), home)
                body = await asyncio.wrap_future(future)
            else:
                body = await self.proxy.complete(None, request)
        except Exception as exc:  # ApiError, BackendError, ...: the episode's env_error
            message = getattr(exc, "message", None) or str(exc)
            raise EnvError(
                f"the customer's call to the proxy's model failed: {type(exc).__name__}: {message}"
            ) from exc
        choices = body.get("choices") or []
        content = (choices[0].get("message") or {}).get("content") if choices else None
        return _reply_text(content, self.proxy.model_name)
