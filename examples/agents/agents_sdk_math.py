"""An OpenAI Agents SDK agent, unchanged, as the agent of areal/Calculator-v0 episodes.

The Runner opens one proxy session per episode and hands the agent an ``AgentTask``;
``run_agent`` points the SDK at that session and adds the env's calculator to the agent's
own function tools, so every model call is recorded; the env scores the conversation.
Run (needs ``pip install -e '.[agents]'``): ``python examples/agents/agents_sdk_math.py``
"""

import argparse
import asyncio
import functools

from agents import Agent, MaxTurnsExceeded, ModelSettings, function_tool

from areal_agents import ChatTokenizer, EmbeddedEngine, Proxy, ProxyServer, envs, resolve_model
from areal_agents.integrations.openai_agents import run_agent
from areal_agents.rollout.evaluate import evaluate
from areal_agents.rollout.runner import AgentTask, Runner


@function_tool
def round_number(value: float, digits: int) -> float:
    """Round ``value`` to ``digits`` digits after the decimal point."""
    return round(value, digits)


async def solve(agent: Agent, max_turns: int, task: AgentTask) -> str | None:
    """The Runner's agent: the env's messages (system prompt, question) are the SDK's input."""
    try:
        result = await run_agent(
            agent,
            task.messages,
            base_url=task.base_url,
            api_key=task.api_key,
            tools=task.tools,
            max_turns=max_turns,
        )
    except MaxTurnsExceeded:  # out of turns: the env scores what was said so far
        return None
    return str(result.final_output)


def make_env() -> object:
    return envs.make("areal/Calculator-v0", split="test")


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(None)  # the offline default model
    tokenizer = ChatTokenizer.from_dir(path)
    proxy = Proxy(EmbeddedEngine.from_pretrained(path, decode=tokenizer.decode), tokenizer)
    settings = ModelSettings(temperature=0.7, max_tokens=args.max_tokens)
    agent = Agent(name="solver", tools=[round_number], model_settings=settings)
    with ProxyServer.start(proxy) as server:  # the SDK talks HTTP to the proxy
        runner = Runner(proxy, base_url=server.base_url)
        report, groups = await evaluate(
            runner,
            make_env,
            env_id="areal/Calculator-v0",
            episodes=args.episodes,
            agent=functools.partial(solve, agent, args.max_turns),
        )
        await proxy.engine.close()
    for r in (r for group in groups for r in group):
        calls = sum(len(c.message.get("tool_calls") or []) for c in r.episode.completions)
        print(
            f"task={r.episode.task_id} reward={r.reward:.2f} success={r.success} "
            f"end={r.end_reason} completions={len(r.episode.completions)} tool_calls={calls} "
            f"predicted={r.info.get('predicted')!r} answer={r.info.get('answer')!r}"
        )
    print(report.table())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=4, help="SDK model turns per episode")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per model call")
    asyncio.run(main(parser.parse_args()))
