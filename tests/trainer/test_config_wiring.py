"""Config keys that reach what they configure: ``model.max_context`` (engine and proxy),
``sft.kind: episodes`` (the warm start on recorded samples) and env settings that fail a
run before its first episode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.trainer.config_io import load_config


def _overrides(tiny_model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "sampling.max_new_tokens=8",
        "train.steps=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
        *extra,
    ]


def test_max_context_reaches_the_engine_and_the_proxy_refuses_longer_prompts(
    tiny_model_dir, tmp_path
):
    from areal_agents.serve.api_error import ApiError
    from areal_agents.trainer.loop import Trainer

    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path / "run", "model.max_context=64"))
    trainer = Trainer(cfg, quiet=True)
    trainer._build()
    proxy = trainer.source.runner.proxy
    assert trainer.engine.max_context == 64 and proxy.max_context == 64

    async def call() -> None:
        session = proxy.sessions.create()
        try:
            long = [{"role": "user", "content": "word " * 80}]  # > 64 tokens
            with pytest.raises(ApiError) as err:
                await proxy.complete(session, {"model": proxy.model_name, "messages": long})
            assert err.value.status == 400 and err.value.code == "context_length_exceeded"
            short = [{"role": "user", "content": "Hi"}]
            body = {"model": proxy.model_name, "messages": short, "max_tokens": 2}
            reply = await proxy.complete(session, body)
            assert reply["choices"][0]["message"]["role"] == "assistant"
        finally:
            await trainer.engine.close()

    asyncio.run(call())


def _episode_row(ids: list[int], mask: list[int], **result) -> str:
    return json.dumps({"samples": [{"input_ids": ids, "loss_mask": mask}], "result": result})


def test_episode_samples_skip_failures_and_check_the_vocabulary(tmp_path):
    from areal_agents.trainer.sft import load_episode_samples

    path = tmp_path / "episodes.jsonl"
    path.write_text(
        _episode_row([1, 2, 3], [0, 1, 1], success=True, error=None)
        + "\n"
        + _episode_row([4, 5], [0, 1], success=False, error=None)
        + "\n"
        + _episode_row([6, 7], [0, 1], success=None, error="env.step raised ...")
        + "\n"
        + _episode_row([8, 9], [0, 1], success=None, error=None)
        + "\n"
    )
    pairs, skipped = load_episode_samples(path, vocab_size=10)
    assert pairs == [([1, 2, 3], [0, 1, 1]), ([8, 9], [0, 1])] and skipped == 2
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        load_episode_samples(path, vocab_size=5)
    (tmp_path / "demo.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"sft\.kind=messages"):
        load_episode_samples(tmp_path / "demo.jsonl")


def test_sft_kind_episodes_trains_only_the_sampled_tokens(tiny_model_dir, tmp_path):
    """One episode, one batch: the warm start's NLL is -(1/N) sum of the logprobs of the
    N tokens with loss_mask 1, under the weights before the step (computed here by hand
    from the policy's own logprobs)."""
    from areal_agents.trainer.loop import Trainer

    ids = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198, 13048, 0, 151645]
    mask = [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    path = tmp_path / "episodes.jsonl"
    path.write_text(_episode_row(ids, mask, success=True, error=None) + "\n")
    extra = ("sft.enabled=true", "sft.kind=episodes", f"sft.demos={path}", "sft.lr=1e-3")
    trainer = Trainer(load_config(None, _overrides(tiny_model_dir, tmp_path / "r", *extra)))
    trainer._build()
    try:
        (lp,) = trainer.policy.logprobs([ids], 1.0)
        weights = torch.tensor(mask[1:], dtype=torch.float32)
        by_hand = float(-(lp * weights).sum() / weights.sum())
        before = {k: v.clone() for k, v in trainer.policy.model.named_parameters()}
        trainer._warm_start()
    finally:
        asyncio.run(trainer.engine.close())
    stats = json.loads((tmp_path / "r" / "sft.json").read_text())
    assert stats["sft_demos"] == 1 and stats["sft_skipped_episodes"] == 0
    assert stats["sft_nll"] == pytest.approx(by_hand, rel=1e-4)
    after = dict(trainer.policy.model.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.policy.lr == pytest.approx(1e-6)  # reset to optim.lr for RL


def test_sft_generate_needs_kind_messages():
    with pytest.raises(ConfigError, match=r"sft\.kind"):
        load_config(None, ["env.id=x", "sft.enabled=true", "sft.generate=4", "sft.kind=episodes"])


def test_a_tau2_user_model_without_its_endpoint_fails_before_any_episode_with_the_fix(
    tiny_model_dir, tmp_path
):
    """Without a user the run's own model plays tau2's customer (tests/trainer/
    test_tau2_train.py); a user_model without user_base_url is a config error."""
    from areal_agents.trainer.loop import Trainer

    cfg = load_config(
        None,
        [
            "env.id=areal/Tau2Retail-v0",
            "env.kwargs={user_model: my-model}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "train.steps=1",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    with pytest.raises(ConfigError) as err:
        asyncio.run(trainer.run())
    message = str(err.value)
    assert "env areal/Tau2Retail-v0 (env.kwargs)" in message
    assert "user_base_url" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_env_kwargs_fail_the_run_with_the_message(tiny_model_dir, tmp_path):
    from areal_agents.trainer.loop import Trainer

    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "env.kwargs={no_such_option: 1}",
            f"model.path={tiny_model_dir}",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(ConfigError, match="no_such_option"):
        asyncio.run(Trainer(cfg, quiet=True).run())
