"""``areal-agent train`` generating with SGLang's API, served by the fake SGLang server
(:mod:`areal_agents.testing.fake_sglang`, its own process, on CPU): launched with LoRA
(killed with SIGKILL mid-run and restarted) and with full weights; and attached to a server
that cannot read ``engine.weights_dir``, which stops the run before its first episode."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_agents.engines import sglang as sglang_engine
from areal_agents.errors import BackendError, ConfigError
from areal_agents.trainer.loop import train

FAKE = "areal_agents.testing.fake_sglang"
ADAPTER_LOAD = re.compile(r"fake SGLang: loaded LoRA adapter \S+ from (\S+)")
FULL_LOAD = re.compile(r"fake SGLang: updated weights from (\S+)")
RESTARTED = "restarted by areal-agents"


def _launched(**launch: Any) -> dict[str, Any]:
    return {
        "backend": "sglang",
        "launch": {"python": sys.executable, "module": FAKE, "start_timeout_s": 300, **launch},
    }


Labels = dict[tuple[int, ...], set[str]]


def _record_server_labels(monkeypatch: pytest.MonkeyPatch) -> Labels:
    """Each SGLang response's token ids -> the ``meta_info.weight_version`` labels reported
    with them (the label is per response)."""
    seen: Labels = {}
    real = sglang_engine._segment

    def spy(out: dict[str, Any]) -> Any:
        seg = real(out)
        if seg.ids:
            seen.setdefault(tuple(seg.ids), set()).add(str(out["meta_info"]["weight_version"]))
        return seg

    monkeypatch.setattr(sglang_engine, "_segment", spy)
    return seen


def _responses(ids: list[int], versions: list[int], labels: Labels) -> int | None:
    """How many server responses ``ids`` is made of, each a response's tokens with its
    ``versions`` the label that response reported (a request interrupted by a weight update
    and sent again is several responses); None: no such split."""
    starts: dict[int, list[tuple[int, ...]]] = {}
    for seg in labels:
        starts.setdefault(seg[0], []).append(seg)
    best: dict[int, int | None] = {len(ids): 0}

    def split(at: int) -> int | None:
        if at not in best:
            best[at] = None
            for seg in starts.get(ids[at], []):
                end = at + len(seg)
                if tuple(ids[at:end]) != seg or len(set(versions[at:end])) != 1:
                    continue
                if str(versions[at]) in labels[seg] and (rest := split(end)) is not None:
                    best[at] = rest + 1
                    break
        return best[at]

    return split(0)


def _check_versions(sessions: dict[str, Any], labels: Labels) -> tuple[int, int]:
    """Every stored token's version is the label the server reported with the response
    that carried it; (completions, completions made of several responses)."""
    completions = interrupted = 0
    for session in sessions.values():
        for c in session.episode.completions:
            if not c.output_ids:
                continue
            parts = _responses(list(c.output_ids), list(c.output_versions), labels)
            assert parts is not None, (session.episode.session_id, c.output_versions)
            completions += 1
            interrupted += parts > 1
    return completions, interrupted


@pytest.mark.slow
def test_training_on_a_launched_fake_sglang_server_that_is_killed_mid_run(
    tiny_model_dir: Path,
    parity_env: str,
    training_checks: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = training_checks
    steps, out = 4, tmp_path / "run"
    cfg = t.short_run(tiny_model_dir, out, _launched(max_restarts=2), train={"steps": steps})
    labels = _record_server_labels(monkeypatch)
    log = out / "engine" / "sglang-0.log"
    with t.kill_server_after(out, log, step=1, pid_pattern=t.FAKE_SGLANG_PID) as killed:
        train(cfg, quiet=True)
    assert killed.get("pid"), "the server was not killed"

    t.check_restarted_run(out, "sglang", steps)

    # One adapter load per weight sync (the initial one and one per step) from directories
    # of their own, and the current one again on the restarted server.
    text = log.read_text()
    assert RESTARTED in text
    loads = ADAPTER_LOAD.findall(text)
    assert len(set(loads)) == steps + 1 and len(loads) == steps + 2, loads
    before, after = text.split(RESTARTED, 1)
    assert ADAPTER_LOAD.findall(after)[0] == ADAPTER_LOAD.findall(before)[-1]
    assert not FULL_LOAD.findall(text)

    sessions = t.check_store(out, steps)
    completions, _ = _check_versions(sessions, labels)
    assert completions >= steps * 8, completions


def test_a_server_that_dies_once_too_often_stops_the_run_with_its_log(
    tiny_model_dir: Path, parity_env: str, training_checks: Any, tmp_path: Path
) -> None:
    """``engine.launch.max_restarts: 0``: the first death is final, and the run stops with
    the server's exit and log instead of waiting for episodes that cannot come."""
    t, out = training_checks, tmp_path / "run"
    cfg = t.short_run(tiny_model_dir, out, _launched(max_restarts=0), train={"steps": 4})
    log = out / "engine" / "sglang-0.log"
    started = time.monotonic()
    with (
        t.kill_server_after(out, log, step=1, pid_pattern=t.FAKE_SGLANG_PID) as killed,
        pytest.raises(BackendError, match=r"exited \(code -9\) after 0 restart\(s\) \(limit: 0\)"),
    ):
        train(cfg, quiet=True)
    assert killed.get("pid") and time.monotonic() - started < 120
    assert [r["step"] for r in t.metrics(out)] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["full", "merged-lora"])
