#!/usr/bin/env bash
# The engine tests against a real SGLang and a real vLLM on a GPU machine (installs nothing).
#
#   benchmarks/gpu_check.sh MODEL_DIR [vllm|sglang|both]
#
# MODEL_DIR: a small HF model directory both servers load (e.g. Qwen2.5-0.5B-Instruct; it
# must fit twice on one GPU in float32). Starts SGLang and vLLM on loopback, each with the
# flags areal-agents needs, runs `pytest -m "vllm or sglang" tests/engines` against them
# (AREAL_SGLANG_URL / AREAL_VLLM_URL; skipping is an error), stops both, and prints their
# logs' tails on failure. Budget: under 8 minutes.
#
# Environment (all optional):
#   SGLANG_PYTHON, VLLM_PYTHON   interpreters with sglang / vllm installed (default: python3)
#   TEST_PYTHON                  interpreter with areal-agents and its test extras
#                                (default: .venv/bin/python)
#   SGLANG_ARGS, VLLM_ARGS       extra server flags (e.g. SGLANG_ARGS="--attention-backend triton")
#   SGLANG_MODULE                the module run as the SGLang server (default sglang.launch_server;
#                                areal_agents.fake_sglang rehearses this script on a CPU)
#   GPU_CHECK_OUT                where logs go (default: a temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: $0 MODEL_DIR [vllm|sglang|both]}"
which="${2:-both}"
[ -f "$model/config.json" ] || { echo "no config.json in $model" >&2; exit 2; }
sglang_py="${SGLANG_PYTHON:-python3}"
vllm_py="${VLLM_PYTHON:-python3}"
test_py="${TEST_PYTHON:-.venv/bin/python}"
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$out"
start=$(date +%s)
pids=()

cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 5
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() { "$test_py" -c "from areal_agents.server import free_port; print(free_port())"; }

env_vars=(AREAL_ENGINE_MODEL="$model")
markers=()
if [ "$which" != vllm ]; then
  sglang_port=$(free_port)
  # --enable-deterministic-inference: sampling_seed reproduces a sample only with it.
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

marker=$(IFS='|'; echo "${markers[*]}" | sed 's/|/ or /g')
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
