"""benchmarks/view_latency.py on a small store: the store it generates is what the proxy and
the trainer would have recorded, and it prints a row per page against the target."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.store import EpisodeStore
from areal_agents.trajectory import merge_decisions

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "view_latency.py"


def test_view_latency_generates_a_realistic_store_and_times_every_page(
    tmp_path: Path, qwen_chat_tokenizer: ChatTokenizer
) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--episodes", "240", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if re.match(r"\| (episode|full-text)", line)]
    assert len(rows) == 5, out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        p50, p95, worst, ratio = map(float, cells[1:])
        assert 0 < p50 <= p95 <= worst and ratio == pytest.approx(p95 / 300, abs=0.01)
    assert re.search(
        r"worst p95 / target: \d+\.\d\d \((within|OVER) the 300 ms target\)", out.stdout
    )

    run = tmp_path / "view-latency-240-s0"
    info = json.loads((run / "generated.json").read_text())
    store = EpisodeStore(run / "episodes.db")
    try:
        sids = store.session_ids()
        assert len(sids) == info["episodes"] == 240
        groups: Counter[str] = Counter()
        ends: Counter[str] = Counter()
        turns, calls, trained = [], 0, 0
        for sid in sids:
            session = store.load(sid)
            assert session is not None
            ep = session.episode
            groups[ep.group_id or ""] += 1
            ends[ep.end_reason or ""] += 1
            turns.append(len(ep.completions))
            for c in ep.completions:  # each prompt is the chat template's, as the proxy renders it
                assert c.prompt_ids == qwen_chat_tokenizer.encode_chat(c.messages, c.tools)
                calls += len(c.message.get("tool_calls") or [])
            assert all(m["merged"] for m in merge_decisions(ep)[1:])  # each turn extends the last
            records = store.train_tokens(sid)
            trained += bool(records)
            by_id = {c.id: c for c in ep.completions}
            for r in records:
                n = len(by_id[r["completion_id"]].output_ids)
                assert len(r["advantages"]) == len(r["behaviour_weights"]) == n
        assert set(groups.values()) == {8}
        assert {"terminated", "truncated"} <= set(ends) and len(ends) >= 3
        long = [t for t in turns if t >= 100]
        assert long and all(100 <= t <= 150 for t in long)
        assert sorted(info["long_episodes"]) == sorted(
            s for s, t in zip(sids, turns, strict=True) if t >= 100
        )
        assert sum(2 <= t <= 8 for t in turns) >= 0.9 * len(turns)
        assert calls > len(sids) and 0 < trained < len(sids)
    finally:
        store.close()