def test_training_full_weights_on_a_launched_fake_sglang_server(
    weights: str,
    tiny_model_dir: Path,
    parity_env: str,
    training_checks: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every sync is a full checkpoint through ``update_weights_from_disk``: LoRA off, or
    LoRA on with ``engine.lora_updates: merged`` (the adapter merged into float32 weights
    by the trainer's process; the server never sees an adapter)."""
    t = training_checks
    steps, out = 3, tmp_path / "run"
    engine = _launched(max_restarts=0)
    model: dict[str, Any] = {"lora": {"enabled": False}}
    if weights == "merged-lora":
        engine["lora_updates"] = "merged"
        model = {"lora": {"enabled": True, "r": 8, "alpha": 16}}
    cfg = t.short_run(tiny_model_dir, out, engine, model=model, train={"steps": steps})
    labels = _record_server_labels(monkeypatch)
    train(cfg, quiet=True)

    rows = t.metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert {r["engine"] for r in rows} == {"sglang"}
    assert any(r["grad_norm"] > 0 for r in rows)
    t.check_mismatch(rows)
    text = (out / "engine" / "sglang-0.log").read_text()
    loads = FULL_LOAD.findall(text)
    assert len(set(loads)) == steps + 1 and len(loads) == steps + 1, loads
    assert not ADAPTER_LOAD.findall(text)
    sessions = t.check_store(out, steps)
    completions, interrupted = _check_versions(sessions, labels)
    assert completions >= steps * 8, (completions, interrupted)


class _Served:
    """A fake SGLang server on loopback in this process (uvicorn in a thread)."""

    def __init__(self, fake: Any) -> None:
        import uvicorn

        from areal_agents.engines.launch import free_port

        self.fake, port = fake, free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            fake.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="fake-sglang", daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *_: Any) -> None:
        import asyncio

        self.server.should_exit = True
        self.thread.join(timeout=10)
        asyncio.run(self.fake.close())


@pytest.fixture
def remote_sglang(tiny_model_dir: Path, tmp_path: Path) -> Iterator[_Served]:
    """A fake SGLang server that reads weights under ``tmp_path/elsewhere`` only, as a
    server on another machine would."""
    from areal_agents.testing.fake_sglang import FakeSGLang

    fake = FakeSGLang(str(tiny_model_dir), readable_root=str(tmp_path / "elsewhere"))
    with _Served(fake) as served:
        yield served


def test_an_attached_server_that_cannot_read_the_weights_dir_stops_the_run_first(
    tiny_model_dir: Path,
    parity_env: str,
    training_checks: Any,
    tmp_path: Path,
    remote_sglang: _Served,
) -> None:
    from areal_agents.serve.store import EpisodeStore

    t, out = training_checks, tmp_path / "run"
    cfg = t.short_run(tiny_model_dir, out, {"backend": "sglang", "urls": [remote_sglang.url]})
    with pytest.raises(ConfigError) as caught:
        train(cfg, quiet=True)
    message = str(caught.value)
    assert message.startswith("engine.weights_dir:"), message
    assert str(out / "weights") in message and "No such file or directory" in message
    assert remote_sglang.fake.loads == []
    assert (out / "episodes.db").exists()  # the run made its store, and put no episode in it
    store = EpisodeStore(out / "episodes.db")
    try:
        assert list(store.session_ids()) == []
    finally:
        store.close()
    assert not t.metrics(out)
