"""The supervised warm start: assistant-only masks and a loss that goes down."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_agents.envs.math import CalculatorEnv, demos
from areal_agents.errors import ConfigError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.sft import load_demos, run_sft, sft_sample


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def test_mask_covers_exactly_the_assistant_turns(tok):
    env = CalculatorEnv(kind="arithmetic")
    _, info = env.reset(seed=0)
    convo = demos(1, seed=0, kind="arithmetic")[0]
    ids, mask, skipped = sft_sample(tok, convo, info["tools"])
    assert skipped == 0
    assert ids == tok.encode_chat(convo, tools=info["tools"], add_generation_prompt=False)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    call = convo[2]["tool_calls"][0]["function"]["arguments"]
    assert call in trained and convo[4]["content"] in trained
    assert trained.count("<|im_end|>") == 2  # each assistant turn ends with its eos
    assert "Compute" not in trained and convo[3]["content"] + "\n" not in trained


def test_warm_start_lowers_the_loss(tok, tiny_model_dir):
    policy = Policy(str(tiny_model_dir), dtype="float32", lr=1e-3)
    data = demos(4, seed=1, kind="arithmetic")
    tools = CalculatorEnv(kind="arithmetic").reset(seed=0)[1]["tools"]
    first = run_sft(policy, tok, data, tools, epochs=1, lr=3e-3, batch_size=8)
    later = run_sft(policy, tok, data, tools, epochs=2, lr=3e-3, batch_size=8)
    assert later["sft_nll"] < first["sft_nll"]
    assert first["sft_demos"] == 4 and first["sft_skipped_turns"] == 0


def test_demo_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\nnot json\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: not valid JSON"):
        load_demos(bad)
    with pytest.raises(ConfigError, match="areal-agent demos"):
        load_demos(tmp_path / "missing.jsonl")


def test_sft_config_needs_demos_or_generate():
    from areal_agents.trainer.config_io import load_config

    with pytest.raises(ConfigError, match=r"sft\.demos.*sft\.generate"):
        load_config(None, ["env.id=areal/Calculator-v0", "sft.enabled=true"])
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "sft.enabled=true",
            "sft.generate=16",
            "sft.generate_kwargs={kind: arithmetic}",
        ],
    )
    assert cfg.sft.generate == 16 and cfg.sft.generate_kwargs == {"kind": "arithmetic"}


@pytest.mark.slow
def test_generated_warm_start_is_checkpointed_as_step_0_and_not_redone(tiny_model_dir, tmp_path):
    """sft.generate writes the env's demos into the run, the warm-started weights are saved
    as checkpoint step 0 with the elapsed time, and a resumed run does not warm-start again."""
    import asyncio
    import json

    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import Trainer

    class Counting(Trainer):
        warm_starts = 0

        def _warm_start(self):
            Counting.warm_starts += 1
            super()._warm_start()

    out = tmp_path / "run"
    overrides = [
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.lora.enabled=true",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "sampling.max_new_tokens=8",
        "sft.enabled=true",
        "sft.generate=8",
        "sft.generate_kwargs={kind: arithmetic}",
        "sft.lr=1e-3",
        "sft.batch_size=3",
        "train.save_every=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
    ]
    asyncio.run(Counting(load_config(None, [*overrides, "train.steps=1"]), quiet=True).run())
    lines = (out / "sft_demos.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(
        json.loads(x)["messages"][-1]["role"] == "assistant" for x in lines
    )
    step0 = out / "checkpoints" / "step-000000"
    assert (step0 / "model" / "adapter_config.json").exists()
    state0 = json.loads((step0 / "state.json").read_text())
    assert state0["step"] == 0 and state0["elapsed_s"] > 0
    state1 = json.loads((out / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state1["elapsed_s"] > state0["elapsed_s"]
    assert Counting.warm_starts == 1
    assert json.loads((out / "sft.json").read_text())["sft_steps"] == 3  # ceil(8 / 3)
    asyncio.run(
        Counting(load_config(None, [*overrides, "train.steps=2"]), resume=True, quiet=True).run()
    )
    assert Counting.warm_starts == 1  # resumed from step 1: no second warm start
