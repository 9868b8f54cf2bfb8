"""OpenAI Agents SDK agents, run unchanged against a proxy session.

An ``agents.Agent`` runs through the proxy when its model is a chat-completions model whose
client holds the session's ``base_url`` and API key; every model call of the run (the
agent's turns, and those of the agents it hands off to) is then recorded in that session's
episode. Handoffs and several agents in one episode need nothing more: their calls go
through the same session and form several branches of one completion tree (a new agent
starts with its own system prompt, so its first call is not a continuation of the last).

Example (``pip install -r requirements/openai-agents.txt``; the SDK is imported lazily)::

    from agents import Agent
    from areal_agents.integrations.openai_agents import run_agent
    from tools import calculator

    agent = Agent(name="solver", instructions="Use the calculator.")
    session = proxy.sessions.create()
    result = await run_agent(
        agent, "What is 6 * 7?",
        base_url=server.base_url, api_key=session.api_key, tools=[calculator],
    )
    result.final_output            # what the SDK returned
    session.episode.completions    # what the proxy recorded, token by token

Pieces, for code that calls ``Runner.run`` itself: :func:`session_model` (the model to give
``Agent(model=...)`` or ``RunConfig(model=...)``) and :func:`as_function_tools` (our
:class:`tools.tool.Tool` objects as SDK function tools).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, RunConfig, RunResult
    from agents.items import TResponseInputItem

    from tools.tool import Tool

__all__ = ["as_function_tools", "run_agent", "session_model"]


def session_model(
    base_url: str, api_key: str, model: str = "default"
) -> OpenAIChatCompletionsModel:
    """A chat-completions model that sends every call to one proxy session.

    Args:
        base_url: The proxy's OpenAI base URL (``server.base_url`` or the ``base_url`` that
            ``POST /sessions`` returns), ending in ``/v1``.
        api_key: The session's API key; it decides which episode records the calls.
        model: The model name sent with each request (the proxy serves one model).
    """
    from agents import OpenAIChatCompletionsModel
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def as_function_tools(tools: Sequence[Tool]) -> list[FunctionTool]:
    """Our tools as SDK function tools: same name, description and parameter schema.

    Invoking one runs ``Tool.acall`` on the model's JSON arguments and gives the model the
    result's content; bad arguments and failures come back as an ``Error: ...`` message the
    model reads, never as an exception that ends the run. A schema becomes strict only when
    it already is (every object closed, every property required): the SDK's strict mode would
    otherwise make optional arguments required.
    """
    from agents import FunctionTool

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
        tools: Extra tools (:class:`tools.tool.Tool`), e.g. the environment's.
        model: The model name sent with each request.
        max_turns: The SDK's turn limit; ``None`` keeps the SDK's default.
        context: The run context handed to tools and hooks.
        run_config: A run configuration to start from; its ``model`` is replaced.

    Returns:
        The SDK's ``RunResult`` (``final_output``, ``new_items``, ``raw_responses``, ...).

    Raises:
        ValueError: An extra tool has the name of one of the agent's tools.
    """
    from agents import RunConfig, Runner

    session = session_model(base_url, api_key, model)
    extra = as_function_tools(tools or [])
    taken = {getattr(t, "name", None) for t in agent.tools}
    clash = sorted(t.name for t in extra if t.name in taken)
    if clash:
        raise ValueError(
            f"agent {agent.name!r} already has tools named {clash}; rename the extra tools"
        )
    runnable = agent.clone(model=session, tools=[*agent.tools, *extra])
    if run_config is None:
        config = RunConfig(model=session, tracing_disabled=True)
    else:
        config = dataclasses.replace(run_config, model=session)
    options: dict[str, Any] = {"context": context, "run_config": config}
    if max_turns is not None:
        options["max_turns"] = max_turns
    return await Runner.run(runnable, input, **options)


# ---------------------------------------------------------------------- helpers
def _checked(tools: Sequence[Tool]) -> list[Tool]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"expected a list of tools.tool.Tool, got {type(tools).__name__}")
    for tool in tools:
        if not all(hasattr(tool, a) for a in ("name", "description", "parameters", "acall")):
            raise TypeError(f"expected a tools.tool.Tool, got {type(tool).__name__}")
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
