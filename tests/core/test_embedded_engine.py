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


def assert_greedy_matches_hf(model, prompt, res, max_new_tokens):
    """``res`` is plain transformers' greedy continuation of ``prompt``, with its logprobs."""
    ref = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert res.output_ids == ref
    lp = recompute_logprobs(model, prompt, res.output_ids)
    assert torch.allclose(lp, torch.tensor(res.output_logprobs), atol=1e-4)


async def test_greedy_batched_matches_hf_generate_and_logprobs(engine, hf_model):
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 1, 40)]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    results = await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        assert_greedy_matches_hf(hf_model, prompt, res, 10)
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


async def test_waiting_requests_are_prefilled_together_exactly(tiny_model_dir, hf_model):
    """Requests waiting at once are prefilled in chunks of one forward pass each, rows with
    and without cached prefixes mixed (left-padded cache, right-padded new tokens); a request
    whose prefix an earlier one of the round computes waits a round and reuses it whole.
    Greedy outputs and logprobs equal plain transformers."""
    system = list(range(200, 260))  # 60 tokens, cached before the round
    group = list(range(500, 550))  # two identical 50-token prompts, nothing cached
    prompts = [
        [*system, *range(20, 29)],  # 8 new tokens to prefill (the last is decoded)
        [*system, *range(30, 40)],  # 9
        [*system, *range(40, 51)],  # 10
        list(range(300, 311)),  # 10, nothing cached
        group,  # 49, nothing cached
        [*system, *range(400, 480)],  # 79
        list(group),  # waits for the first copy: all cached
    ]
    eng = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", max_batch_size=8)
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    try:
        await eng.generate([*system, 7], greedy)
        before = await eng.health()
        await eng.pause()
        tasks = [asyncio.create_task(eng.generate(p, greedy)) for p in prompts]
        await asyncio.sleep(0.2)  # all are waiting
        await eng.resume()
        results = await asyncio.gather(*tasks)
        after = await eng.health()
        delta = {k: after[k] - before[k] for k in ("prefills", "prefill_batches")}
        # chunks [8, 9, 10, 10] and [49, 79]; the second copy of the group prompt needs none
        assert delta == {"prefills": 6, "prefill_batches": 2}
        assert after["prefix_full_hits"] - before["prefix_full_hits"] == 1
        for prompt, res in zip(prompts, results, strict=True):
            assert_greedy_matches_hf(hf_model, prompt, res, 5)
    finally:
        await eng.close()


