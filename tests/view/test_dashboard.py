"""The run side of ``areal-agent view`` through its app (FastAPI's TestClient): held-out
stages on the dashboard and the compare page, steps that held-out rows do not count as,
a run's status from run.json (never from the times of the files the view itself opens),
no polling for a run that is not running, the staleness chart's unit, charts of their own
for quantities of different scale, the episode list's stage filter and a 404 page for any
unknown path. The run is ``write_staged_run``'s (tests/view/conftest.py): 29 of 1000 steps,
stopped by its time limit 35 minutes ago."""

from __future__ import annotations

import html as htmllib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from areal_agents.view import create_app


def client(run: Path) -> TestClient:
    return TestClient(create_app([run.parent]))


def text(page: str) -> str:
    """The page's words, tags dropped and whitespace folded."""
    return " ".join(htmllib.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def stages_of(run: Path) -> list[dict[str, Any]]:
    return list(json.loads((run / "eval.json").read_text()))


def status_of(c: TestClient, name: str) -> dict[str, Any]:
    return next(r for r in c.get("/api/runs").json()["runs"] if r["name"] == name)


def set_run_json(run: Path, **fields: Any) -> None:
    data = json.loads((run / "run.json").read_text())
    data.update(fields)
    (run / "run.json").write_text(json.dumps(data))


def dead_pid() -> int:
    """The id of a process of this machine that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------- held-out stages
def test_the_dashboard_shows_the_held_out_stages_from_eval_json(staged_run: Path) -> None:
    c = client(staged_run)
    page = c.get(f"/runs/{staged_run.name}").text
    rows = re.findall(r'<tr class="stage" data-stage="([^"]+)">(.*?)</tr>', page, re.S)
    stages = stages_of(staged_run)
    assert [label for label, _ in rows] == [s["label"] for s in stages]
    names = {"base": "base", "warm_start": "warm start", "step-20": "step 20", "final": "final"}
    for (label, row), s in zip(rows, stages, strict=True):
        cells = text(row)
        assert cells.startswith(names[label]), cells
        assert f"{100 * s['success_rate']:.1f}%" in cells, cells
        assert f"{s['mean_reward']:.2f}" in cells and f"{s['mean_turns']:.2f}" in cells
        assert f"?stage={label}" in row  # its episodes
    assert 'data-metric="held_out"' in page  # the chart over the stages
    api = c.get(f"/api/runs/{staged_run.name}/metrics").json()
    assert [s["label"] for s in api["held_out"]] == [s["label"] for s in stages]
    assert [s["success_rate"] for s in api["held_out"]] == [s["success_rate"] for s in stages]


def test_held_out_rows_of_metrics_jsonl_are_stages_not_steps(staged_run: Path) -> None:
    c = client(staged_run)
    api = c.get(f"/api/runs/{staged_run.name}/metrics").json()
    assert [r["step"] for r in api["rows"]] == list(range(1, 30))
    assert not [r for r in api["rows"] if "held_out" in r]
    assert api["rows"][-1]["reward_mean"] == pytest.approx(0.7)  # not the final evaluation's
    st = status_of(c, staged_run.name)
    assert st["steps"] == 29 and st["latest"]["reward_mean"] == pytest.approx(0.7)
    written = [
        row
        for row in map(json.loads, (staged_run / "metrics.jsonl").read_text().splitlines())
        if "held_out" in row
    ]
    (staged_run / "eval.json").unlink()  # without eval.json the held-out rows are the stages
    again = client(staged_run).get(f"/api/runs/{staged_run.name}/metrics").json()["held_out"]
    assert [s["label"] for s in again] == [r["held_out"] for r in written]
    assert [s["success_rate"] for s in again] == [r["eval/success_rate"] for r in written]


def test_compare_puts_a_runs_stages_side_by_side(staged_run: Path) -> None:
    c = client(staged_run)
    stages = {s["label"]: s for s in stages_of(staged_run)}
    page = c.get(f"/compare?run={staged_run.name}&stages=base,final").text
    heads = re.findall(r'<th class="num" data-stage="([^"]+)">', page)
    assert heads == ["base", "final"]
    success = re.search(r'<tr data-key="success_rate">(.*?)</tr>', page, re.S)
    assert success, page
    shown = re.findall(r'data-stage="[^"]+">([^<]+)</td>', success.group(1))
    assert shown == [f"{100 * stages[x]['success_rate']:.1f}%" for x in ("base", "final")]
    assert "+50.0 pts" in success.group(1)  # final - base
    tasks = re.findall(r'<tr class="task" data-seed="(\d+)">(.*?)</tr>', page, re.S)
    assert [seed for seed, _ in tasks] == ["1000", "1001", "1002", "1003"]
    assert "/episodes/eval-base-1000-0" in tasks[0][1]
    assert "/episodes/eval-final-1000-0" in tasks[0][1]
    # the form's boxes send one parameter per stage; without any, every stage is compared
    boxes = c.get(f"/compare?run={staged_run.name}&stages=base&stages=step-20").text
    assert re.findall(r'<th class="num" data-stage="([^"]+)">', boxes) == ["base", "step-20"]
    every = c.get(f"/compare?run={staged_run.name}").text
    assert re.findall(r'<th class="num" data-stage="([^"]+)">', every) == list(stages)
    bad = c.get(f"/compare?run={staged_run.name}&stages=base,nope").text
    assert "has no held-out stage &#39;nope&#39;" in bad or "has no held-out stage 'nope'" in bad


# ---------------------------------------------------------------------------- status
def test_status_comes_from_run_json_not_from_the_store_the_view_opened(staged_run: Path) -> None:
    c = client(staged_run)
    assert c.get(f"/runs/{staged_run.name}/episodes").status_code == 200  # opens the store
    wal = staged_run / "episodes.db-wal"
    assert wal.exists() and time.time() - wal.stat().st_mtime < 60
    st = status_of(c, staged_run.name)
    assert st["state"] == "finished", st
    assert st["reason"] == "stopped by the time limit after 29 of 1000 steps"
    assert (st["steps"], st["target_steps"]) == (29, 1000)
    runs = text(c.get("/").text)
    assert "29 / 1000" in runs and "stopped by the time limit after 29 of 1000 steps" in runs
    page = c.get(f"/runs/{staged_run.name}").text
    assert 'id="run-reason"' in page
    assert "stopped by the time limit after 29 of 1000 steps" in text(page)


@pytest.mark.parametrize(
    ("fields", "state", "words"),
    [
        ({"status": "finished", "reason": "steps_done"}, "finished", "finished: all steps done"),
        (
            {"status": "stopped", "reason": "stopped"},
            "stopped",
            "stopped (Ctrl-C / SIGTERM) after 29 of 1000 steps",
        ),
        (
            {"status": "failed", "reason": "failed: RuntimeError: CUDA out of memory"},
            "failed",
            "failed: RuntimeError: CUDA out of memory",
        ),
    ],
    ids=["steps-done", "ctrl-c", "failed"],
)
def test_each_ending_is_said_in_words(
    staged_run: Path, fields: dict[str, Any], state: str, words: str
) -> None:
    set_run_json(staged_run, **fields)
    c = client(staged_run)
    st = status_of(c, staged_run.name)
    assert (st["state"], st["reason"]) == (state, words)
    assert words in text(c.get(f"/runs/{staged_run.name}").text)
    assert words in text(c.get("/").text)


def test_a_running_run_whose_process_is_gone_failed(staged_run: Path) -> None:
    pid = dead_pid()
    set_run_json(
        staged_run,
        status="running",
        reason=None,
        phase="training",
        ended_at=None,
        pid=pid,
        host=socket.gethostname(),
    )
    st = status_of(client(staged_run), staged_run.name)
    assert st["state"] == "failed"
    assert st["reason"].startswith(f"process {pid} is gone"), st


def test_a_running_run_trains_and_its_pages_poll(staged_run: Path) -> None:
    set_run_json(
        staged_run,
        status="running",
        reason=None,
        phase="evaluating",
        ended_at=None,
        pid=os.getpid(),
        host=socket.gethostname(),
        updated_at=time.time(),
    )
    c = client(staged_run)
    st = status_of(c, staged_run.name)
    assert (st["state"], st["phase"], st["reason"]) == ("training", "evaluating", None)
    page = c.get(f"/runs/{staged_run.name}").text
    assert "running: evaluating" in text(page)
    assert f'areal.dashboard("{staged_run.name}", [], true)' in page
    assert "areal.watchCount()" in c.get(f"/runs/{staged_run.name}/episodes").text
    assert "areal.liveRuns(true," in c.get("/").text


def test_pages_of_a_run_that_is_not_running_do_not_poll(staged_run: Path) -> None:
    c = client(staged_run)
    c.get(f"/runs/{staged_run.name}/episodes")  # the store is open: its files are new
    assert (
        f'areal.dashboard("{staged_run.name}", [], false)' in c.get(f"/runs/{staged_run.name}").text
    )
    assert "watchCount" not in c.get(f"/runs/{staged_run.name}/episodes").text
    assert "areal.liveRuns(false," in c.get("/").text  # runs of a directory: only new ones
    assert c.get(f"/api/runs/{staged_run.name}/metrics").json()["state"] == "finished"


def test_a_run_without_run_json_falls_back_to_the_trainers_files(staged_run: Path) -> None:
    """No run.json (a run from before it): final/ says finished; else metrics.jsonl or
    groups.jsonl changed within two minutes says training; the store's files, which the
    view changes by opening the store, never count."""
    (staged_run / "run.json").unlink()
    c = client(staged_run)
    c.get(f"/runs/{staged_run.name}/episodes")  # opening the store changes only its files
    assert (staged_run / "episodes.db-wal").exists()
    assert status_of(c, staged_run.name)["state"] == "stopped"
    assert "watchCount" not in c.get(f"/runs/{staged_run.name}/episodes").text
    os.utime(staged_run / "groups.jsonl")  # the trainer's ledger moves on
    assert status_of(c, staged_run.name)["state"] == "training"
    (staged_run / "final").mkdir()
    assert status_of(c, staged_run.name)["state"] == "finished"


# ---------------------------------------------------------------------------- charts
def charts(page: str) -> dict[str, tuple[list[str], str]]:
    """The dashboard's charts: key -> (series, caption)."""
    out = {}
    for caption, key, series in re.findall(
        r"<figcaption>([^<]*)</figcaption>\s*<div class=\"chart\" data-metric=\"([^\"]+)\""
        r"(?: data-series='([^']*)')?",
        page,
    ):
        out[key] = (json.loads(series) if series else [], htmllib.unescape(caption))
    return out


def test_staleness_is_counted_in_trained_tokens(staged_run: Path) -> None:
    page = client(staged_run).get(f"/runs/{staged_run.name}").text
    series, caption = charts(page)["staleness"]
    assert series == ["histograms.staleness"]
    assert "tokens" in caption and "episodes" not in caption, caption
    assert re.search(r'data-metric="staleness"[^>]*data-unit="tokens"', page)


def test_loss_and_gradient_norm_have_charts_of_their_own(staged_run: Path) -> None:
    shown = charts(client(staged_run).get(f"/runs/{staged_run.name}").text)
    assert shown["loss"][0] == ["loss"]
    assert shown["grad_norm"][0] == ["grad_norm"]
    assert not [k for k, (series, _) in shown.items() if {"loss", "grad_norm"} <= set(series)]


# ---------------------------------------------------------------------------- episodes, 404
def test_the_episode_list_filters_by_stage(staged_run: Path) -> None:
    c = client(staged_run)
    url = f"/runs/{staged_run.name}/episodes"

    def sessions(query: str) -> list[str]:
        return re.findall(r'<tr class="episode" data-session="([^"]+)"', c.get(url + query).text)

    everything = sessions("")
    assert len(everything) == 8 + 16
    training = sessions("?stage=training")
    assert sorted(training) == sorted(s for s in everything if s.startswith("train-"))
    for label in ("base", "warm_start", "step-20", "final"):
        got = sessions(f"?stage={label}")
        assert sorted(got) == sorted(f"eval-{label}-{seed}-0" for seed in range(1000, 1004))
    page = c.get(url).text
    select = re.search(r'<select name="stage".*?</select>', page, re.S)
    assert select, "no stage filter"
    options = re.findall(r'<option value="([^"]*)"', select.group(0))
    assert options == ["", "training", "base", "warm_start", "step-20", "final"]
    assert "stage: training, base" in c.get(url + "?stage=nope").text  # named, not an error
    assert c.get(f"/api/runs/{staged_run.name}/count?stage=base").json() == {"total": 4}


def test_an_unknown_path_answers_a_404_page_and_json_under_api(staged_run: Path) -> None:
    c = client(staged_run)
    for path in ("/nope", f"/runs/{staged_run.name}/nope/deeper", "/static/nope.css"):
        r = c.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"].startswith("text/html"), (path, r.text[:200])
        assert '<section class="card error"' in r.text and "Not found" in r.text, path
        assert '<link rel="stylesheet" href="/static/view.css">' in r.text
    assert "Nothing is at /nope." in text(c.get("/nope").text)
    r = c.get("/runs/nope")
    assert r.status_code == 404 and "no run named" in r.text
    api = c.get("/api/nope")
    assert api.status_code == 404 and api.json() == {"error": "Not Found"}
    assert c.get("/api/runs/nope/metrics").json() == {"error": "no run named 'nope'"}
    post = c.post("/runs")
    assert post.status_code in (404, 405) and post.headers["content-type"].startswith("text/html")
