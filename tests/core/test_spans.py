"""Where the time goes: interval arithmetic by hand, lock waits, the JSONL file, and a real
two-step training run whose spans and ``time/*`` metrics add up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_agents import spans
from areal_agents.engines.embedded import FairLock

ROOT = Path(__file__).resolve().parents[2]


def test_union_subtract_intersect_by_hand() -> None:
    assert spans.union([(3, 5), (0, 1), (0.5, 2), (5, 6), (7, 7)]) == [(0, 2), (3, 6)]
    assert spans.subtract([(0, 10)], [(1, 2), (4, 6), (9, 12)]) == [(0, 1), (2, 4), (6, 9)]
    assert spans.subtract([(0, 2), (3, 6)], [(1, 4)]) == [(0, 1), (4, 6)]
    assert spans.intersect([(0, 2), (3, 6)], [(1, 4), (5, 9)]) == [(1, 2), (3, 4), (5, 6)]
    assert spans.length([(0, 2), (3, 6)]) == 5


def test_busy_and_idle_of_a_window_by_hand() -> None:
    """Window [0, 10] (W = 10):
    engine decode [0, 4] with a lock wait [1, 2] -> engine busy [0,1] + [2,4] = 3 s;
    trainer forward [1, 2] + backward [2, 3] (one interval [1, 3]) and optimizer [8, 9]
      -> 3 s;
    busy = |[0,4] U [8,9]| = 5 -> 0.5; idle = [4, 8] U [9, 10] = 5 s;
    gate_full [3, 6] covers idle [4, 6] = 2 s; weight_sync [8.5, 10] covers idle [9, 10] = 1 s;
    a span outside the window ([11, 12]) counts nothing."""
    rows = [
        ("engine", "decode", 0.0, 4.0),
        ("engine", "lock_wait", 1.0, 2.0),
        ("trainer", "forward", 1.0, 2.0),
        ("trainer", "backward", 2.0, 3.0),
        ("trainer", "optimizer", 8.0, 9.0),
        ("rollout", "gate_full", 3.0, 6.0),
        ("trainer", "weight_sync", 8.5, 10.0),
        ("engine", "decode", 11.0, 12.0),
        ("episodes", "episode", 0.0, 10.0),
    ]
    got = spans.busy_idle(rows, 0.0, 10.0)
    assert got["time/busy"] == pytest.approx(0.5)
    assert got["time/busy_engine"] == pytest.approx(0.3)
    assert got["time/busy_trainer"] == pytest.approx(0.3)
    assert got["time/idle_s"] == pytest.approx(5.0)
    assert got["time/idle_gate_full_s"] == pytest.approx(2.0)
    assert got["time/idle_weight_sync_s"] == pytest.approx(1.0)
    assert got["time/idle_group_tail_s"] == 0.0
    assert got["time/lock_wait_s"] == pytest.approx(1.0)
    assert "time/busy_episodes" not in got  # episodes are not compute
    assert spans.busy_idle(rows, 5.0, 5.0) == {}


def test_busy_cores_weights_each_lane_by_its_own_cores() -> None:
    """Engine on 1 core decodes [0, 8] of W = 10 -> 0.8; trainer on 3 cores computes [0, 2]
    and [6, 8] -> 0.4; busy_cores = (0.8 * 1 + 0.4 * 3) / 4 = 0.5 (while ``busy``, some
    compute running, is 0.8)."""
    rows = [
        ("engine", "decode", 0.0, 8.0),
        ("trainer", "forward", 0.0, 2.0),
        ("trainer", "backward", 6.0, 8.0),
    ]
    got = spans.busy_idle(rows, 0.0, 10.0, cores={"engine": 1, "trainer": 3})
    assert got["time/busy_cores"] == pytest.approx(0.5)
    assert got["time/busy"] == pytest.approx(0.8)
    assert "time/busy_cores" not in spans.busy_idle(rows, 0.0, 10.0)


def test_busy_cores_counts_a_guest_lane_on_its_hosts_cores_once() -> None:
    """An idle-priority engine replica (lane ``engine_idle``) on the trainer's core: the
    engine decodes [0, 8] of W = 10 on core 0 -> 0.8; on core 1 the trainer computes [0, 4]
    and the guest [3, 9]: their union [0, 9] -> 0.9 (the overlap [3, 4] counts once);
    busy_cores = (0.8 + 0.9) / 2 = 0.85. Without the mapping the guest would not count:
    (0.8 + 0.4) / 2 = 0.6."""
    rows = [
        ("engine", "decode", 0.0, 8.0),
        ("trainer", "forward", 0.0, 4.0),
        ("engine_idle", "decode", 3.0, 9.0),
    ]
    cores = spans.pinned_lane_cores([0], [1], [1])
    assert cores == {"engine": 1, "trainer": 1, "engine_idle": "trainer"}
    got = spans.busy_idle(rows, 0.0, 10.0, cores=cores)
    assert got["time/busy_cores"] == pytest.approx(0.85)
    assert got["time/busy_engine_idle"] == pytest.approx(0.6)
    plain = spans.busy_idle(rows, 0.0, 10.0, cores={"engine": 1, "trainer": 1})
    assert plain["time/busy_cores"] == pytest.approx(0.6)
    # On cores of its own it is a lane with its own cores: (0.8 + 0.4 + 0.6 * 2) / 4 = 0.6
    cores = spans.pinned_lane_cores([0], [1], [2, 3])
    assert cores == {"engine": 1, "trainer": 1, "engine_idle": 2}
    assert spans.busy_idle(rows, 0.0, 10.0, cores=cores)["time/busy_cores"] == pytest.approx(0.6)
    assert spans.pinned_lane_cores([0], [1], [0])["engine_idle"] == "engine"  # type: ignore[index]


def test_spans_drained_in_one_process_land_on_the_clock_of_another() -> None:
    """An engine actor's recorder drains wall-clock spans; the trainer's merges them onto its
    own perf_counter clock (same machine: within a millisecond), with a new lane."""
    actor = spans.SpanRecorder(None, max_pending=3)
    t = time.perf_counter()
    for i in range(5):  # the two oldest fall off at max_pending=3
        actor.add("engine", "decode", t + i, t + i + 0.5, rows=i)
    drained = actor.drain()
    assert [r["rows"] for r in drained] == [2, 3, 4]
    assert abs(drained[0]["start"] - (time.time() + 2.0)) < 0.05
    assert actor.drain() == [] and actor.window(t - 1, t + 10) == []
    trainer = spans.SpanRecorder(None)
    trainer.merge(drained, lane="engine1")
    got = trainer.window(t, t + 10)
    assert [(lane, name) for lane, name, _, _ in got] == [("engine1", "decode")] * 3
    assert got[0][2] == pytest.approx(t + 2.0, abs=1e-3) and got[0][3] == pytest.approx(
        t + 2.5, abs=1e-3
    )


def test_a_timed_lock_records_the_wait_of_the_one_that_waited() -> None:
    rec = spans.record_to(None)
    try:
        lock = FairLock()
        engine, trainer = spans.TimedLock(lock, "engine"), spans.TimedLock(lock, "trainer")
        held = threading.Event()

        def hold() -> None:
            with trainer("optimizer"):
                held.set()
                time.sleep(0.2)

        t = threading.Thread(target=hold)
        t.start()
        held.wait()
        with engine():
            pass
        t.join()
        rows = rec.window(0.0, time.perf_counter() + 1)
    finally:
        spans.stop()
    names = {(lane, name): b - a for lane, name, a, b in rows}
    assert names[("trainer", "optimizer")] >= 0.19
    assert 0.1 < names[("engine", "lock_wait")] <= names[("trainer", "optimizer")] + 0.05
    assert ("trainer", "lock_wait") not in names


def test_the_file_keeps_order_across_a_resume_and_skips_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    rec = spans.SpanRecorder(path)
    rec.add("engine", "decode", rec.t0 + 1.0, rec.t0 + 1.5, rows=2)
    rec.flush()
    rec.flush()  # nothing new: nothing written
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1]) == {
        "lane": "engine",
        "name": "decode",
        "start": 1.0,
        "end": 1.5,
        "rows": 2,
    }
    wall0 = json.loads(lines[0])["wall_t0"]
    resumed = {"clock": "perf_counter", "t0": 5.0, "wall_t0": wall0 + 100.0}
    with path.open("a") as f:
        f.write(json.dumps(resumed) + "\n")
        f.write(json.dumps({"lane": "trainer", "name": "forward", "start": 2, "end": 3}) + "\n")
        f.write('{"lane": "trainer", "na')  # a killed process
    header, rows = spans.read(path)
    assert header["t0"] == 5.0
    assert [(r["name"], r["start"], r["end"]) for r in rows] == [
        ("decode", 1.0, 1.5),
        ("forward", 102.0, 103.0),
    ]


def test_nothing_is_recorded_when_no_recorder_runs() -> None:
    spans.stop()
    spans.add("engine", "decode", 0.0, 1.0)
    with spans.span("engine", "decode"):
        pass
    assert spans.current().window(-1e9, 1e9) == []


def _timeline(run: Path) -> dict[str, str]:
    """Run ``benchmarks/timeline.py RUN`` (it writes RUN/timeline.png); its printed summary."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "timeline.py"), str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split() for line in done.stdout.splitlines()[1:])


