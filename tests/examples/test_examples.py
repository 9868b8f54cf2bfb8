"""The examples in examples/agents/ run as a user runs them (short settings, default model).

Each runs in a subprocess on the offline default model and must finish and print its
report. The model rarely solves a task before training, so the tests check that episodes
ran, were recorded and were scored, not that they succeeded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
EPISODE = re.compile(r"^task=(\S+) reward=(-?[\d.]+) success=(True|False|None) (.*)$", re.M)


def run_example(name: str, *args: str, timeout_s: float = 900) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def report(out: str) -> dict[str, str]:
    """The rows of the ``EvalReport.table()`` the example printed last."""
    names = r"episodes|success rate|pass@\d+|pass\^\d+|mean reward|mean turns|ended: \w+"
    return dict(re.findall(rf"^({names})\s{{2,}}(.+)$", out, re.M))


def fields(rest: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", rest))


@pytest.mark.slow
def test_agents_sdk_math_runs_sdk_agents_as_recorded_scored_episodes():
    if importlib.util.find_spec("agents") is None:
        if os.environ.get("AREAL_REQUIRE_INTEGRATIONS") == "1":
            pytest.fail("the OpenAI Agents SDK is missing: pip install -e '.[agents]'")
        pytest.skip("needs the OpenAI Agents SDK: pip install -e '.[agents]'")
    out = run_example("agents_sdk_math.py", "--episodes=2", "--max-turns=3", "--max-tokens=48")
    episodes = EPISODE.findall(out)
    assert len(episodes) == 2, out
    for task_id, reward, success, rest in episodes:
        assert task_id.startswith("calc-"), out
        assert float(reward) == (1.0 if success == "True" else 0.0), out
        info = fields(rest)
        assert int(info["completions"]) >= 1, out  # the SDK's calls went through the session
        assert info["end"] in ("terminated", "agent_error"), out
    assert report(out)["episodes"] == "2 (2 tasks x 1)", out


@pytest.mark.slow
def test_tau2_retail_runs_with_the_customer_played_by_the_same_proxy():
    out = run_example("tau2_retail.py", "--episodes=1", "--max-turns=1", "--max-tokens=32")
    [(task_id, reward, success, rest)] = EPISODE.findall(out)
    assert task_id.isdigit(), out
    assert float(reward) == (1.0 if success == "True" else 0.0), out
    info = fields(rest)
    assert info["end"] in ("terminated", "truncated"), out
    # only the agent's turns are recorded: the customer's calls used the admin key
    assert int(info["completions"]) == int(info["turns"]) == 1, out
    assert re.search(r"^  assistant: Hi! How can I help you today\?$", out, re.M), out
    assert re.search(r"^  user: \S", out, re.M), out  # the simulated customer spoke
    assert report(out)["episodes"] == "1 (1 tasks x 1)", out


@pytest.mark.slow
def test_custom_env_registers_checks_evaluates_and_plays():
    out = run_example("custom_env.py", "--episodes=2")
    rows = report(out)
    assert rows["episodes"] == "2 (2 tasks x 1)", out
    assert re.fullmatch(r"\d+\.\d%", rows["success rate"]), out
    assert out.splitlines()[-1].startswith("(1.0, True, False"), out
