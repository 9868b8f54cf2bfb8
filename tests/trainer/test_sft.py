"""The supervised warm start: assistant-only masks and a loss that goes down."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_agents.chat import ChatTokenizer
from areal_agents.errors import ConfigError
from envs.math import CalculatorEnv, demos
from trainer.policy import Policy
from trainer.sft import load_demos, run_sft, sft_sample


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
