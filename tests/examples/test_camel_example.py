"""examples/agents/camel_search.py in the CAMEL venv, against a running ``areal-agent serve``.

CAMEL and torch cannot share a venv, so the proxy runs apart (from the main venv) and this
test gets its URL from ``AREAL_EXAMPLE_BASE_URL``. Without the URL or CAMEL it skips, or
fails when ``AREAL_REQUIRE_INTEGRATIONS=1`` (CI sets it, so a skip cannot hide a break).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "camel_search.py"


def _require(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("AREAL_REQUIRE_INTEGRATIONS") == "1":
        pytest.fail(f"AREAL_REQUIRE_INTEGRATIONS=1 but {why}", pytrace=False)
    pytest.skip(why)


@pytest.mark.slow
def test_camel_search_example_scores_and_records_its_episode():
    base_url = os.environ.get("AREAL_EXAMPLE_BASE_URL")
    _require(
        bool(base_url),
        "AREAL_EXAMPLE_BASE_URL is unset: start `areal-agent serve --port P` and set it to "
        "http://127.0.0.1:P (see examples/agents/README.md)",
    )
    _require(
        importlib.util.find_spec("camel") is not None,
        "camel-ai is not installed: build its venv with requirements/make_venv.sh camel DIR",
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--base-url",
            str(base_url),
            "--episodes=1",
            "--max-iterations=2",
            "--max-tokens=48",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{out}\n{proc.stderr}"
    episode = re.search(r"^task=(q\d+) reward=([\d.]+) success=(True|False) ", out, re.M)
    assert episode is not None, out
    reward, success = float(episode[2]), episode[3] == "True"
    assert reward == (1.0 if success else 0.0), out
    recorded = re.search(r"^  recorded: (\{.*\})$", out, re.M)
    assert recorded is not None, out
    metrics = ast.literal_eval(recorded[1])
    assert metrics["completions"] >= 1 and metrics["output_tokens"] >= 1, out
    # every recorded completion is listed, and the last one carries the posted reward
    returns = [float(r) for r in re.findall(r"^  completion: .*, return (-?[\d.]+):", out, re.M)]
    assert len(returns) == metrics["completions"], out
    assert returns[-1] == reward, out
    assert re.search(r"^episodes=1 success=[01]/1$", out, re.M), out
