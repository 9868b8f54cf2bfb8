"""``env.id`` as ``"module:ClassName"``: your own env from a file on ``PYTHONPATH``, without
registering it (areal_agents.envs.registry.resolve_id), next to gymnasium's
``"module:Name-v0"`` form."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium
import pytest

from areal_agents import envs
from areal_agents.envs.registry import probe, resolve_id
from areal_agents.errors import ConfigError, EnvNotFound

MODULE = textwrap.dedent(
    '''
    """A user's env module, written by the test."""

    import gymnasium

    from areal_agents import envs


    class SayWord(envs.AgentEnv):
        """Say the word the user asks for."""

        def __init__(self, *, word: str = "yes", max_turns: int = 2) -> None:
            super().__init__(max_turns=max_turns)
            self.word = word

        def _start(self, options):
            return [{"role": "user", "content": f"Say {self.word}."}], {"task_id": self.word}

        def tools(self):
            return []

        def _respond(self, message):
            success = self.word in (message.get("content") or "")
            return [], float(success), True, {"success": success}

        def score(self, messages):
            said = [m for m in messages if m["role"] == "assistant"]
            success = bool(said) and self.word in (said[-1].get("content") or "")
            return float(success), {"success": success}


    class NoSpaces(gymnasium.Env):
        """A gymnasium env without its spaces: gymnasium's checker refuses it."""

        def reset(self, *, seed=None, options=None):
            return [], {}


    class NotAnEnv:
        pass


    GREETING = "hello"

    envs.register(__name__ + "/Registered-v0", SayWord, kwargs={"word": "registered"})
    '''
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``user_env_<n>`` in ``tmp_path``, on ``sys.path``; returns its name (unique
    per test: a module imported once stays in ``sys.modules``)."""
    name = f"user_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_class_is_imported_registered_under_the_string_and_takes_kwargs(user_module):
    env_id = f"{user_module}:SayWord"
    env = envs.make(env_id, word="hello")
    assert type(env).__name__ == "SayWord" and env.word == "hello"
    assert env.spec.id == env_id  # what episodes and stores record
    messages, info = env.reset(seed=0)
    assert messages[-1]["content"] == "Say hello." and info["task_id"] == "hello"
    assert env.step("hello")[1:3] == (1.0, True)
    assert resolve_id(env_id) == env_id and env_id in gymnasium.registry
    assert env_id not in dict(envs.list_envs())  # made by name, not a registered env
    envs.check_env(envs.make(env_id))  # the project's conformance test passes
    probe(lambda: envs.make(env_id), seed=0, what="env.kwargs")  # gymnasium's checker too


def test_gymnasiums_module_colon_id_form_imports_then_looks_up(user_module):
    env = envs.make(f"{user_module}:{user_module}/Registered-v0")
    assert env.spec.id == f"{user_module}/Registered-v0" and env.word == "registered"
    assert resolve_id("gymnasium.envs.classic_control:CartPole-v1") == "CartPole-v1"


@pytest.mark.parametrize(
    ("suffix", "error", "message"),
    [
        ("no_such_module_xyz:Env", EnvNotFound, "no module named 'no_such_module_xyz'.*PYTHONPATH"),
        ("{m}:SayWrod", EnvNotFound, r"has no class 'SayWrod'.*Did you mean '{m}:SayWord'"),
        ("{m}:Missing-v0", EnvNotFound, "registered no env 'Missing-v0'"),
        ("{m}:NotAnEnv", ConfigError, "a class, not a gymnasium.Env subclass"),
        ("{m}:GREETING", ConfigError, "an object of type str, not a gymnasium.Env subclass"),
        ("{m}.sub:SayWord", EnvNotFound, r"no module named '{m}.sub'; check the dotted"),
        ("path/to/{m}.py:SayWord", EnvNotFound, "is not a module name"),
        ("{m}:", EnvNotFound, "expected 'pkg.module:ClassName'"),
    ],
)
def test_bad_module_ids_say_what_is_wrong(user_module, suffix, error, message):
    with pytest.raises(error, match=message.format(m=user_module)):
        envs.make(suffix.format(m=user_module))


def test_a_module_that_fails_to_import_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "broken_user_env.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing module 'broken_user_env' failed"):
        envs.make("broken_user_env:Env")


def test_an_env_that_fails_gymnasiums_checker_fails_before_the_first_episode(user_module):
    env_id = f"{user_module}:NoSpaces"
    with pytest.raises(ConfigError, match=f"^env.kwargs: {env_id} fails gymnasium's env checker"):
        probe(lambda: envs.make(env_id), seed=0, what="env.kwargs")


@pytest.mark.slow
def test_areal_agent_train_trains_an_env_from_a_file_on_pythonpath(tmp_path, tiny_model_dir):
    """The issue's check: ``areal-agent train ... env.id=mymod:MyEnv`` with ``mymod.py`` in
    a directory on ``PYTHONPATH`` only (not installed, not registered)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "mymod.py").write_text(MODULE.replace("SayWord", "MyEnv"))
    out = tmp_path / "run"
    overrides = {
        "env.id": "mymod:MyEnv",
        "env.kwargs": "{word: hi}",
        "model.path": tiny_model_dir,
        "model.dtype": "float32",
        "rollout.group_size": 2,
        "rollout.batch_size": 1,
        "sampling.max_new_tokens": 4,
        "train.steps": 1,
        "metrics.tensorboard": "false",
        "train.output_dir": out,
    }
    path = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", "train", "--quiet"]
        + [f"{k}={v}" for k, v in overrides.items()],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,  # not the repository: the module is found on PYTHONPATH only
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "run.json").read_text())
    assert (state["status"], state["step"]) == ("finished", 1), state
    with contextlib.closing(sqlite3.connect(out / "episodes.db")) as db:
        rows = db.execute("SELECT task_id, metadata FROM sessions").fetchall()
    assert rows and all(task == "hi" for task, _ in rows)  # env.kwargs reached the class
    assert {json.loads(meta)["env"] for _, meta in rows} == {"mymod:MyEnv"}  # the id recorded


def test_eval_takes_the_same_ids_and_a_bad_one_fails_before_the_model_loads(tmp_path):
    (tmp_path / "evalmod.py").write_text(MODULE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", "eval", "--env", "evalmod:SayWrd"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Did you mean 'evalmod:SayWord'?" in proc.stderr, proc.stderr[-3000:]
    assert "loading" not in proc.stderr  # no model was loaded


def test_the_example_of_docs_envs_md_passes_both_checkers(tmp_path, monkeypatch):
    doc = Path(__file__).resolve().parents[2] / "docs" / "envs.md"
    blocks = [b.split("```")[0] for b in doc.read_text().split("```python\n")[1:]]
    example = next(b for b in blocks if "class MyEnv" in b)  # "Write your env": An example
    assert len(example.splitlines()) <= 45
    (tmp_path / "docs_store_env.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = envs.make("docs_store_env:MyEnv", max_turns=3)
    envs.check_env(env, seed=0)
    probe(lambda: envs.make("docs_store_env:MyEnv"), seed=0, what="env.kwargs")
    _, info = env.reset(seed=0, options={"task_index": 1})
    assert info["task_id"] == "pears" and info["tools"][0]["function"]["name"] == "count"
    call = {"id": "c1", "function": {"name": "count", "arguments": '{"item": "pears"}'}}
    number = env.step({"role": "assistant", "content": None, "tool_calls": [call]})[0][0]
    assert env.step(f"There are {number['content']}.")[1:3] == (1.0, True)
