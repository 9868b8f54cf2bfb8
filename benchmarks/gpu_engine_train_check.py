"""A short ``areal-agent train`` run generating with a launched vLLM or SGLang server, and the
checks of what it left behind. Run by ``benchmarks/gpu_check.sh train-vllm|train-sglang``.

    python benchmarks/gpu_engine_train_check.py --backend vllm --model MODEL_DIR \\
        --server-python VLLM_PYTHON [--steps 3] [--full] [--device cuda --gpus 1]

GRPO on areal/Calculator-v0 (LoRA r=16, or full weights with ``--full``), float32 on both
sides, 3 steps, one server on one GPU (``--gpus 0 --device cpu`` rehearses it on vLLM's CPU
build). It prints one line per check and a last line it must end with::

    engine: vllm (every metrics row)                        ok
    steps: 3 of 3                                           ok
    grad_norm > 0 on some step: 0.41                        ok
    mismatch/kl on 2 step(s), max 3.1e-13 < 1e-04           ok
    versions: every token's version <= its step's           ok
    weight loads: 4 (initial + one per step)                ok     (vLLM with LoRA: the log)
    gpu_engine_train_check: PASS (vllm, 3 steps in 95 s)

and exits 1 with ``FAIL`` on the last line when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

BOUND = 1e-4
"""mean k3 of the server's logprobs against the trainer's, float32 on both sides."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--model", required=True, help="HF model directory the server loads")
    ap.add_argument("--server-python", default=None, help="the server environment's Python")
    ap.add_argument("--server-module", default=None, help="the server's module (fake SGLang)")
    ap.add_argument("--server-args", default="", help="more server flags")
    ap.add_argument("--out", default="runs/gpu-engine-train-check")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="full weights instead of LoRA")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()

    out = Path(args.out)
    if out.exists():
        sys.exit(f"{out} exists; remove it or pass --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    launch: dict[str, object] = {"gpus": args.gpus, "args": args.server_args}
    if args.server_python:
        launch["python"] = args.server_python
    if args.server_module:
        launch["module"] = args.server_module
    cfg = {
        "env": {"id": "areal/Calculator-v0", "kwargs": {"kind": "arithmetic", "few_shot": 0}},
        "model": {
            "path": args.model,
            "dtype": "float32",
            "device": args.device,
            "lora": {"enabled": not args.full, "r": 16, "alpha": 32},
        },
        "engine": {"backend": args.backend, "launch": launch},
        "sampling": {"temperature": 1.0, "max_new_tokens": 64},
        "rollout": {
            "group_size": 4,
            "batch_size": 4,
            "max_head_offpolicyness": 1,
            "concurrency": 16,
            "max_turns": 2,
        },
        "optim": {"lr": 1e-5 if args.full else 1e-4},
        "train": {"steps": args.steps, "save_every": 0, "output_dir": str(out)},
        "metrics": {"tensorboard": False},
    }
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "train", "--config", str(config)]
    done = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        print(f"gpu_engine_train_check: FAIL ({args.backend}: train exited {done.returncode})")
        return 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kl = [r["mismatch/kl"] for r in rows if "mismatch/kl" in r]
    bad_versions = _bad_versions(out, eta=1)
    checks = [
        (
            f"engine: {args.backend} (every metrics row)",
            {r.get("engine") for r in rows} == {args.backend},
        ),
        (f"steps: {len(rows)} of {args.steps}", len(rows) == args.steps),
        (
            f"grad_norm > 0 on some step: {max((r['grad_norm'] for r in rows), default=0):.3g}",
            any(r["grad_norm"] > 0 for r in rows),
        ),
        (
            f"mismatch/kl on {len(kl)} step(s), max {max(kl, default=math.nan):.2g} < {BOUND:.0e}",
            bool(kl) and max(kl) < BOUND,
        ),
        (f"versions: {bad_versions} token(s) outside [step - 2, step - 1]", not bad_versions),
    ]
    log = out / "engine" / f"{args.backend}-0.log"
    if args.backend == "vllm" and not args.full and log.exists():
        loads = re.findall(r"Loaded new LoRA adapter", log.read_text())
        checks.append(
            (f"weight loads: {len(loads)} (initial + one per step)", len(loads) == args.steps + 1)
        )
    for text, ok in checks:
        print(f"{text:<56}{'ok' if ok else 'FAILED'}")
    passed = all(ok for _, ok in checks)
    verdict = "PASS" if passed else "FAIL"
    print(
        f"gpu_engine_train_check: {verdict} ({args.backend}, {len(rows)} steps in {seconds:.0f} s)"
    )
    return 0 if passed else 1


def _bad_versions(out: Path, eta: int) -> int:
    """Tokens trained at step k whose server-reported version is not in [k - 1 - eta, k - 1]
    (the staleness bound), or that carry no version."""
    from areal_agents.serve.store import EpisodeStore

    groups = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    store = EpisodeStore(out / "episodes.db")
    bad = 0
    try:
        for g in groups:
            top = g["step"] - 1
            for sid in g["sessions"]:
                session = store.load(sid)
                for c in session.episode.completions if session else []:
                    bad += sum(
                        1 for v in c.output_versions if v is None or not top - eta <= v <= top
                    )
    finally:
        store.close()
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
