"""``--ray`` on the command line: the same eval report as without it, serve through an engine
actor, a clear error without Ray installed, and no Ray import on the local code paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_agents.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--env", "areal/Calculator-v0", "--ray"],
        ["serve", "--ray-address", "auto"],
    ],
)
def test_ray_flags_without_ray_name_the_install_command(argv):
    done = _run(
        "import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
        "from areal_agents.cli.main import main\n"
        f"raise SystemExit(main({argv!r}))"
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'areal-agents[ray]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_local_code_paths_never_import_ray():
    done = _run(
        "import areal_agents, areal_agents.cli.main, areal_agents.rollout.runner\n"
        "import areal_agents.rollout.evaluate, areal_agents.serve.proxy\n"
        "import areal_agents.serve.server\n"
        "import areal_agents.trainer.config, areal_agents.trainer.loop\n"
        "import sys; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _eval_argv(model: Path, out: Path) -> list[str]:
    return [
        "eval",
        "--env",
        "areal/Calculator-v0",
        "--env-kwargs",
        '{"split": "test", "kind": "arithmetic", "max_attempts": 2}',
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--episodes",
        "4",
        "--k",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--max-turns",
        "3",
        "--concurrency",
        "1",  # one request at a time: greedy tokens cannot depend on batching
        "--out",
        str(out),
    ]


def _episodes(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    return sorted(
        (
            {
                "task_id": r["task_id"],
                "group_id": r["group_id"],
                "end_reason": r["end_reason"],
                "tokens": [
                    (c["prompt_ids"], c["output_ids"], c["output_versions"])
                    for c in r["completions"]
                ],
                "result": {k: r["result"][k] for k in ("reward", "success", "turns", "end_reason")},
            }
            for r in rows
        ),
        key=json.dumps,
    )


@pytest.mark.slow
def test_eval_with_ray_gives_the_same_report_as_without(cluster, tiny_model_dir, tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the engine actor (1 CPU): same float32 sums, same argmax
    try:
        assert main(_eval_argv(tiny_model_dir, tmp_path / "local")) == 0
    finally:
        torch.set_num_threads(threads)
    argv = [*_eval_argv(tiny_model_dir, tmp_path / "ray"), "--ray", "--ray-workers", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "ray: workers 1, workers_alive 1, engine_replicas 1" in printed
    local, on_ray = (
        json.loads((tmp_path / d / "report.json").read_text()) for d in ("local", "ray")
    )
    assert local.pop("duration_s") >= 0 and on_ray.pop("duration_s") >= 0
    assert on_ray == local
    assert local["episodes"] == 4 and sum(local["end_reasons"].values()) == 4
    episodes = _episodes(tmp_path / "ray")
    assert episodes == _episodes(tmp_path / "local")
    assert all(e["tokens"] and all(out for _, out, _ in e["tokens"]) for e in episodes)


def test_serve_smoke_through_a_ray_engine(cluster, tiny_model_dir, capsys):
    argv = ["serve", "--smoke", "--ray", "--model", str(tiny_model_dir), "--dtype", "float32"]
    assert main(argv) == 0  # 0: the recorded output ids decode to the reply the client got
    out = capsys.readouterr().out
    report = json.loads(out[out.rindex("\n{") + 1 :])
    assert report["output_versions"] and set(report["output_versions"]) == {0}
    assert report["decodes_to_reply"] is True
