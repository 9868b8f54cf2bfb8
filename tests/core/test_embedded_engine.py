"""The embedded engine against plain transformers on a seeded tiny Qwen3."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_agents.embedded import EmbeddedEngine
from areal_agents.engine import SamplingParams, WeightUpdate


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
async def engine(tiny_model_dir: Path):
    eng = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", max_batch_size=8)
    yield eng
    await eng.close()


def recompute_logprobs(model, prompt, output, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(scaled, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


async def test_greedy_batched_matches_hf_generate_and_logprobs(engine, hf_model):
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 1, 40)]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    results = await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        ref = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert res.output_ids == ref
        lp = recompute_logprobs(hf_model, prompt, res.output_ids)
        assert torch.allclose(lp, torch.tensor(res.output_logprobs), atol=1e-4)
        assert res.output_versions == [0] * 10
        assert res.finish_reason == "length"


async def test_sampled_logprobs_are_temperature_scaled_and_seed_reproducible(engine, hf_model):
    prompt = list(range(300, 320))
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=3, max_new_tokens=12)
    a, b = await asyncio.gather(engine.generate(prompt, params), engine.generate(prompt, params))
    assert a.output_ids == b.output_ids
    lp = recompute_logprobs(hf_model, prompt, a.output_ids, temperature=0.7)
    assert torch.allclose(lp, torch.tensor(a.output_logprobs), atol=1e-4)


async def test_late_request_joins_running_batch(engine):
    long = asyncio.create_task(
        engine.generate([5] * 10, SamplingParams(temperature=0, max_new_tokens=60))
    )
    while (await engine.health())["output_tokens"] < 5:
        await asyncio.sleep(0.005)
    short = await engine.generate([7] * 10, SamplingParams(temperature=0, max_new_tokens=4))
    assert not long.done(), "the short request waited for the long batch to finish"
    assert len(short.output_ids) == 4
    assert len((await long).output_ids) == 60
    # Both rows shared decode steps: fewer steps than tokens generated.
    h = await engine.health()
    assert h["decode_steps"] < h["output_tokens"]


async def test_stop_token_and_stop_string(engine, hf_model):
    prompt = list(range(50, 60))
    free = await engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    stop_tok = free.output_ids[3]
    res = await engine.generate(
        prompt, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop_tok,))
    )
    first = free.output_ids.index(stop_tok)
    assert res.output_ids == free.output_ids[: first + 1]
    assert res.finish_reason == "stop" and res.stop_reason == stop_tok
    engine._decode = lambda ids: "".join(f"<{i}>" for i in ids)
    marker = f"<{free.output_ids[2]}>"
    res = await engine.generate(
        prompt, SamplingParams(temperature=0, max_new_tokens=8, stop=(marker,))
    )
    assert res.stop_reason == marker
    assert res.output_ids == free.output_ids[: free.output_ids.index(free.output_ids[2]) + 1]


async def test_weight_update_interrupts_and_tags_new_version(engine, hf_model):
    prompt = list(range(400, 420))
    params = SamplingParams(temperature=0, max_new_tokens=40)
    task = asyncio.create_task(engine.generate(prompt, params))
    while (await engine.health())["output_tokens"] < 5:
        await asyncio.sleep(0.002)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf_model.state_dict().items()}
    version = await engine.update_weights(WeightUpdate(state_dict=new_state))
    res = await task
    assert version == 1 and engine.version == 1
    assert res.interruptions == 1
    switch = res.output_versions.index(1)
    assert 0 < switch < 40
    assert res.output_versions == [0] * switch + [1] * (40 - switch)
    # Tokens after the switch are the new model's greedy continuation of prompt + prefix.
    new_model = AutoModelForCausalLM.from_config(hf_model.config).eval()
    new_model.load_state_dict(new_state)
    prefix = prompt + res.output_ids[:switch]
    ref = new_model.generate(
        torch.tensor([prefix]),
        max_new_tokens=40 - switch,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert res.output_ids[switch:] == ref[0, len(prefix) :].tolist()


async def test_lora_update_changes_output_and_bumps_version(engine):
    from peft import LoraConfig

    prompt = list(range(10, 30))
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = await engine.generate(prompt, greedy)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    # A LoRA state dict with large B weights so the output must change.
    from peft import get_peft_model, get_peft_model_state_dict

    probe = get_peft_model(AutoModelForCausalLM.from_config(engine.model.config), cfg)
    sd = {k: torch.randn_like(v) * 2 for k, v in get_peft_model_state_dict(probe).items()}
    version = await engine.update_weights(
        WeightUpdate(kind="lora", state_dict=sd, lora_config=cfg, version=7)
    )
    after = await engine.generate(prompt, greedy)
    assert version == 7 and after.output_versions == [7] * 8
    assert after.output_ids != before.output_ids


async def test_pause_holds_requests_until_resume(engine):
    await engine.pause()
    task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3)))
    await asyncio.sleep(0.2)
    assert not task.done()
    assert (await engine.health())["status"] == "paused"
    await engine.resume()
    assert len((await task).output_ids) == 3


async def test_bad_input_is_rejected_clearly(engine):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        await engine.generate([], SamplingParams())
    from areal_agents.errors import ContextOverflow, UserError

    with pytest.raises(ContextOverflow, match="context is 4096"):
        await engine.generate([1] * 5000, SamplingParams())
    with pytest.raises(UserError, match="missing keys"):
        await engine.update_weights(WeightUpdate(state_dict={"nope": torch.zeros(1)}))
    assert (await engine.health())["status"] == "ok"
