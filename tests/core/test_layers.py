"""The walls between the rooms (docs/architecture.md), checked as CI checks them.

- The import contracts in ``pyproject.toml`` (``[tool.importlinter]``) hold, and each kind of
  violation planted in a copy of the package is refused: a room importing a higher one, a
  cycle between sibling modules, torch in a torch-free room, a heavy import in the worker
  client.
- No product module passes 800 lines.
- A function-level import in product code says why it is not at the top.
- Every module has one import name: nothing loads as bare ``envs`` / ``tools`` / ``trainer``,
  and ruff refuses those names.
- The wheel installs one top-level package, ``areal_agents``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PRODUCT_DIRS = ("areal_agents", "envs", "tools", "trainer")
MAX_MODULE_LINES = 800


def product_files() -> list[Path]:
    """Every product ``.py`` file once, by its real path (the links inside ``areal_agents/``
    to ``envs/``, ``tools/`` and ``trainer/`` are not followed)."""
    files = []
    for top in PRODUCT_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            if top == "areal_agents" and rel.parts[1] in ("envs", "tools", "trainer"):
                continue
            files.append(path)
    return files


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts over the package found under ``root``."""
    return subprocess.run(
        [str(BIN / "lint-imports"), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout or "broken" not in done.stdout


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as it installs (links followed), in a directory of its own."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(
        REPO / "areal_agents",
        root / "areal_agents",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


# contract id -> (new module, its text, an existing module that will import it, or None)
PLANTS: dict[str, list[tuple[str, str, str | None]]] = {
    # a room importing a higher one: the engines must not know the rollout
    "layers": [("engines/_planted.py", "import areal_agents.rollout.runner\n", None)],
    # two sibling modules importing each other (inside a function: still a cycle)
    "acyclic": [
        ("serve/_planted_a.py", "def f():\n    import areal_agents.serve._planted_b\n", None),
        ("serve/_planted_b.py", "import areal_agents.serve._planted_a\n", None),
    ],
    "torch-free": [("tools/_planted.py", "import torch\n", None)],
    "light-client": [("_planted_client_dep.py", "import fastapi\n", "client.py")],
    "light-worker": [("cli/_planted_worker_dep.py", "import jinja2\n", "cli/worker.py")],
}


def _module_name(rel: str) -> str:
    return "areal_agents." + rel.removesuffix(".py").replace("/", ".")


def test_every_contract_has_a_plant() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert {c["id"] for c in contracts["contracts"]} == set(PLANTS)


@pytest.mark.parametrize("contract", sorted(PLANTS))
def test_a_planted_violation_is_refused(package_copy: Path, contract: str) -> None:
    package = package_copy / "areal_agents"
    planted, touched = [], {}
    try:
        for rel, text, importer in PLANTS[contract]:
            planted.append(package / rel)
            (package / rel).write_text(text)
            if importer is not None:
                touched[package / importer] = (package / importer).read_text()
                line = f"\nimport {_module_name(rel)}\n"
                (package / importer).write_text(touched[package / importer] + line)
        done = lint_imports(package_copy)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        for path, text in touched.items():
            path.write_text(text)
    assert done.returncode != 0, done.stdout
    # the planted contract breaks, and the report names the planted import; an upward import
    # between rooms is also a cycle between the rooms, and the worker command imports the
    # worker client, so those plants break a second contract
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    names = {c["id"]: c["name"] for c in contracts["contracts"]}
    broken = set(re.findall(r"^(.+) BROKEN$", done.stdout, flags=re.M))
    also = {
        names[c]
        for c in {"layers": ["acyclic"], "light-client": ["light-worker"]}.get(contract, [])
    }
    assert broken == {names[contract]} | also, done.stdout
    assert "_planted" in done.stdout.split("Broken contracts", 1)[1]


def test_no_product_module_passes_800_lines() -> None:
    sizes = sorted(
        ((len(p.read_text().splitlines()), p.relative_to(REPO)) for p in product_files()),
        reverse=True,
    )
    largest = ", ".join(f"{path} ({n})" for n, path in sizes[:5])
    assert sizes[0][0] <= MAX_MODULE_LINES, (
        f"split modules over {MAX_MODULE_LINES} lines by idea; the largest five: {largest}"
    )


def test_function_level_imports_say_why() -> None:
    """ruff's PLC0415 flags an import inside a function; product code may keep one only with
    ``# noqa: PLC0415  <reason>`` (torch or an optional extra kept off a light path)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"PLC0415"' in pyproject.split("[tool.ruff.lint]", 1)[1].split("\n\n", 1)[0]
    bare = []
    for path in product_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = re.search(r"#\s*noqa:\s*PLC0415\b(.*)$", line)
            if found and len(found.group(1).split()) < 3:
                bare.append(f"{path.relative_to(REPO)}:{number}")
    assert not bare, f"a lazy import without a reason (# noqa: PLC0415  <why>): {bare}"


def test_ruff_refuses_the_bare_folder_names(tmp_path: Path) -> None:
    for name in ("envs", "tools", "trainer"):
        source = tmp_path / f"uses_{name}.py"
        source.write_text(f"from {name}.x import y\n\nprint(y)\n")
        done = subprocess.run(
            [str(BIN / "ruff"), "check", "--no-cache", "--select", "TID251", str(source)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stdout
        assert f"areal_agents.{name}" in done.stdout


def test_every_module_loads_under_one_name() -> None:
    """Import every product module (those whose optional extra is missing excepted) in a
    fresh interpreter started in the repository root, where the bare folder names would
    resolve: none loads as ``envs`` / ``tools`` / ``trainer``, no file loads twice."""
    script = """
import collections, importlib, pkgutil, sys
import areal_agents
skipped = []
for info in pkgutil.walk_packages(areal_agents.__path__, "areal_agents."):
    if ".store_migrations" in info.name:
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        skipped.append(f"{info.name}: {exc}")
bare = sorted(m for m in sys.modules if m.split(".")[0] in ("envs", "tools", "trainer"))
import os
by_file = collections.defaultdict(set)
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None)
    dirs = ("areal_agents", "envs", "tools", "trainer")
    roots = tuple(os.path.join(os.getcwd(), d) + os.sep for d in dirs)
    if f and os.path.realpath(f).startswith(roots):
        by_file[os.path.realpath(f)].add(id(m))
twice = sorted(f for f, ids in by_file.items() if len(ids) > 1)
print("loaded", sum(1 for m in sys.modules if m.startswith("areal_agents")))
print("skipped", skipped)
assert not bare, bare
assert not twice, twice
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    loaded = int(re.search(r"loaded (\d+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert loaded > 100, done.stdout


@pytest.mark.slow
def test_the_wheel_installs_only_areal_agents(tmp_path: Path) -> None:
    """``pip wheel --no-deps .`` on the tracked files: one top-level package, the linked
    folders inside it, package data included."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    src = tmp_path / "src"
    for rel in filter(None, (t.decode() for t in tracked)):
        target = src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        origin = REPO / rel
        if origin.is_symlink():
            target.symlink_to(origin.readlink())
        elif origin.is_file():
            shutil.copy2(origin, target)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("areal_agents-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert top == {"areal_agents"}, top
    for expected in (
        "areal_agents/envs/registry.py",
        "areal_agents/tools/tool.py",
        "areal_agents/trainer/loop.py",
        "areal_agents/serve/store_migrations/env.py",
        "areal_agents/envs/tasks/example.jsonl",
    ):
        assert expected in names, expected
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "areal_agents.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_component_table_names_every_room() -> None:
    """docs/architecture.md's component table: every path in it exists, every room (a
    subpackage of ``areal_agents``) is named, and the only modules directly under
    ``areal_agents/`` are those it lists."""
    doc = REPO / "docs" / "architecture.md"
    table = doc.read_text().split("## Components", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\((\.\./[^)#\s]+)\)", table)
    assert links
    missing = [link for link in links if not (doc.parent / link).exists()]
    assert not missing, missing
    named = {str((doc.parent / link).resolve().relative_to(REPO)) for link in links}
    package = REPO / "areal_agents"
    rooms = {
        f"areal_agents/{p.name}"
        for p in package.iterdir()
        if p.is_dir() and not p.is_symlink() and (p / "__init__.py").exists()
    }
    folders = {
        p.name
        for p in package.iterdir()
        if p.is_symlink() and p.name in ("envs", "tools", "trainer")
    }
    assert folders == {"envs", "tools", "trainer"}
    unnamed_rooms = sorted(
        r for r in rooms if not any(n == r or n.startswith(r + "/") for n in named)
    )
    assert not unnamed_rooms, f"rooms the component table does not name: {unnamed_rooms}"
    modules = {f"areal_agents/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(modules - named)
    assert not unlisted, f"modules directly under areal_agents/ the table does not list: {unlisted}"
