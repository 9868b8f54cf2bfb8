"""The token view's training-inference mismatch, on ``tool_run`` (tests/view/conftest.py)
through the app's HTML, without a browser: each trained token sampled by the weights trained
from (all of them: step s trains version s - 1, which sampled its group) shows trainer -
server logprob, ``prox_logprobs - output_logprobs``, and the completion a summary line. A
run with ``loss.proximal: loglinear`` has nothing to compare; one without a config shows the
difference and says what it is."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from areal_agents.serve.store import EpisodeStore
from areal_agents.view import create_app
from areal_agents.view.queries import mismatch_summary


def _trained(run: Path) -> tuple[str, str, dict, list[float]]:
    """The first trained completion of over 3 tokens: session, completion id, its latest
    ``train_tokens`` row, and its recorded output logprobs."""
    sessions = [s for line in (run / "groups.jsonl").read_text().splitlines()
                for s in json.loads(line)["sessions"]]  # fmt: skip
    store = EpisodeStore(run / "episodes.db")
    try:
        for sid in sessions:
            rows = {r["completion_id"]: r for r in store.train_tokens(sid)}
            session = store.load(sid)
            assert session is not None
            for c in session.episode.completions:
                if c.id in rows and len(c.output_ids) > 3:
                    assert set(c.output_versions) == {rows[c.id]["version"]}
                    return sid, c.id, rows[c.id], list(c.output_logprobs)
    finally:
        store.close()
    raise AssertionError("tool_run has no trained completion of over 3 tokens")


def _page(run: Path, sid: str, cid: str) -> str:
    with TestClient(create_app([run])) as client:
        got = client.get(f"/runs/{run.name}/episodes/{sid}/tokens/{cid}")
    assert got.status_code == 200, got.text[-2000:]
    return got.text


def test_the_token_view_shows_trainer_minus_server_of_fresh_tokens(tool_run: Path) -> None:
    sid, cid, row, logprobs = _trained(tool_run)
    want = [p - lp for p, lp in zip(row["prox_logprobs"], logprobs, strict=True)]
    page = _page(tool_run, sid, cid)

    shown = [float(x) for x in re.findall(r'data-mismatch="([^"]*)"', page)]
    assert shown == pytest.approx(want, abs=1e-6)
    # the whole tooltip is one attribute: the token's quoted text no longer ends it early
    titles = [html.unescape(t) for t in re.findall(r'class="tok out[^>]*title="([^"]*)"', page)]
    assert len(titles) == len(want)
    assert all("trainer − server logprob" in t and "(same weights)" in t for t in titles)

    summary = mismatch_summary(want)
    assert summary is not None and summary["abs_max"] == pytest.approx(0.9, abs=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in want) / len(want)
    assert summary["kl"] == pytest.approx(k3) and summary["tokens"] == len(want)
    line = re.search(r'id="mismatch-summary"[^>]*>([^<]*)<', page)
    assert line is not None, "no summary line"
    text = html.unescape(line.group(1))
    assert text.startswith(f"{len(want)} fresh tokens · mean k3 ")
    kl_shown = re.search(r"mean k3 (\S+)", text)
    max_shown = re.search(r"max \|d\| (\S+)", text)
    assert kl_shown is not None and float(kl_shown.group(1)) == pytest.approx(k3, abs=5e-5)
    # conftest puts token 2 at 0.9 over the server's, the rest within 0.25
    assert max_shown is not None and float(max_shown.group(1)) == pytest.approx(0.9)


def test_loglinear_or_no_config_changes_what_is_shown(tool_run: Path, tmp_path: Path) -> None:
    sid, cid, _row, _ = _trained(tool_run)
    run = tmp_path / tool_run.name
    shutil.copytree(tool_run, run)
    config = run / "config.yaml"
    text = config.read_text()

    config.write_text(text + "loss:\n  proximal: loglinear\n")
    page = _page(run, sid, cid)
    assert 'data-mismatch=""' in page and "trainer − server logprob " not in page
    assert "not recorded (loss.proximal: loglinear)" in page

    config.unlink()  # unknown: shown, and the tooltip says what it is
    page = _page(run, sid, cid)
    assert "the training-inference mismatch if the run recomputed it" in html.unescape(page)
    assert re.search(r'id="mismatch-summary"[^>]*>\d+ fresh tokens', page)