def test_a_training_run_writes_its_spans_and_time_metrics(tiny_model_dir, tmp_path) -> None:
    """Two GRPO steps on the tiny model: spans.jsonl has the engine's prefill and decode, the
    trainer's forward, backward and optimizer, the weight syncs and one span per episode;
    each step's time/* metrics agree with busy_idle over the spans of that step."""
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import Trainer

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    asyncio.run(Trainer(cfg, quiet=True).run())
    header, rows = spans.read(out / "spans.jsonl")
    assert header["clock"] == "perf_counter"
    names = {(r["lane"], r["name"]) for r in rows}
    for want in [
        ("engine", "prefill"),
        ("engine", "decode"),
        ("engine", "weight_update"),
        ("trainer", "forward"),
        ("trainer", "backward"),
        ("trainer", "optimizer"),
        ("trainer", "weight_sync"),
        ("episodes", "episode"),
        ("rollout", "group_tail"),
    ]:
        assert want in names, (want, sorted(names))
    episodes = [r for r in rows if r["name"] == "episode"]
    assert len(episodes) >= 2 * 2 * 2  # steps x groups x group size
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    syncs = [r for r in rows if r["name"] == "weight_sync"]
    for m in metrics:
        assert 0.0 < m["time/busy"] <= 1.0
        assert 0.0 < m["time/busy_engine"] <= m["time/busy"] + 1e-9
        assert 0.0 < m["time/busy_trainer"] <= m["time/busy"] + 1e-9
        assert m["time/idle_s"] >= 0.0
        assert 0.0 < m["time/cpu"] <= 1.1  # CPU seconds over wall x cores
        for cause in spans.IDLE_CAUSES:
            assert 0.0 <= m[f"time/idle_{cause}_s"] <= m["time/idle_s"] + 1e-9
    # step 2's window is [end of the first step's weight sync, end of its own]: recompute it
    # from the spans that had ended by then (a decode step still running when the metrics
    # were taken is in the file, not in that step's metrics)
    s1, s2 = (r for r in syncs if r.get("version") in (1, 2))
    window = [(r["lane"], r["name"], r["start"], r["end"]) for r in rows]
    ended = [w for w in window if w[3] <= s2["end"]]
    again = spans.busy_idle(ended, s1["end"], s2["end"])
    assert metrics[1]["time/busy"] == pytest.approx(again["time/busy"], abs=0.02)

    # the timeline of the run: a PNG, and the busy share of the whole run printed
    printed = _timeline(out)
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    whole = spans.busy_idle(window, min(r["start"] for r in rows), max(r["end"] for r in rows))
    assert float(printed["time/busy"]) == pytest.approx(whole["time/busy"], abs=1e-3)


def test_the_timeline_of_a_pinned_run_gives_the_cores_busy_share(tmp_path: Path) -> None:
    """A run whose config put the engine and the trainer on a core each: the timeline prints
    ``time/busy_cores`` by hand. Window [0, 10]: engine decode [0, 9] (0.9), trainer forward
    [0, 4] + backward [4, 7] (0.7): cores busy (0.9 + 0.7) / 2 = 0.8, some compute 0.9."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("rollout: {engine_cpus: [0]}\ntrain: {cpus: [1]}\n")
    rec = spans.SpanRecorder(run / "spans.jsonl")
    t = rec.t0
    for lane, name, a, b in [
        ("engine", "decode", 0.0, 9.0),
        ("trainer", "forward", 0.0, 4.0),
        ("trainer", "backward", 4.0, 7.0),
        ("trainer", "weight_sync", 9.5, 10.0),
    ]:
        rec.add(lane, name, t + a, t + b)
    rec.flush()
    printed = _timeline(run)
    assert float(printed["time/busy_cores"]) == pytest.approx(0.8, abs=1e-3)
    assert float(printed["time/busy"]) == pytest.approx(0.9, abs=1e-3)
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"
