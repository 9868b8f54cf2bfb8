"""A user-written environment: register it, check it, play one episode.

The agent must find the secret word of the day by calling ``lookup_word``, then say it.
Run: ``python examples/agents/custom_env.py``
"""

import envs
from envs.base import AgentEnv
from tools import function_tool


@function_tool(state_params=["secret"])
def lookup_word(day: str, secret: str) -> str:
    """Look up the secret word of a day.

    Args:
        day: The day of the week, e.g. "monday".
    """
    return secret if day.lower() == "monday" else f"No word for {day}."


class SecretWordEnv(AgentEnv):
    """Find Monday's secret word with the lookup_word tool and say it."""

    WORDS = ("apple", "river", "stone", "cloud")

    def _start(self, options):
        index = options.get("task_index", int(self.np_random.integers(len(self.WORDS))))
        self.word = self.WORDS[index]
        self._tools = [lookup_word.bind(secret=self.word)]
        messages = [{"role": "user", "content": "What is Monday's secret word?"}]
        return messages, {"task_id": f"word-{index}"}

    def _respond(self, message):
        success = self.word in (message.get("content") or "").lower()
        return [], float(success), True, {"success": success}

    def score(self, messages):
        answers = [m for m in messages if m["role"] == "assistant" and not m.get("tool_calls")]
        success = bool(answers) and self.word in (answers[-1].get("content") or "").lower()
        return float(success), {"success": success}


envs.register("demo/SecretWord-v0", SecretWordEnv, kwargs={"max_turns": 3}, override=True)

if __name__ == "__main__":
    env = envs.make("demo/SecretWord-v0")
    envs.check_env(env)
    obs, info = env.reset(seed=0)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "lookup_word", "arguments": '{"day": "Monday"}'},
    }
    obs, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    print(obs[0]["content"])
    print(env.step(f"The word is {obs[0]['content']}.")[1:])
