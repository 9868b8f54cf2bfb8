"""Train an OpenAI Agents SDK agent, unchanged, on areal/Calculator-v0 in this process.

The agent has instructions and a function tool of its own (``round_number``); each episode
runs it with ``Runner.run`` against a proxy session, with the env's calculator added to its
tools; the env scores its final answer and the trainer trains on what its session recorded.
The warm start renders the env's demonstrations the way this agent's prompts look (its
instructions first, its tool list), so it teaches the format the agent will be sampled in::

    areal-agent train --config examples/agents/train_agents_sdk.yaml
    areal-agent eval --env areal/Calculator-v0 --env-kwargs '{"split": "test"}' \\
        --agent examples/agents/train_agents_sdk.py:make_agent \\
        --agent-kwargs '{"temperature": 0}' --episodes 128 \\
        --adapter runs/agents-sdk/checkpoints/step-000008/model
"""

from __future__ import annotations

from agents import Agent, ModelSettings, function_tool

INSTRUCTIONS = (
    "You solve arithmetic word problems. Call the calculator with the expression, then "
    "give the final answer as a number."
)


@function_tool
def round_number(value: float, digits: int) -> float:
    """Round ``value`` to ``digits`` digits after the decimal point."""
    return round(value, digits)


def make_agent(temperature: float | None = None, max_tokens: int = 64) -> Agent:
    """The factory the config names. The agent samples as its model settings say (None:
    the proxy's default, 1.0); the trainer scores each token at the temperature its call
    was sampled with."""
    return Agent(
        name="solver",
        instructions=INSTRUCTIONS,
        tools=[round_number],
        model_settings=ModelSettings(temperature=temperature, max_tokens=max_tokens),
    )
