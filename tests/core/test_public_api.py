"""The public API surface: its names resolve and load lazily, ``import areal_agents`` loads
none of the rooms, the proxy, envs and tools load no torch, and the worker client nothing
heavy. The walls between the rooms are import contracts (tests/core/test_layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import areal_agents

ROOT = Path(__file__).resolve().parents[2]


def test_all_names_are_unique_and_resolve():
    assert len(set(areal_agents.__all__)) == len(areal_agents.__all__)
    for name in areal_agents.__all__:
        assert getattr(areal_agents, name) is not None, name


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return set(out.stdout.split())


def test_proxy_envs_and_tools_never_import_torch():
    loaded = _modules_after(
        "import areal_agents, areal_agents.serve.proxy, areal_agents.serve.server,"
        " areal_agents.envs, areal_agents.tools, areal_agents.envs.registry,"
        " areal_agents.engines.vllm, areal_agents.engines.sglang, areal_agents.engines.router,"
        " areal_agents.cli.backend, areal_agents.testing.fake_sglang, areal_agents.cli.main"
    )
    assert "torch" not in loaded
    assert "transformers" not in loaded


def test_public_names_load_lazily_and_dir_lists_them():
    loaded = _modules_after("import areal_agents; print(sorted(dir(areal_agents)))")
    assert not {"areal_agents.serve.proxy", "fastapi", "tokenizers", "pydantic"} & loaded
    assert set(areal_agents.__all__) <= set(dir(areal_agents))
    assert areal_agents.Proxy is __import__("areal_agents.serve.proxy").serve.proxy.Proxy


def test_the_worker_client_imports_no_heavy_module():
    """A worker's environment has httpx and openai only (requirements/client.txt)."""
    loaded = _modules_after("import areal_agents.client")
    heavy = {"fastapi", "uvicorn", "starlette", "tokenizers", "transformers", "torch", "jinja2"}
    ours = {"areal_agents.serve.proxy", "areal_agents.serve.schemas", "areal_agents.serve.chat"}
    assert not (heavy | ours | {"pydantic", "openai", "gymnasium", "numpy"}) & loaded
    assert "httpx" in loaded


def test_areal_agents_does_not_import_its_rooms_at_import_time():
    loaded = _modules_after("import areal_agents")
    rooms = ("envs", "tools", "trainer", "engines", "serve", "rollout", "cli", "view")
    assert not {f"areal_agents.{room}" for room in rooms} & loaded
    assert "areal_agents" in loaded
