"""The embedded engine against plain transformers on a seeded tiny Qwen3: what is particular
to it (batched decoding equals one-at-a-time generation, late requests join a running
batch). What every engine must do (stop ids and strings, versions and weight updates that
interrupt requests in flight, LoRA, pause, bad input) is tests/engines/test_conformance.py,
which runs on this engine too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_agents.embedded import EmbeddedEngine
from areal_agents.engine import SamplingParams


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
