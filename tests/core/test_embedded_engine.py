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

from areal_agents.engines.embedded import EmbeddedEngine
from areal_agents.engines.protocol import SamplingParams, WeightUpdate


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
        c = await eng.generate(second, greedy)  # reuses the whole first prompt and output
        stats = await eng.health()
        assert hits0 == 0
        # call 2: the 60 shared tokens; call 3: the first call's prompt and output but its
        # last sampled token (never fed back: the call finished on it), stored when it finished
        assert stats["prefix_hit_tokens"] == 60 + len(first) + len(a.output_ids) - 1
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
        from areal_agents.engines.protocol import WeightUpdate

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
    from areal_agents.engines.kv_cache import batch_layer_class

    gen = torch.Generator().manual_seed(0)

    def kv(n: int, rows: int = 1) -> torch.Tensor:
        return torch.randn(rows, 2, n, 3, generator=gen)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        width = max(r.shape[1] for r in rows)
        return torch.stack([torch.cat([torch.zeros(2, width - r.shape[1], 3), r], 1) for r in rows])

    first = kv(5)
    layer = batch_layer_class()(first, first + 1)
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
    from areal_agents.engines.sampling import _sample_rows, _truncate

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


def _one_layer_llama(vocab: int, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


def test_sliced_output_projection_equals_the_plain_one():
    """On CPU the engine computes the vocabulary projection in slices of its weight's rows:
    the same logits as one matmul, the weight (tied to the embeddings here) and the state
    dict untouched, so weight updates still reach it."""
    from areal_agents.engines.attention import _LOGIT_SLICE, slice_output_projection

    torch.manual_seed(0)
    vocab = 4 * _LOGIT_SLICE + 77  # a last slice shorter than the others
    model = _one_layer_llama(vocab, tie=True)
    ids = torch.randint(0, vocab, (3, 7))
    with torch.no_grad():
        plain = model(ids).logits
        keys = set(model.state_dict())
        slice_output_projection(model)
        head = model.get_output_embeddings()
        assert "forward" in vars(head)  # the instance's forward was replaced
        sliced = model(ids).logits
        assert set(model.state_dict()) == keys
        assert head.weight is model.get_input_embeddings().weight
        torch.testing.assert_close(sliced, plain, rtol=1e-5, atol=1e-5)
        head.weight.mul_(2.0)  # an in-place update (as a weight sync does) is seen
        hidden = model.model(ids).last_hidden_state
        expected = torch.nn.functional.linear(hidden, head.weight)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(expected, plain)


def test_small_vocabularies_keep_the_plain_projection():
    from areal_agents.engines.attention import slice_output_projection

    model = _one_layer_llama(256, tie=False)
    slice_output_projection(model)
    assert "forward" not in vars(model.get_output_embeddings())


def test_cascade_attention_equals_attention_over_the_whole_row():
    """Decode-step attention split into a shared prefix (read once for all rows) and each
    row's own tokens (left-padded, after its own copy of the prefix) equals plain attention
    over the row's real tokens, with grouped-query heads."""
    from types import SimpleNamespace

    from areal_agents.engines import attention as E

    torch.manual_seed(0)
    rows, heads, kv_heads, dim, n = 3, 6, 2, 8, 5
    own = [4, 1, 7]  # each row's own cached tokens, the current one included
    width = n + max(own)
    shared_k, shared_v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    key = torch.zeros(rows, kv_heads, width, dim)
    value = torch.zeros(rows, kv_heads, width, dim)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, m in enumerate(own):
        pad = width - n - m
        key[r, :, pad : pad + n], value[r, :, pad : pad + n] = shared_k[0], shared_v[0]
        key[r, :, pad + n :] = torch.randn(kv_heads, m, dim)
        value[r, :, pad + n :] = torch.randn(kv_heads, m, dim)
        key[r, :, :pad] = 99.0  # padding: never read
        mask[r, pad:] = 1
    query = torch.randn(rows, heads, 1, dim)
    padcols = width - mask.sum(1, keepdim=True)
    cols = torch.arange(n, width).unsqueeze(0)
    bias = torch.zeros(rows, width - n).masked_fill(cols < padcols + n, float("-inf"))
    E._PLAN.value = E._CascadePlan(n, [(shared_k, shared_v)], bias)
    try:
        module = SimpleNamespace(layer_idx=0, num_key_value_groups=heads // kv_heads)
        out, _ = E._cascade_attention(module, query, key, value, None, scaling=0.3)
    finally:
        E._PLAN.value = None
    assert out.shape == (rows, 1, heads, dim)
    for r in range(rows):
        real = mask[r].bool()
        k = key[r][:, real].repeat_interleave(heads // kv_heads, 0)  # [heads, L, dim]
        v = value[r][:, real].repeat_interleave(heads // kv_heads, 0)
        p = torch.softmax(query[r] @ k.transpose(-1, -2) * 0.3, -1)  # [heads, 1, L]
        torch.testing.assert_close(out[r, 0], (p @ v)[:, 0], rtol=1e-5, atol=1e-5)


async def test_rows_sharing_a_prefix_decode_exactly_with_cascade_attention(
    tiny_model_dir, hf_model
):
    """Rows that share a long prompt prefix (a system prompt) attend to it as one block;
    greedy outputs and logprobs still equal plain transformers, also after a row with a
    shorter shared prefix joins the running batch."""
    system = list(range(200, 260))  # 60 shared tokens
    prompts = [[*system, *range(20, 20 + m)] for m in (1, 6, 13)]
    eng = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", max_batch_size=8)
    try:
        assert eng.model.config._attn_implementation == "areal_cascade"
        tasks = [
            asyncio.create_task(eng.generate(p, SamplingParams(temperature=0, max_new_tokens=12)))
            for p in prompts
        ]
        while (await eng.health())["output_tokens"] < 6:
            await asyncio.sleep(0.005)
        late = [*system[:30], *range(600, 610)]  # shares 30 tokens with the others
        late_res = await eng.generate(late, SamplingParams(temperature=0, max_new_tokens=5))
        results = await asyncio.gather(*tasks)
        stats = await eng.health()
        assert stats["cascade_steps"] > 0
        for prompt, res in zip([*prompts, late], [*results, late_res], strict=True):
            assert_greedy_matches_hf(hf_model, prompt, res, len(res.output_ids))
    finally:
        await eng.close()


async def test_kept_caches_decode_on_through_a_weight_update(tiny_model_dir, hf_model):
    """``kv_on_update="keep"``: a request in flight is not re-prefilled. Its tokens after the
    update carry the new version and are the new weights' greedy continuation *over the old
    weights' keys and values* of everything before the last token sampled before the update
    (that token is fed by the first decode step after it), with those logprobs."""
    gen = torch.Generator().manual_seed(3)
    new_weights, seen = {}, {}
    for k, v in hf_model.state_dict().items():  # tied tensors stay tied
        if v.data_ptr() not in seen:
            seen[v.data_ptr()] = v + 0.5 * torch.randn(v.shape, generator=gen)
        new_weights[k] = seen[v.data_ptr()]
    new_model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    new_model.load_state_dict(new_weights)
    eng = EmbeddedEngine.from_pretrained(
        tiny_model_dir, dtype="float32", max_batch_size=4, kv_on_update="keep"
    )
    prompt = [5, 17, 42, 7, 99, 3] * 4  # long enough for the batch's shared-prefix attention
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=40)
        task = asyncio.create_task(eng.generate(prompt, greedy))
        while (await eng.health())["output_tokens"] < 4:  # some tokens before the update
            await asyncio.sleep(0.001)
        await eng.pause()
        prefills = (await eng.health())["prefills"]
        v1 = await eng.update_weights(WeightUpdate(state_dict=new_weights, version=7))
        await eng.resume()
        # Joining the kept row, and the kept conversation's next turn: both the new weights'
        # own continuations, never reading the old weights' keys and values.
        joined = await eng.generate(prompt, greedy.replace(max_new_tokens=8))
        res = await task
        turn = prompt + res.output_ids + [11, 12]
        after = await eng.generate(turn, greedy.replace(max_new_tokens=8))
        health = await eng.health()
    finally:
        await eng.close()
    # no re-prefill: the only prefills after the update are the two new requests'
    assert res.interruptions == 0 and health["prefills"] == prefills + 2
    assert health["kept_on_update"] == 1
    switch = res.output_versions.index(v1)
    assert 0 < switch < len(res.output_ids) - 8
    assert res.output_versions == [0] * switch + [v1] * (len(res.output_ids) - switch)
    out = res.output_ids
    with torch.no_grad():
        past = hf_model(torch.tensor([prompt + out[: switch - 1]])).past_key_values
        token, tail, logprobs = out[switch - 1], [], []
        for _ in range(8):
            step = new_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = step.past_key_values, step.logits[0, -1].float()
            token = int(logits.argmax())
            tail.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    assert out[switch : switch + 8] == tail
    assert res.output_logprobs[switch : switch + 8] == pytest.approx(logprobs, abs=1e-4)
    assert_greedy_matches_hf(new_model, prompt, joined, 8)
    assert_greedy_matches_hf(new_model, turn, after, 8)


async def test_cpu_time_spans_count_only_the_cpu_the_engine_got(tiny_model_dir):
    """An engine at the idle priority shares its cores: with ``cpu_time_spans`` a compute
    span lasts only as long as the CPU time the process spent in it. A step that sleeps
    (another process had the core) leaves next to nothing; one that computes keeps about
    its wall time (per torch thread: this loop used one of them); without the flag the
    sleep counts in full. Then real decode steps
    record spans on lane ``engine``."""
    import time

    from areal_agents import spans

    rec = spans.record_to(None)
    eng = EmbeddedEngine.from_pretrained(
        tiny_model_dir, dtype="float32", max_batch_size=4, cpu_time_spans=True
    )
    try:

        def engine_spans() -> list[tuple[str, str, float, float]]:
            return [s for s in rec.window(0.0, time.perf_counter() + 1) if s[0] == "engine"]

        def lengths() -> list[float]:
            return [b - a for _, _, a, b in engine_spans()]

        with eng._timed("decode"):
            time.sleep(0.2)
        t_end = time.perf_counter() + 0.2
        with eng._timed("decode"):
            while time.perf_counter() < t_end:
                sum(i * i for i in range(1000))
        got = lengths()  # a span of no CPU time at all is not recorded
        slept, computed = got if len(got) == 2 else (0.0, got[0])
        n = torch.get_num_threads()  # the CPU time is shared out over the engine's threads
        assert slept < 0.05 and 0.15 / n < computed <= 0.2 / n + 1e-3
        eng.cpu_time_spans = False
        with eng._timed("decode"):
            time.sleep(0.2)
        assert lengths()[-1] >= 0.2
        eng.cpu_time_spans = True
        await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))
        names = [n for _, n, _, _ in engine_spans()]
        assert "prefill" in names and "decode" in names[3:]
    finally:
        await eng.close()
        spans.stop()
