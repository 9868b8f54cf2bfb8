"""Long episodes in the episode store: size and read time against the turns.

An episode of T turns (each turn: 3 sampled tokens and a 20-token tool result, after a
40-token prompt) is recorded into a SQLite store, the way the proxy records it. Ours: the
store's delta rows (each prompt stored as its base plus the new suffix) and the delta
trajectory read (``GET /sessions/{id}/trajectory?prompts=delta``: ``load`` from the store,
then ``to_dict(prompts="delta")`` as JSON). Baseline, in the same run: every completion with
its whole prompt (the full trajectory read, ``to_dict()`` as JSON), which is what storing and
reading whole prompts costs: O(turns²). Reads are of a session the proxy holds (as it does
from its first read after a restart on); ``load`` (rebuilding every prompt from the store,
once per process) is timed on its own.

    python benchmarks/store_scaling.py [--turns 25 50 100 200 400]

Prints one row per length, and the growth from the shortest to the longest (linear: x16 for
25 -> 400 turns; quadratic: x256).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from areal_agents.serve.session import SessionStore
from areal_agents.serve.store import EpisodeStore
from areal_agents.trajectory import Completion


def record(store: EpisodeStore, turns: int) -> str:
    sessions = SessionStore(store)
    session = sessions.create()
    prompt, messages = list(range(100, 140)), [{"role": "user", "content": "start"}]
    for i in range(turns):
        c = Completion(
            id=f"c{i}",
            messages=list(messages),
            prompt_ids=list(prompt),
            output_ids=[1000 + i, 1001 + i, 151645],
            output_logprobs=[-0.1, -0.2, -0.3],
            output_versions=[0, 0, 0],
            message={"role": "assistant", "content": f"turn {i}"},
            finish_reason="stop",
        )
        sessions.record(session, c)
        messages = [*messages, c.message, {"role": "tool", "tool_call_id": "x", "content": "ok"}]
        prompt = [*prompt, *c.output_ids, *range(200, 220)]
    store.flush_sync()
    return session.id


def best_of(n: int, fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[25, 50, 100, 200, 400])
    args = ap.parse_args()
    rows = []
    print(
        "| turns | stored KB (ours) | whole-prompt KB (baseline) | delta read ms (ours) "
        "| full read ms (baseline) | read bytes ours / baseline | load ms |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for turns in args.turns:
            store = EpisodeStore(Path(tmp) / f"t{turns}.db")
            sid = record(store, turns)
            stored = store.size()["delta_bytes"]

            load_s, session = best_of(3, lambda: store.load(sid))  # noqa: B023
            assert session is not None
            episode = session.episode
            ours_s, ours = best_of(
                3,
                lambda: json.dumps(episode.to_dict(prompts="delta")).encode(),  # noqa: B023
            )
            base_s, base = best_of(3, lambda: json.dumps(episode.to_dict()).encode())  # noqa: B023
            whole = sum(4 * len(c.prompt_ids) for c in session.episode.completions)
            whole += sum(len(json.dumps(c.messages)) for c in session.episode.completions)
            store.close()
            rows.append((turns, stored, whole, ours_s, base_s))
            print(
                f"| {turns} | {stored / 1e3:.1f} | {whole / 1e3:.1f} | {ours_s * 1e3:.1f} | "
                f"{base_s * 1e3:.1f} | {len(ours) / len(base):.3f} | {load_s * 1e3:.1f} |",  # type: ignore[arg-type]
                flush=True,
            )
    (t0, s0, w0, r0, b0), (t1, s1, w1, r1, b1) = rows[0], rows[-1]
    print(
        f"growth {t0} -> {t1} turns (x{t1 / t0:.0f}): stored x{s1 / s0:.1f} (baseline "
        f"x{w1 / w0:.1f}), read time x{r1 / r0:.1f} (baseline x{b1 / b0:.1f})"
    )


if __name__ == "__main__":
    main()