async def test_prefix_cache_reuses_shared_prompts_exactly(tiny_model_dir, hf_model):
    """Prompts sharing a system prefix, and a second turn extending the first, prefill only
    their new tokens; outputs and logprobs equal a fresh forward pass; a weight update
    clears the cache (nothing computed by old weights is reused)."""
    system = list(range(200, 260))  # 60 shared tokens
    first, other = [*system, 11, 12, 13], [*system, 21, 22]
    eng = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", max_batch_size=8)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    try:
        a = await eng.generate(first, greedy)
        hits0 = (await eng.health())["prefix_hit_tokens"]
        b = await eng.generate(other, greedy)  # reuses the 60 shared tokens
        second = [*first, *a.output_ids, 31, 32]
        c = await eng.generate(second, greedy)  # reuses the whole first prompt (+ output)
        stats = await eng.health()
        assert hits0 == 0
        # call 2: the 60 shared tokens; call 3: the first call's prefill (its prompt but the
        # pending last token)
        assert stats["prefix_hit_tokens"] == 60 + len(first) - 1
        for prompt, res in ((first, a), (other, b), (second, c)):
            assert_greedy_matches_hf(hf_model, prompt, res, 6)
        # The same prompt again (a group's episodes): its prefill is all cached, no forward.
        prefills = stats["prefills"]
        again = await eng.generate(first, greedy)
        stats = await eng.health()
        assert (stats["prefills"], stats["prefix_full_hits"]) == (prefills, 1)
        assert again.output_ids == a.output_ids
        assert torch.allclose(
            torch.tensor(again.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5
        )
        state = {k: v.clone() for k, v in hf_model.state_dict().items()}
        state["model.norm.weight"] = state["model.norm.weight"] * 1.5
        from areal_agents.engine import WeightUpdate

        await eng.update_weights(WeightUpdate(state_dict=state))
        before = (await eng.health())["prefix_hit_tokens"]
        d = await eng.generate(first, greedy)
        assert (await eng.health())["prefix_hit_tokens"] == before  # cleared by the update
        changed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        changed.load_state_dict(state)
        lp = recompute_logprobs(changed.eval(), first, d.output_ids)
        assert torch.allclose(lp, torch.tensor(d.output_logprobs), atol=1e-4)
    finally:
        await eng.close()


def test_batch_kv_layer_matches_left_padded_concatenation():
    """The batch cache's in-place buffers hold exactly what concatenating left-padded rows
    would: through joins of shorter and longer rows, decode steps, retirements that move the
    last row into the hole, and trimming of all-padding columns (buffers regrow as needed)."""
    from areal_agents.embedded import _batch_layer_class

    gen = torch.Generator().manual_seed(0)

    def kv(n: int, rows: int = 1) -> torch.Tensor:
        return torch.randn(rows, 2, n, 3, generator=gen)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        width = max(r.shape[1] for r in rows)
        return torch.stack([torch.cat([torch.zeros(2, width - r.shape[1], 3), r], 1) for r in rows])

    first = kv(5)
    layer = _batch_layer_class()(first, first + 1)
    ref = [first[0]]  # per row: [H, L, D] (values are keys + 1 throughout)

    def check() -> None:
        assert torch.equal(layer.keys, padded(ref))
        assert torch.equal(layer.values, padded([r + 1 for r in ref]))  # padding stays 0

    check()
    for n in (3, 9, 0, 200, 4):  # shorter, wider, empty, much wider (regrow left), ...
        row = kv(n)
        layer.add_row(row, row + 1)
        ref.append(row[0])
        check()
    for _ in range(3):  # decode steps (regrow right after a while)
        step = kv(1, rows=len(ref))
        out_k, out_v = layer.update(step, step + 1)
        ref = [torch.cat([r, step[i]], 1) for i, r in enumerate(ref)]
        check()
        assert torch.equal(out_k, layer.keys) and torch.equal(out_v, layer.values)
    for _ in range(80):  # grow past the right room
        step = kv(1, rows=len(ref))
        layer.update(step, step + 1)
        ref = [torch.cat([r, step[i]], 1) for i, r in enumerate(ref)]
    check()
    # retire rows 1 and 4 of 6 (row 4 holds the 200-token row): rows 0, 2, 3, 5 stay; the
    # last kept row (5) moves into hole 1; columns left of the widest remaining row go
    keep = [0, 2, 3, 5]
    order = [0, 5, 2, 3]
    width = max(ref[i].shape[1] for i in keep)
    trim = layer.keys.shape[2] - width
    layer.compact(4, [(1, 5)], trim)
    ref = [ref[i] for i in order]
    check()
    for n in (7, 300):  # joins after a compaction, the second needing more room on the left
        row = kv(n)
        layer.add_row(row, row + 1)
        ref.append(row[0])
        check()


def test_inverse_cdf_sampling_hand_computed_and_distribution():
    from areal_agents.embedded import _sample_rows, _truncate

    # P = (0.1, 0.2, 0, 0.7): C = (0.1, 0.3, 0.3, 1.0); u picks the first i with u < C[i]
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    scores = probs.log().expand(6, 4)
    uniforms = torch.tensor([0.0, 0.05, 0.1, 0.29, 0.31, 0.999])
    assert _sample_rows(scores, uniforms) == [0, 0, 1, 1, 3, 3]
    # truncation: top_k=2 keeps tokens 3 and 1 (0.7, 0.2), renormalized to 2/9, 7/9
    kept = _truncate(probs.log(), SamplingParams(temperature=1.0, top_k=2))
    assert _sample_rows(kept.expand(2, 4), torch.tensor([0.2, 0.25])) == [1, 3]
    # frequencies over many draws match the probabilities (4 sigma of a binomial)
    n = 200_000
    logits = torch.tensor([2.0, 0.5, -1.0, 1.5, -30.0])
    target = torch.softmax(logits, -1)
    drawn = _sample_rows(
        torch.log_softmax(logits, -1).expand(n, 5),
        torch.rand(n, generator=torch.Generator().manual_seed(0)),
    )
    freq = torch.bincount(torch.tensor(drawn), minlength=5).double() / n
    sigma = (target.double() * (1 - target.double()) / n).sqrt()
    assert torch.all((freq - target.double()).abs() <= 4 * sigma + 1e-9)
