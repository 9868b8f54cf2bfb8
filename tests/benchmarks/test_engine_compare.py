"""benchmarks/engine_compare.py: its prompts, arguments, table, and a smoke run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from areal_agents import envs
from areal_agents.serve.chat import ChatTokenizer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_engine_compare", BENCH / "engine_compare.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_prompts_are_the_calculator_task_and_every_engine_gets_the_same_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    bench = _script()
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    work = bench.Workload.build(tok, [2, 3], repeats=2)

    # every batch has prompts of its own, the warm-up too
    seen = [tuple(p) for batches in work.timed.values() for b in batches for p in b]
    assert [len(b) for b in work.timed[2]] == [2, 2] and [len(b) for b in work.timed[3]] == [3, 3]
    assert len(work.warmup) == 3
    assert len(set(seen)) == len(seen) == 10
    assert not set(seen) & {tuple(p) for p in work.warmup}

    # the first timed prompt: the calculator env configured as the recipe does, seed 0, its
    # messages and tools through the chat template (as transformers renders them too)
    env_id, kwargs = bench.calculator_env()
    assert env_id == "areal/Calculator-v0" and kwargs["kind"] == "mixed"
    env = envs.make(env_id, **kwargs)
    messages, info = env.reset(seed=0)
    env.close()
    want = tok.encode_chat(messages, tools=info["tools"])
    assert work.timed[2][0][0] == want
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = hf.apply_chat_template(
        messages, tools=info["tools"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(rendered) == want
    assert "calculator" in tok.decode(want)

    # HF's padded batch (unpadded by its mask) and vLLM's request carry the same ids
    batch = work.timed[3][1]
    ids, mask = bench.left_pad(batch, pad_id=-1)
    assert len({len(row) for row in ids}) == 1
    assert [
        [t for t, m in zip(r, k, strict=True) if m] for r, k in zip(ids, mask, strict=True)
    ] == batch
    assert all(
        row[: len(row) - len(p)] == [-1] * (len(row) - len(p))
        for row, p in zip(ids, batch, strict=True)
    )
    for p in batch:
        body = bench.completion_body(p, "bench", 96)
        assert body["prompt"] == p and body["max_tokens"] == 96 and body["ignore_eos"] is True
        assert body["temperature"] == 1.0


def test_arguments_layouts_and_table():
    bench = _script()
    args = bench.parse_args(["--quick", "--engines", "hf,embedded"])
    assert (args.concurrency, args.new_tokens, args.repeats) == ([2], 8, 1)
    assert args.engines == ["hf", "embedded"] and args.layout == ["shared", "split"]
    args = bench.parse_args([])
    assert args.concurrency == [16, 32] and args.new_tokens == 96
    assert args.engines == ["hf", "embedded", "vllm"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--engines", "hf,tgi"])

    said: list[str] = []
    (split,) = bench.layouts(["split"], [3, 5, 7], said.append)
    assert (split.engine_cores, split.rest_cores, split.pinned) == ([3], [5], True)
    assert bench.layouts(["shared", "split"], [4], said.append)[0].engine_cores == [4]
    assert said == ["layout split skipped: this process may use only core 4"]

    R = bench.Result
    text = bench.table(
        [R("embedded", 16, [100.0]), R("hf", 16, [50.0]), R("vllm", 16, [250.0, 200.0, 300.0])]
    )
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1] == "| HF padded-batch `generate` | 16 | 50.0 | 1.00x | 0.50x |"
    assert rows[2] == "| embedded engine | 16 | 100.0 | 2.00x | 1.00x |"
    assert rows[3] == "| vLLM CPU build (server) | 16 | 250.0 | 5.00x | 2.50x |"
    assert "| 32 | 10.0 | - | - |" in bench.table([R("vllm", 32, [10.0])])


@pytest.mark.slow
def test_quick_run_without_vllm_prints_a_table_per_layout(tiny_model_dir):
    # a process of its own: the split layout pins the process's threads
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "engine_compare.py"),
            "--quick",
            "--engines",
            "hf,embedded",
            "--model",
            str(tiny_model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "python benchmarks/engine_compare.py --quick --engines hf,embedded --model" in text
    assert "load " in text and "native bfloat16: " in text
    layouts = ["shared"] + (["split"] if len(os.sched_getaffinity(0)) > 1 else [])
    tables = text.split("\n\n")
    for layout in layouts:
        (at,) = [i for i, part in enumerate(tables) if part.startswith(f"{layout} (")]
        rows = [line.split(" | ") for line in tables[at + 1].splitlines()[2:]]
        assert [r[0] for r in rows] == ["| HF padded-batch `generate`", "| embedded engine"]
        assert all(r[1] == "2" and float(r[2]) > 0 for r in rows)
        assert rows[0][3] == "1.00x" and rows[1][4].rstrip(" |") == "1.00x"
        assert rows[1][3].endswith("x") and float(rows[1][3][:-1]) > 0
