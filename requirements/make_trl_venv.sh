#!/usr/bin/env bash
# Build the TRL environment that benchmarks/trl_grpo.py runs its baseline in.
#   requirements/make_trl_venv.sh [DIR]        (default: .venv-trl at the repository root)
# torch 2.13.0 (the CPU build) goes first, so that nothing pulls another torch build; then
# requirements/trl.txt (TRL, peft, transformers and their dependencies, all pinned).
# areal-agents is not installed there: the benchmark talks to it through a JSON spec.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
dir="${1:-$repo/.venv-trl}"
py="${PYTHON:-python3}"
start=$(date +%s)
[ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r "$here/trl.txt"
"$dir/bin/python" -c "import torch, trl, peft; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('trl', trl.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
echo "built $dir from requirements/trl.txt in $(( $(date +%s) - start )) s"
