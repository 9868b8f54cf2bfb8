"""A user-written environment: check it, evaluate a model on it, play it.

The agent must find the secret word of the day by calling ``lookup_word``, then say it.
Run: ``python examples/agents/custom_env.py --episodes 4`` (0 episodes: no evaluation).
Its id from the shell is ``custom_env:SecretWordEnv``, with this folder on PYTHONPATH:
``PYTHONPATH=examples/agents areal-agent train env.id=custom_env:SecretWordEnv ...``
"""

import argparse

from areal_agents import envs
from areal_agents.cli import main as cli
from areal_agents.tools import function_tool


@function_tool(state_params=["secret"])
def lookup_word(day: str, secret: str) -> str:
    """Look up the secret word of a day of the week (e.g. "monday")."""
    return secret if day.lower() == "monday" else f"No word for {day}."


class SecretWordEnv(envs.AgentEnv):
    """Find Monday's secret word with the lookup_word tool and say it."""

    WORDS = ("apple", "river", "stone", "cloud")

    def __init__(self, max_turns=3):
        super().__init__(max_turns=max_turns)

    def _start(self, options):
        index = options.get("task_index", int(self.np_random.integers(len(self.WORDS))))
        self.word = self.WORDS[index]
        self._tools = [lookup_word.bind(secret=self.word)]
        return [{"role": "user", "content": "What is Monday's secret word?"}], {"task_id": index}

    def _respond(self, message):
        success = self.word in (message.get("content") or "").lower()
        return [], float(success), True, {"success": success}

    def score(self, messages):
        answers = [m for m in messages if m["role"] == "assistant" and not m.get("tool_calls")]
        success = bool(answers) and self.word in (answers[-1].get("content") or "").lower()
        return float(success), {"success": success}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=0, help="evaluate the default model")
    episodes = parser.parse_args().episodes
    env = SecretWordEnv()
    envs.check_env(env)  # seeding, tools, rewards, termination and score
    if episodes > 0:  # `areal-agent eval --env custom_env:SecretWordEnv` (the CLI imports it)
        argv = ["eval", "--env", "custom_env:SecretWordEnv", "--episodes", str(episodes)]
        cli.main([*argv, "--max-tokens", "48"])  # the default model, offline
    env.reset(seed=0)  # a scripted episode: call the tool, read the word, say it
    call = {"id": "c1", "function": {"name": "lookup_word", "arguments": '{"day": "Monday"}'}}
    print(env.step({"role": "assistant", "content": "", "tool_calls": [call]})[0][0]["content"])
    print(env.step(f"The word is {env.word}.")[1:])
