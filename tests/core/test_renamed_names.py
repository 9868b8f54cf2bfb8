"""Import strings that still use a pre-0.2.0 name (``tools.calculator:calculator``) fail with a
``ConfigError`` naming the new one; a user's own package called ``tools`` stays theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

from areal_agents.envs import register
from areal_agents.envs.tasks.scoring import resolve_score
from areal_agents.errors import ConfigError, check_import_name, renamed_import
from areal_agents.rollout.task_agent import load_agent

REPO = Path(__file__).resolve().parents[2]


def test_old_names_map_to_their_areal_agents_names() -> None:
    assert renamed_import("tools.calculator") == "areal_agents.tools.calculator"
    assert renamed_import("envs.math.env") == "areal_agents.envs.math.env"
    assert renamed_import("trainer.loop") == "areal_agents.trainer.loop"
    assert renamed_import("tools.no_such_module") is None
    assert renamed_import("json") is None
    assert renamed_import("areal_agents.tools.calculator") is None
    check_import_name("areal_agents.tools.calculator:calculator", "agent factory")  # no error


def test_from_a_source_checkout_the_old_name_is_still_refused() -> None:
    """In the repository's root the bare folder would import (a second copy of the module,
    a second env registry): the check refuses it there too."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from areal_agents.errors import renamed_import; "
            "print(renamed_import('tools.calculator'))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "areal_agents.tools.calculator"


def test_a_users_own_tools_package_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "tools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "calculator.py").write_text("def make():\n    return 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert renamed_import("tools.calculator") is None
    check_import_name("tools.calculator:make", "agent factory")  # theirs: no error


def test_an_agent_factory_with_an_old_name_names_the_new_one() -> None:
    with pytest.raises(ConfigError) as err:
        load_agent("tools.calculator:calculator")
    assert "'areal_agents.tools.calculator:calculator'" in str(err.value)
    assert "before 0.2.0" in str(err.value)


def test_a_score_function_with_an_old_name_names_the_new_one() -> None:
    with pytest.raises(ConfigError, match=r"'areal_agents\.envs\.tasks\.scoring:exact_match'"):
        resolve_score("envs.tasks.scoring:exact_match")


def test_an_env_entry_point_with_an_old_name_is_refused_before_registering() -> None:
    with pytest.raises(ConfigError, match=r"'areal_agents\.envs\.math\.env:MathEnv'"):
        register("test/OldName-v0", "envs.math.env:MathEnv")
    assert "test/OldName-v0" not in gymnasium.registry
