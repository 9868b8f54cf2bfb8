"""OpenAI Agents SDK agents, run unchanged against a proxy session.

An ``agents.Agent`` runs through the proxy when its model's client holds the session's
``base_url`` and API key; every model call of the run (the agent's turns, and those of the
agents it hands off to) is then recorded in that session's episode. The SDK's default model
class calls the Responses API (``POST /v1/responses``) and the chat-completions model calls
``POST /v1/chat/completions``; the proxy records both the same way, token by token. Handoffs
and several agents in one episode need nothing more: their calls go through the same session
and form several branches of one completion tree (a new agent starts with its own system
prompt, so its first call is not a continuation of the last).

Example (``pip install -r requirements/openai-agents.txt``; the SDK is imported lazily)::

    from agents import Agent
    from areal_agents.integrations.openai_agents import run_agent
    from areal_agents.tools import calculator

    agent = Agent(name="solver", instructions="Use the calculator.")
    session = proxy.sessions.create()
    result = await run_agent(
        agent, "What is 6 * 7?",
        base_url=server.base_url, api_key=session.api_key, tools=[calculator],
    )
    result.final_output            # what the SDK returned
    session.episode.completions    # what the proxy recorded, token by token

``run_agent(..., api="chat")`` uses the chat-completions model instead of the Responses one.

Agents that are not ours to change
----------------------------------
An agent with no ``model`` uses the SDK's default client, which the SDK builds once per
process from ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``: a process that runs one episode
needs only those two variables set to the session's ``base_url`` and ``api_key``. To run
several episodes concurrently in one process, wrap each in :func:`session_scope`::

    async def episode(session):
        with session_scope(server.base_url, session.api_key):
            return await Runner.run(agent, task)      # agent and Runner call unchanged

    await asyncio.gather(*(episode(s) for s in sessions))

:func:`session_scope` installs (once) a default client whose requests read the base URL and
key from a context variable, so each asyncio task's calls land in its own session; outside a
scope that client falls back to ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``. Installing it also
turns the SDK's tracing off (its exporter would send the session key to the OpenAI platform);
with only the variables set, set ``OPENAI_AGENTS_DISABLE_TRACING=1`` as well.

Pieces, for code that calls ``Runner.run`` itself: :func:`session_model` (the model to give
``Agent(model=...)`` or ``RunConfig(model=...)``) and :func:`as_function_tools` (our
:class:`areal_agents.tools.tool.Tool` objects as SDK function tools).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

try:
    import httpx2 as httpx  # what openai >= 3 is built on
except ImportError:
    import httpx  # type: ignore[no-redef]

if TYPE_CHECKING:
    from agents import Agent, FunctionTool, Model, RunConfig, RunResult
    from agents.items import TResponseInputItem

    from areal_agents.tools.tool import Tool

__all__ = [
    "as_function_tools",
    "install_session_routing",
    "run_agent",
    "session_model",
    "session_scope",
]

Api = Literal["responses", "chat"]

_SCOPE: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "areal_agents_openai_session", default=None
)
_PLACEHOLDER = "http://areal-agents-session.invalid/v1"
"""The routing client's own base URL; every request is sent on to the scope's session."""
_AGENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "areal_agents_openai_agent", default=None
)
"""The name of the SDK agent whose model call is being made (set just before each call)."""
AGENT_HEADER = "X-Areal-Agent"  # the proxy's areal_agents.serve.routes.AGENT_HEADER
_install_lock = threading.Lock()
_routing_client: AsyncOpenAI | None = None


def session_model(
    base_url: str, api_key: str, model: str = "default", *, api: Api = "responses"
) -> Model:
    """A model that sends every call to one proxy session.

    Args:
        base_url: The proxy's OpenAI base URL (``server.base_url`` or the ``base_url`` that
            ``POST /sessions`` returns), ending in ``/v1``.
        api_key: The session's API key; it decides which episode records the calls.
        model: The model name sent with each request (the proxy serves one model).
        api: ``"responses"`` (the SDK's default model class, ``OpenAIResponsesModel``) or
            ``"chat"`` (``OpenAIChatCompletionsModel``).
    """
    _check_api(api)
    return _model_on(AsyncOpenAI(base_url=base_url, api_key=api_key), model, api)


def _check_api(api: str) -> None:
    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")


def _model_on(client: AsyncOpenAI, model: str, api: Api) -> Model:
    from agents import (  # noqa: PLC0415  the SDK is an optional extra
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
    )

    if api == "chat":
        return OpenAIChatCompletionsModel(model=model, openai_client=client)
    return OpenAIResponsesModel(model=model, openai_client=client)


@contextmanager
def session_scope(base_url: str, api_key: str) -> Iterator[None]:
    """Send the SDK's default-client calls made in this context to one proxy session.

    The scope is a context variable: the asyncio tasks started inside inherit it, and
    concurrent tasks each in their own scope reach their own sessions. The first use installs
    the routing client as the SDK's default client (see the module docstring).

    Args:
        base_url: The proxy's OpenAI base URL, ending in ``/v1``.
        api_key: The session's API key.
    """
    install_session_routing()
    token = _SCOPE.set((base_url.rstrip("/"), api_key))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def install_session_routing() -> AsyncOpenAI:
    """Install (once per process) the SDK default client that follows :func:`session_scope`.

    The client keeps one connection pool per event loop (a pool cannot outlive its loop)
    and connects directly, without an HTTP proxy from the environment. Installing it also
    disables the SDK's tracing, whose exporter would send the key to the OpenAI platform.
    Returns the client.
    """
    global _routing_client
    from agents import (  # noqa: PLC0415  the SDK is an optional extra
        set_default_openai_client,
        set_tracing_disabled,
    )

    with _install_lock:
        if _routing_client is None:
            http = DefaultAsyncHttpxClient(transport=_session_transport(), trust_env=False)
            _routing_client = AsyncOpenAI(
                base_url=_PLACEHOLDER, api_key="areal-session-scope", http_client=http
            )
        set_tracing_disabled(True)
        set_default_openai_client(_routing_client, use_for_tracing=False)
        return _routing_client


def _session_transport() -> Any:
    """An httpx transport that sends each request to the current scope's session."""

    class SessionTransport(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self._pools: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

        async def handle_async_request(self, request: Any) -> Any:
            _route(request)
            loop = asyncio.get_running_loop()
            pool = self._pools.get(loop)
            if pool is None:
                limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
                pool = self._pools[loop] = httpx.AsyncHTTPTransport(limits=limits)
            return await pool.handle_async_request(request)

        async def aclose(self) -> None:
            pool = self._pools.pop(asyncio.get_running_loop(), None)
            if pool is not None:
                await pool.aclose()

    return SessionTransport()


def _route(request: Any) -> None:
    """Point a request of the routing client at the scope's session (URL, Host, key)."""
    scope = _SCOPE.get()
    if scope is None:
        base, key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
        if not base or not key:
            raise RuntimeError(
                "no proxy session for this OpenAI call: run the agent inside "
                "session_scope(base_url, api_key), or set OPENAI_BASE_URL and OPENAI_API_KEY"
            )
        scope = (base.rstrip("/"), key)
    base, key = scope
    path = request.url.raw_path.decode("ascii").removeprefix("/v1")  # path and query
    request.url = type(request.url)(base + path)
    request.headers["Host"] = request.url.netloc.decode("ascii")
    request.headers["Authorization"] = f"Bearer {key}"


def as_function_tools(tools: Sequence[Tool]) -> list[FunctionTool]:
    """Our tools as SDK function tools: same name, description and parameter schema.

    Invoking one runs ``Tool.acall`` on the model's JSON arguments and gives the model the
    result's content; bad arguments and failures come back as an ``Error: ...`` message the
    model reads, never as an exception that ends the run. A schema becomes strict only when
    it already is (every object closed, every property required): the SDK's strict mode would
    otherwise make optional arguments required.
    """
    from agents import FunctionTool  # noqa: PLC0415  the SDK is an optional extra

    out = []
    for tool in _checked(tools):
        parameters = copy.deepcopy(tool.parameters)
        out.append(
            FunctionTool(
                name=tool.name,
                description=tool.description,
                params_json_schema=parameters,
                on_invoke_tool=_invoker(tool),
                strict_json_schema=_is_strict(parameters),
            )
        )
    return out


async def run_agent(
    agent: Agent[Any],
    input: str | list[TResponseInputItem],
    *,
    base_url: str,
    api_key: str,
    tools: Sequence[Tool] | None = None,
    model: str = "default",
    max_turns: int | None = None,
    context: Any = None,
    run_config: RunConfig | None = None,
    api: Api = "responses",
) -> RunResult:
    """Run ``agent`` on ``input`` with every model call recorded in one proxy session.

    The agent is not modified: the run uses ``agent.clone(...)`` with the session model and
    the agent's own tools plus ``tools``. ``RunConfig.model`` is set to the session model
    too, so agents reached by handoff also go through the session. Tracing is off unless
    ``run_config`` says otherwise (its exporter would call the OpenAI platform).

    Args:
        agent: The user's agent, unchanged.
        input: The user input (a string or a list of SDK input items).
        base_url: The proxy's OpenAI base URL, ending in ``/v1``.
        api_key: The session's API key.
        tools: Extra tools (:class:`areal_agents.tools.tool.Tool`), e.g. the environment's.
        model: The model name sent with each request.
        max_turns: The SDK's turn limit; ``None`` keeps the SDK's default.
        context: The run context handed to tools and hooks.
        run_config: A run configuration to start from; its ``model`` is replaced.
        api: ``"responses"`` (``POST /v1/responses``, the SDK's default model class) or
            ``"chat"`` (``POST /v1/chat/completions``).

    Returns:
        The SDK's ``RunResult`` (``final_output``, ``new_items``, ``raw_responses``, ...).

    Raises:
        ValueError: An extra tool has the name of one of the agent's tools, or ``api`` is
            neither ``"responses"`` nor ``"chat"``.
    """
    from agents import RunConfig, Runner  # noqa: PLC0415  the SDK is an optional extra

    _check_api(api)
    extra = as_function_tools(tools or [])
    taken = {getattr(t, "name", None) for t in agent.tools}
    clash = sorted(t.name for t in extra if t.name in taken)
    if clash:
        raise ValueError(
            f"agent {agent.name!r} already has tools named {clash}; rename the extra tools"
        )
    # the episode's own client, closed with the run (its connections are this loop's); each
    # request names the agent whose turn it is, so multi-agent runs can train some of them
    http = DefaultAsyncHttpxClient(event_hooks={"request": [_name_agent]})
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http) as client:
        session = _model_on(client, model, api)
        runnable = agent.clone(model=session, tools=[*agent.tools, *extra])
        if run_config is None:
            config = RunConfig(model=session, tracing_disabled=True)
        else:
            config = dataclasses.replace(run_config, model=session)
        noting = _noting_agent(config.call_model_input_filter)
        config = dataclasses.replace(config, call_model_input_filter=noting)
        options: dict[str, Any] = {"context": context, "run_config": config}
        if max_turns is not None:
            options["max_turns"] = max_turns
        return await Runner.run(runnable, input, **options)


# ---------------------------------------------------------------------- helpers
def _noting_agent(user_filter: Any) -> Any:
    """A ``call_model_input_filter`` that notes the calling agent's name (for the request
    header), then applies the user's own filter, if any."""

    def note(data: Any) -> Any:
        _AGENT.set(str(data.agent.name))
        return data.model_data if user_filter is None else user_filter(data)

    return note


async def _name_agent(request: Any) -> None:
    """httpx request hook: the :data:`AGENT_HEADER` of the agent whose call this is."""
    name = _AGENT.get()
    if name:
        request.headers[AGENT_HEADER] = quote(name[:256], safe=" ")


def _checked(tools: Sequence[Tool]) -> list[Tool]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(
            f"expected a list of areal_agents.tools.tool.Tool, got {type(tools).__name__}"
        )
    for tool in tools:
        if not all(hasattr(tool, a) for a in ("name", "description", "parameters", "acall")):
            raise TypeError(f"expected a areal_agents.tools.tool.Tool, got {type(tool).__name__}")
    return list(tools)


def _invoker(tool: Tool) -> Any:
    async def invoke(_context: Any, arguments: str) -> str:
        return (await tool.acall(arguments)).content

    invoke.__name__ = tool.name
    return invoke


def _is_strict(schema: Any) -> bool:
    """Whether the SDK's strict mode would leave ``schema`` as it is."""
    if not isinstance(schema, Mapping) or not ("type" in schema or "anyOf" in schema):
        return False
    subs: list[Any] = list(schema.get("anyOf", []))
    if "items" in schema:
        subs.append(schema["items"])
    types_ = schema.get("type")
    if types_ == "object" or (isinstance(types_, list) and "object" in types_):
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is not False:
            return False
        if set(schema.get("required", [])) != set(props):
            return False
        subs.extend(props.values())
    return all(_is_strict(sub) for sub in subs)
