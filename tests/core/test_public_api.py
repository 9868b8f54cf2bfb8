"""The public API surface and the one-way dependency rules: tools -> areal_agents, envs ->
tools and areal_agents, trainer -> areal_agents; areal_agents imports none of them at import
time, and envs, tools and the proxy import no torch."""

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
        "import areal_agents, areal_agents.serve.proxy, areal_agents.serve.server, envs, tools, areal_agents.envs.registry,"
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


def test_areal_agents_does_not_import_siblings_at_import_time():
    loaded = _modules_after("import areal_agents")
    assert not {"envs", "tools", "trainer"} & loaded


def test_static_dependency_direction():
    def imports(pkg: str) -> list[str]:
        found = []
        for path in (ROOT / pkg).rglob("*.py"):
            for line in path.read_text().splitlines():
                s = line.strip()
                if s.startswith(("import ", "from ")) and not line.startswith((" ", "\t")):
                    found.append(f"{path.relative_to(ROOT)}: {s}")
        return found

    for pkg in ("envs", "tools"):
        bad = [x for x in imports(pkg) if " torch" in x or " trainer" in x]
        assert not bad, bad
    bad = [
        x
        for x in imports("areal_agents")
        if any(
            f"{kw} {sib}" in x.split(": ", 1)[1]
            for kw in ("import", "from")
            for sib in ("envs", "tools", "trainer")
        )
    ]
    assert not bad, bad
