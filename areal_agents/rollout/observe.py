"""What an agent's prompts look like: the messages it puts before an env's task and the tools
it offers, found by running it once against a proxy whose engine ends every reply at once.

A warm start (``areal-agent demos --agent``, the trainer's ``sft`` with an in-process agent)
renders demonstrations with them, so they look the way the agent's own prompts will.
"""

from __future__ import annotations

from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.rollout.runner import Runner
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import LoopServer
from areal_agents.testing.fake_engine import FakeEngine

__all__ = ["observe_prompt"]


async def observe_prompt(
    agent: Any, make_env: Any, tokenizer: Any, *, seed: int | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What ``agent`` puts around an env's task in its first model call: the messages it
    sends before the env's own (an Agents SDK agent's instructions, say) and the tools it
    offers (its own and the env's, in its order, as the proxy renders them).

    Found by running it once on one task against a proxy whose engine ends every reply at
    once, so a warm start can render demonstrations exactly as the agent's prompts look.
    Raises :class:`ConfigError` when the agent made no model call.
    """
    ends = list(tokenizer.eos_token_ids)[:1]
    proxy = Proxy(FakeEngine(lambda ids, p: list(ends)), tokenizer)
    server = LoopServer(proxy)
    await server.start()
    try:
        env = make_env()
        try:
            task_messages, _ = env.reset(seed=seed)
        finally:
            env.close()
        runner = Runner(proxy, base_url=server.base_url, max_turns=1, episode_timeout_s=120)
        result = await runner.run_episode(make_env, seed=seed, agent=agent)
    finally:
        await server.stop()
    if not result.episode.completions:
        raise ConfigError(
            f"the agent made no model call on a probe task ({result.end_reason}: "
            f"{result.error}); it must call the session's model to be trained"
        )
    first = result.episode.completions[0]
    sent = [dict(m) for m in first.messages]
    head = dict(task_messages[0]) if task_messages else None
    at = next((i for i, m in enumerate(sent) if _same_message(m, head)), len(sent))
    return sent[:at], first.tools


def _same_message(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
    return b is not None and (a.get("role"), a.get("content")) == (b.get("role"), b.get("content"))
