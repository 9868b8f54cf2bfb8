"""areal_agents.envs.checker: built-in envs and the example env pass check_env; broken envs
are caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_agents import envs
from areal_agents.envs import AgentEnv, EnvCheckError, check_env
from areal_agents.tools import calculator

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "custom_env.py"


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        ("areal/Math-v0", {}),
        ("areal/Math-v0", {"split": "test", "max_attempts": 1}),
        ("areal/Calculator-v0", {}),
        ("areal/Calculator-v0", {"few_shot": 2, "require_tool": True, "kind": "word"}),
    ],
)
def test_builtin_math_envs_pass_check_env(env_id, kwargs):
    check_env(envs.make(env_id, **kwargs), seed=0)
    check_env(envs.make(env_id, **kwargs), seed=123)


def test_check_env_accepts_an_id():
    check_env("areal/Calculator-v0")


def test_example_env_is_made_from_its_module_and_passes_check_env(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # as PYTHONPATH=examples/agents does
    check_env(envs.make("custom_env:SecretWordEnv"))
    assert len(EXAMPLE.read_text().splitlines()) < 60


def test_example_script_runs_an_episode_to_success():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1].startswith("(1.0, True, False")


class BrokenEnv(AgentEnv):
    """Breaks the contract in several ways at once."""

    def _start(self, options):
        self._tools = [calculator]
        task = int(self.np_random.integers(1000))
        return [{"role": "user", "content": f"task {task}"}], {"task_id": str(task)}

    def step(self, action):
        if action.get("tool_calls"):
            raise KeyError(action["tool_calls"][0]["function"]["name"])
        return [], 1, False, False, {"tool_results": []}


def test_check_env_lists_every_broken_rule():
    with pytest.raises(EnvCheckError) as caught:
        check_env(BrokenEnv(max_turns=3), seed=0)
    problems = "\n".join(caught.value.problems)
    assert "step with an unknown tool raised KeyError" in problems
    assert "step with malformed JSON arguments raised KeyError" in problems
    assert "reward must be a finite float, got 1" in problems
    assert "episode did not end within max_turns=3 steps" in problems
    assert "score(messages)" not in problems  # not reached: the episode never ended
    assert str(caught.value).startswith("BrokenEnv failed")


class NonDeterministicEnv(AgentEnv):
    """Ignores the seed and never raises after the end."""

    counter = 0

    def _start(self, options):
        NonDeterministicEnv.counter += 1
        return [{"role": "user", "content": "hi"}], {"task_id": str(self.counter)}

    def _respond(self, message):
        return [], 0.0, True, {"success": False}

    def step(self, action):
        out = super().step(action)
        self._active = True  # wrongly keeps the episode open after it ended
        return out


def test_check_env_catches_seed_nondeterminism_and_stepping_after_the_end():
    with pytest.raises(EnvCheckError) as caught:
        check_env(NonDeterministicEnv())
    problems = "\n".join(caught.value.problems)
    assert "reset with the same seed gave a different task_id" in problems
    assert "step after the end of the episode did not raise" in problems
    assert "does not implement score()" in problems


def test_gymnasium_make_creates_every_registered_env():
    """Every id `areal-agent envs` lists is created by plain ``gymnasium.make``."""
    import gymnasium

    from areal_agents.envs.registry import list_envs
    from areal_agents.envs.tau2 import ScriptedUserSimulator

    ids = [env_id for env_id, _ in list_envs()]
    assert {
        "areal/Math-v0",
        "areal/Calculator-v0",
        "areal/Search-v0",
        "areal/Tau2Retail-v0",
        "areal/Tau2Airline-v0",
    } <= set(ids)
    for env_id in ids:
        # tau2 episodes need a user simulator (an LLM endpoint, or a script in tests)
        kw = (
            {"user_simulator": ScriptedUserSimulator(["Hi, I need help."])}
            if "Tau2" in env_id
            else {}
        )
        env = gymnasium.make(env_id, **kw)
        obs, info = env.reset(seed=0)
        assert obs and isinstance(info.get("tools"), list), env_id
        env.close()
