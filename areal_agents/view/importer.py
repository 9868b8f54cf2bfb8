"""``areal-agent view --import DIR``: build ``DIR/episodes.db`` from the JSONL an older run
or eval wrote (``episodes.jsonl``: one ``Episode.to_dict`` per line, an eval's with its
``result``), so that the view can filter and search it.

Episodes already in the store (same session id) are skipped, so importing twice adds
nothing. Each episode's eval result (``success``, ``turns``, ``end_reason``) goes on its
metadata, as the runner records it on live episodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_agents.errors import ConfigError
from areal_agents.serve.session import Session
from areal_agents.serve.store import EpisodeStore
from areal_agents.trajectory import episode_from_dict

__all__ = ["import_run"]


def import_run(run_dir: str | Path) -> dict[str, int]:
    """Import ``run_dir/episodes.jsonl`` into ``run_dir/episodes.db``; returns
    ``{imported, skipped, bad_lines}``."""
    run = Path(run_dir).expanduser()
    source = run / "episodes.jsonl"
    if not source.exists():
        has_ledger = (run / "groups.jsonl").exists()
        raise ConfigError(
            f"{run}: no episodes.jsonl to import"
            + (
                " (groups.jsonl, the trainer's ledger, names sessions but holds no "
                "trajectories; runs record their episodes in episodes.db)"
                if has_ledger
                else ""
            )
        )
    store = EpisodeStore(run / "episodes.db")
    counts = {"imported": 0, "skipped": 0, "bad_lines": 0}
    try:
        known = set(store.session_ids())
        with source.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    episode = episode_from_dict(row)
                except (ValueError, KeyError, TypeError):
                    counts["bad_lines"] += 1
                    continue
                if episode.session_id in known:
                    counts["skipped"] += 1
                    continue
                result = row.get("result") or {}
                for key in ("success", "turns"):
                    if result.get(key) is not None:
                        episode.metadata.setdefault(key, result[key])
                if result.get("end_reason") and not episode.end_reason:
                    episode.end_reason = result["end_reason"]
                episode.ended = True
                created = min((c.created_at for c in episode.completions), default=0.0)
                session = Session(episode.session_id, "", episode, created_at=created)
                session.last_active = created
                session.stored_active = created
                store.put_session(session)
                for i, c in enumerate(episode.completions):
                    store.put_completion(session, c, i, episode.completions[:i])
                store.put_header(session)
                known.add(episode.session_id)
                counts["imported"] += 1
        store.flush_sync(timeout=600)
    finally:
        store.close()
    return counts
