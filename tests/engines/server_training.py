"""What the training-on-servers tests share: a short run's config, and the checks of what it
left behind (metrics, the episode store, the server log)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MISMATCH_BOUND = 1e-4
"""mean k3 of the server's logprobs against the trainer's, float32 on both sides."""

VLLM_PID = r"APIServer pid=(\d+)"
"""Where vLLM's log names its API server process."""
FAKE_SGLANG_PID = r"fake SGLang server pid=(\d+)"
"""The fake SGLang server's first line (areal_agents.testing.fake_sglang)."""


def short_run(model_dir: Path, out: Path, engine: dict[str, Any], **sections: Any) -> Any:
    """A few GRPO steps with LoRA on the tiny model in ``test/Parity-v0`` (the ``parity_env``
    fixture: the reward is the reply length's parity, so groups have advantages), generated
    by ``engine``; ``sections`` update the config's sections."""
    import yaml

    from areal_agents.trainer.config_io import load_config

    raw: dict[str, Any] = {
        "env": {"id": "test/Parity-v0"},
        "model": {
            "path": str(model_dir),
            "dtype": "float32",
            "device": "cpu",
            "lora": {"enabled": True, "r": 8, "alpha": 16},
        },
        "engine": engine,
        "sampling": {"temperature": 1.0, "max_new_tokens": 12},
        "rollout": {
            "group_size": 4,
            "batch_size": 2,
            "max_head_offpolicyness": 1,
            "concurrency": 8,
            "max_turns": 1,
        },
        "optim": {"lr": 5e-3},
        "train": {"steps": 3, "micro_batch_tokens": 2048, "save_every": 0, "output_dir": str(out)},
        "metrics": {"tensorboard": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_mismatch(rows: list[dict[str, Any]]) -> None:
    """``mismatch/kl`` is measured on some step and under the bound wherever it is."""
    checked = [r["mismatch/kl"] for r in rows if "mismatch/kl" in r]
    assert checked and max(checked) < MISMATCH_BOUND, checked


def check_restarted_run(out: Path, backend: str, steps: int) -> list[dict[str, Any]]:
    """A run whose server was killed once: every step done, on ``backend``, learning, one
    restart, the mismatch under its bound. Returns the metrics rows."""
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert {r["engine"] for r in rows} == {backend}
    assert any(r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["engine/restarts"] == 1
    check_mismatch(rows)
    return rows


def stored_episodes(out: Path) -> dict[str, Any]:
    """Every session of the run's store, by id (read after the run)."""
    from areal_agents.serve.store import EpisodeStore

    store = EpisodeStore(out / "episodes.db")
    try:
        return {sid: store.load(sid) for sid in store.session_ids()}
    finally:
        store.close()


def check_store(out: Path, steps: int) -> dict[str, Any]:
    """Every trained episode is in the store once, ended, with a version per output token."""
    sessions = stored_episodes(out)
    groups = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    trained = [s for g in groups for s in g["sessions"]]
    assert len(trained) == len(set(trained)), "an episode was trained twice"
    assert {g["step"] for g in groups} == set(range(1, steps + 1))
    missing = set(trained) - set(sessions)
    assert not missing, f"trained episodes missing from the store: {sorted(missing)[:3]}"
    for sid in trained:
        ep = sessions[sid].episode
        assert ep.end_reason in ("terminated", "truncated"), (sid, ep.end_reason)
        for c in ep.completions:
            assert len(c.output_versions) == len(c.output_ids)
    return sessions


def adapter_loads(log_text: str) -> list[str]:
    """The adapter directories a vLLM server loaded, in order (from its log's text)."""
    return re.findall(r"Loaded new LoRA adapter: name '[^']+', path '([^']+)'", log_text)


@contextmanager
def kill_server_after(
    out: Path, log: Path, step: int, pid_pattern: str = VLLM_PID
) -> Iterator[dict[str, Any]]:
    """While the block runs: once ``metrics.jsonl`` has ``step``, SIGKILL the server whose
    log is ``log`` (the process whose id the last match of ``pid_pattern`` in the log
    names: vLLM's API server by default). Yields what was done."""
    done: dict[str, Any] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            rows = metrics(out) if (out / "metrics.jsonl").exists() else []
            pids = re.findall(pid_pattern, log.read_text()) if log.exists() else []
            if pids and any(r["step"] >= step for r in rows):
                done["pid"] = int(pids[-1])
                os.kill(done["pid"], signal.SIGKILL)
                done["at_step"] = max(r["step"] for r in rows)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(timeout=5)
