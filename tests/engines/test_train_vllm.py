"""``areal-agent train`` generating with vLLM's CPU build: launched (LoRA synced every step,
the server killed with SIGKILL mid-run and restarted) and attached (the session's server),
with the training-inference mismatch under its bound, and over it when a weight sync is
skipped (the negative control)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from areal_agents.engines import vllm as vllm_engine
from areal_agents.trainer.loop import train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _record_server_labels(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, ...], list[Any]]:
    """Each vLLM response's token ids -> the version labels vLLM reported for them."""
    seen: dict[tuple[int, ...], list[Any]] = {}
    real = vllm_engine._segment

    def spy(out: dict[str, Any], top_k: int) -> Any:
        seg = real(out, top_k)
        seen[tuple(seg.ids)] = list(seg.versions)
        return seg

    monkeypatch.setattr(vllm_engine, "_segment", spy)
    return seen


def test_training_on_a_launched_vllm_server_that_is_killed_mid_run(
    tiny_model_dir: Path,
    vllm_python: str,
    parity_env: str,
    training_checks: Any,
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    t = training_checks
    steps, out = 4, tmp_path / "run"
    engine = {
        "backend": "vllm",
        "launch": {
            "python": vllm_python,
            "args": "--max-model-len 2048",
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "max_restarts": 2,
        },
    }
    # The CPU form of one inference and one training GPU: a core each.
    cfg = t.short_run(
        tiny_model_dir,
        out,
        engine,
        train={"steps": steps, "cpus": [1]},
        rollout={"engine_cpus": [0]},
    )
    labels = _record_server_labels(monkeypatch)
    log = out / "engine" / "vllm-0.log"
    with t.kill_server_after(out, log, step=1) as killed:
        train(cfg, quiet=True)
    assert killed.get("pid"), "the server was not killed"

    t.check_restarted_run(out, "vllm", steps)

    # One adapter load per weight sync (the initial one and one per step) in directories
    # of their own, and the current one again on the restarted server.
    text = log.read_text()
    assert "restarted by areal-agents" in text
    loads = t.adapter_loads(text)
    assert len(set(loads)) == steps + 1 and len(loads) == steps + 2, loads
    before, after = text.split("restarted by areal-agents", 1)
    assert t.adapter_loads(after)[0] == t.adapter_loads(before)[-1]

    # Every token's version is the label vLLM reported for it.
    sessions = t.check_store(out, steps)
    matched = 0
    for session in sessions.values():
        for c in session.episode.completions:
            reported = labels.get(tuple(c.output_ids))
            if reported is not None:
                assert reported == list(c.output_versions)
                matched += 1
    assert matched >= steps * 8 // 2, matched  # the rest were interrupted and resumed
    assert all(v is not None for vs in labels.values() for v in vs)


def test_an_attached_vllm_server_and_the_mismatch_of_a_skipped_weight_sync(
    tiny_model_dir: Path,
    vllm_service: Any,
    parity_env: str,
    training_checks: Any,
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    """Synchronous steps (every token sampled by the trainer's current weights): the
    mismatch stays under the bound until a weight sync is skipped (the server is labelled
    with the new version but keeps the old adapter), and the step after it is over."""
    t, real = training_checks, vllm_engine.VLLMEngine._load_lora

    async def skip_version_2(self: Any, path: str, version: int) -> None:
        if version == 2:
            await self._set_label(version)  # claims version 2, keeps version 1's adapter
            return
        await real(self, path, version)

    monkeypatch.setattr(vllm_engine.VLLMEngine, "_load_lora", skip_version_2)
    out = tmp_path / "run"
    cfg = t.short_run(
        tiny_model_dir,
        out,
        {"backend": "vllm", "urls": [vllm_service.url]},
        rollout={"max_head_offpolicyness": 0},
        optim={"lr": 5e-2},
    )
    train(cfg, quiet=True)
    rows = t.metrics(out)
    kl = [r.get("mismatch/kl") for r in rows]
    assert all(r["mismatch/fresh_share"] == 1.0 for r in rows), rows
    assert kl[0] < t.MISMATCH_BOUND and kl[1] < t.MISMATCH_BOUND, kl
    assert kl[2] > t.MISMATCH_BOUND, kl
    t.check_store(out, 3)
