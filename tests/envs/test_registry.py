"""areal_agents.envs.registry: built-in ids, make, suggestions for unknown ids, plugin discovery."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import gymnasium
import pytest

from areal_agents import envs
from areal_agents.envs.math import CalculatorEnv
from areal_agents.errors import EnvNotFound, UserError

BUILTIN_IDS = [
    "areal/Calculator-v0",
    "areal/Math-v0",
    "areal/Search-v0",
    "areal/Tau2Airline-v0",
    "areal/Tau2Retail-v0",
]


def test_importing_envs_registers_builtins_in_gymnasium_without_importing_them():
    code = textwrap.dedent(
        """
        import sys, gymnasium
        from areal_agents import envs
        ids = [i for i, _ in envs.list_envs()]
        print(all(i in gymnasium.registry for i in ids), len(ids))
        prefixes = ("areal_agents.envs.math", "areal_agents.envs.search", "areal_agents.envs.tau2")
        print(sorted(m for m in sys.modules if m.startswith(prefixes)))
        print(gymnasium.spec("areal/Tau2Airline-v0").kwargs)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("True")
    assert lines[1] == "[]"
    assert lines[2] == "{'domain': 'airline'}"


def test_list_envs_gives_every_builtin_id_with_a_description():
    listed = dict(envs.list_envs())
    assert set(BUILTIN_IDS) <= set(listed)
    assert all(listed[i] for i in BUILTIN_IDS)


def test_make_returns_the_env_itself_with_kwargs_applied():
    env = envs.make("areal/Calculator-v0", kind="arithmetic", max_turns=3)
    assert type(env) is CalculatorEnv
    assert env.max_turns == 3
    assert env.reset(seed=0)[1]["kind"] == "arithmetic"
    assert env.spec is not None and env.spec.id == "areal/Calculator-v0"


@pytest.mark.parametrize(
    ("wrong", "suggestion"),
    [
        ("areal/Calcultor-v0", "areal/Calculator-v0"),
        ("areal/math-v0", "areal/Math-v0"),
        ("Math-v0", "areal/Math-v0"),
        ("areal/Math-v1", "areal/Math-v0"),
    ],
)
def test_unknown_id_raises_env_not_found_suggesting_the_nearest(wrong, suggestion):
    with pytest.raises(EnvNotFound, match=f"Did you mean '{suggestion}'") as caught:
        envs.make(wrong)
    assert isinstance(caught.value, UserError)
    assert "envs.list_envs()" in str(caught.value)


def test_register_rejects_a_conflicting_id_unless_overridden():
    envs.register("test/Tmp-v0", CalculatorEnv, description="first")
    envs.register("test/Tmp-v0", CalculatorEnv, description="first")  # same again: fine
    with pytest.raises(ValueError, match="already registered"):
        envs.register("test/Tmp-v0", "areal_agents.envs.math.env:MathEnv")
    envs.register(
        "test/Tmp-v0", "areal_agents.envs.math.env:MathEnv", description="second", override=True
    )
    assert ("test/Tmp-v0", "second") in envs.list_envs()


def _fake_distribution(root, name, entry_points):
    dist = root / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "\n".join(f"{key} = {value}" for key, value in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[areal_agents.envs]\n{lines}\n")


def test_plugins_are_discovered_from_an_installed_distribution(tmp_path, monkeypatch):
    (tmp_path / "fake_plugin_envs.py").write_text(
        textwrap.dedent(
            '''
            from areal_agents import envs
            from areal_agents.envs.math import CalculatorEnv

            class TinyEnv(CalculatorEnv):
                """A tiny arithmetic env from a plugin."""

            def register_all():
                envs.register("fakeorg/Listed-v0", TinyEnv, description="registered by a function")

            NOT_AN_ENV = 3
            '''
        )
    )
    _fake_distribution(
        tmp_path,
        "fake_plugin_envs",
        {
            "fakeorg/Tiny-v0": "fake_plugin_envs:TinyEnv",
            "fakeorg": "fake_plugin_envs:register_all",
            "broken": "fake_plugin_envs:NOT_AN_ENV",
            "missing": "no_such_module_xyz:Env",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="skipping env plugin") as warned:
        added = envs.load_plugins(force=True)
    assert {"fakeorg/Tiny-v0", "fakeorg/Listed-v0"} <= set(added)
    assert {str(w.message).split("'")[1] for w in warned} == {"broken", "missing"}
    listed = dict(envs.list_envs())
    assert listed["fakeorg/Tiny-v0"] == "A tiny arithmetic env from a plugin."
    assert listed["fakeorg/Listed-v0"] == "registered by a function"
    env = envs.make("fakeorg/Tiny-v0", kind="word")
    assert env.reset(seed=1)[1]["kind"] == "word"
    for id in ("fakeorg/Tiny-v0", "fakeorg/Listed-v0"):
        gymnasium.registry.pop(id)
