"""``agent:`` in the training config: the user's agent (an OpenAI Agents SDK ``Agent``, run
unchanged) drives every episode in this process, the env scores what it did, and the loop
trains on the completions its session recorded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from areal_agents import envs
from areal_agents.envs.base import AgentEnv
from areal_agents.trainer.config_io import load_config

INSTRUCTIONS = "You answer in a few words."


class LengthParity(AgentEnv):
    """One question; the score is the parity of the final answer's length (so groups of a
    random tiny model are rarely uniform and the step has a gradient)."""

    def _start(self, options):
        self.task = int(self.np_random.integers(1_000_000))
        return [{"role": "user", "content": f"Name a number near {self.task}."}], {
            "task_id": str(self.task)
        }

    def tools(self):
        return []

    def _respond(self, message):
        raise AssertionError("agent-driven episodes are scored, not stepped")

    def score(self, messages):
        reward = float(len(messages[-1].get("content") or "") % 2)
        return reward, {"success": reward > 0}


def make_agent(max_tokens: int = 8):
    """The factory the config names (by this file's path)."""
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def double(x: int) -> int:
        """Twice x."""
        return 2 * x

    return Agent(
        name="solver",
        instructions=INSTRUCTIONS,
        tools=[double],
        model_settings=ModelSettings(temperature=1.0, max_tokens=max_tokens),
    )


@pytest.mark.slow
def test_an_agents_sdk_agent_is_trained_in_process(tiny_model_dir, tmp_path, engine_overrides):
    pytest.importorskip("agents")
    from areal_agents.trainer.loop import Trainer

    envs.register("test/LengthParity-v0", LengthParity, description="agent test", override=True)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.id=test/LengthParity-v0",
            f"agent.factory={Path(__file__)}:make_agent",
            "agent.kwargs={max_tokens: 6}",
            "agent.train=[solver]",  # the only agent: every call is named and trained
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=4",
            "rollout.batch_size=2",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "optim.lr=1e-3",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
            *engine_overrides,
        ],
    )

    seen = []

    class Recording(Trainer):
        async def _train_step(self, got, *args):
            seen.extend(r for _, eps in got for r in eps)
            return await super()._train_step(got, *args)

    trainer = Recording(cfg, quiet=True)
    asyncio.run(trainer.run())
    assert type(trainer.source).__name__ == "AgentSource"
    proxy = trainer.source.runner.proxy  # the env rewards: the agent's key cannot, nor open
    assert proxy.self_rewarding is False and proxy.open_sessions is False
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["grad_norm"] > 0 for r in rows), "the agent's episodes carried no gradient"
    assert len(seen) == 16
    assert all(r["masked_completions"] == 0 for r in rows)
    assert all(c.agent == "solver" for r in seen for c in r.episode.completions)
    ledger = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert all(row["masked"] == [] and row["completions"] for row in ledger)
    from dataclasses import asdict

    from areal_agents.serve.store import EpisodeStore

    store = EpisodeStore(out / "episodes.db")  # the run's store holds every episode exactly
    assert not store.session_ids(ended=False)
    for r in seen:
        kept = store.load(r.episode.session_id)
        assert kept is not None and kept.episode.end_reason == r.end_reason
        assert [asdict(c) for c in kept.episode.completions] == [
            asdict(c) for c in r.episode.completions
        ]
    store.close()
    for r in seen:
        first = r.episode.completions[0]
        # the SDK's own request: the agent's instructions first, its tool offered
        assert first.messages[0] == {"role": "system", "content": INSTRUCTIONS}
        assert [t["function"]["name"] for t in first.tools or []] == ["double"]
        assert all(c.sampling["max_new_tokens"] <= 6 for c in r.episode.completions)
        assert r.end_reason == "terminated"


def test_the_agents_sdk_example_config_resolves_and_its_factory_loads():
    pytest.importorskip("agents")
    from areal_agents.rollout.task_agent import SDKAgent, load_agent

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "examples" / "agents" / "train_agents_sdk.yaml")
    assert cfg.agent.factory == "examples/agents/train_agents_sdk.py:make_agent"
    agent = load_agent(str(repo / cfg.agent.factory), cfg.agent.kwargs, max_turns=3)
    assert isinstance(agent, SDKAgent) and agent.name == "solver"
    # no temperature of its own: its calls sample as `sampling` says, per task kind
    assert agent.agent.model_settings.temperature is None and agent.max_turns == 3
    assert cfg.sampling.by_kind == {"arithmetic": {"temperature": 1.0}}


def test_a_bad_agent_factory_fails_before_any_episode(tmp_path):
    from areal_agents.errors import ConfigError
    from areal_agents.rollout.task_agent import load_agent

    with pytest.raises(ConfigError, match=r"expected 'pkg\.module:factory'"):
        load_agent("no_colon")
    with pytest.raises(ConfigError, match="cannot load agent factory"):
        load_agent("no_such_module_here:make")
    (tmp_path / "f.py").write_text("def make(x):\n    return 42\n")
    with pytest.raises(ConfigError, match="cannot take kwargs"):
        load_agent(f"{tmp_path / 'f.py'}:make", {"y": 1})
    with pytest.raises(ConfigError, match="expected an OpenAI Agents SDK Agent"):
        load_agent(f"{tmp_path / 'f.py'}:make", {"x": 1})
    with pytest.raises(ConfigError, match=r"agent\.factory"):
        load_config(None, ["env.id=x", "agent.factory=not a spec"])
    with pytest.raises(ConfigError, match="external agents bring their own code"):
        load_config(None, ["env.id=x", "agent.factory=a:b", "rollout.agents=external"])
