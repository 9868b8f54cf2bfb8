"""A customer-service agent on areal/Tau2Retail-v0, with the customer played by the same model.

The Runner drives each episode (env-driven): every agent turn is a recorded chat completion,
and the env runs its tool calls or passes its reply to the simulated customer. The customer
is an ``LLMUserSimulator`` pointed at the same in-process proxy with the admin key, so its
calls are served but never recorded: an episode holds the agent's turns only.
Run: ``python examples/agents/tau2_retail.py --episodes 1 --max-turns 2``
"""

import argparse
import asyncio
import secrets

from areal_agents import ChatTokenizer, EmbeddedEngine, Proxy, ProxyServer, envs, resolve_model
from areal_agents.envs.tau2 import LLMUserSimulator
from areal_agents.rollout.evaluate import evaluate
from areal_agents.rollout.runner import Runner


def said(message: dict) -> str:
    calls = [call["function"]["name"] for call in message.get("tool_calls") or []]
    return f"calls {calls}" if calls else " ".join((message.get("content") or "").split())[:90]


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(None)  # the offline default model
    tokenizer = ChatTokenizer.from_dir(path)
    engine = EmbeddedEngine.from_pretrained(path, decode=tokenizer.decode)
    proxy = Proxy(engine, tokenizer, admin_key=secrets.token_hex(16))
    with ProxyServer.start(proxy) as server:  # the customer talks HTTP to the proxy
        customer = LLMUserSimulator(
            server.base_url, proxy.admin_key, proxy.model_name, max_tokens=args.max_tokens
        )

        def make_env() -> object:
            return envs.make(
                "areal/Tau2Retail-v0",
                split="test",
                user_simulator=customer,
                max_turns=args.max_turns,
            )

        sampling = {"temperature": 0.7, "max_tokens": args.max_tokens}
        runner = Runner(proxy, sampling=sampling)
        report, groups = await evaluate(
            runner, make_env, env_id="areal/Tau2Retail-v0", episodes=args.episodes
        )
        await engine.close()
    for r in (r for group in groups for r in group):
        print(
            f"task={r.episode.task_id} reward={r.reward:.2f} success={r.success} turns={r.turns} "
            f"completions={len(r.episode.completions)} end={r.end_reason} "
            f"termination={r.info.get('termination')}"
        )
        last = r.episode.completions[-1] if r.episode.completions else None
        for m in [*last.messages[1:], last.message] if last else []:  # skip the policy
            print(f"  {m['role']}: {said(m)}")
    print(report.table())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2, help="tasks of the test split")
    parser.add_argument("--max-turns", type=int, default=6, help="agent messages per episode")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per model call")
    asyncio.run(main(parser.parse_args()))
