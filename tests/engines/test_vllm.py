"""vLLM behind the proxy, and a vLLM server without its development endpoints.

The session's server is started by ``areal-agent serve --backend vllm --model DIR`` (see
conftest.py); the conformance suite covers the engine itself.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.engines.protocol import SamplingParams, WeightUpdate
from areal_agents.engines.vllm import VLLMEngine
from areal_agents.errors import UserError

pytestmark = pytest.mark.vllm


def test_serve_backend_vllm_answers_the_openai_client_with_vllm_token_ids(
    vllm_service: Any, tokenizer: Any
) -> None:
    from openai import OpenAI

    made = httpx.post(f"{vllm_service.proxy_url}/sessions", json={}).json()
    client = OpenAI(base_url=made["base_url"], api_key=made["api_key"])
    reply = client.chat.completions.create(
        model="ignored",
        messages=[{"role": "user", "content": "Name three colours."}],
        temperature=0,
        max_tokens=16,
        logprobs=True,
    )
    text = reply.choices[0].message.content or ""
    traj = httpx.get(
        f"{vllm_service.proxy_url}/sessions/{made['id']}/trajectory",
        headers={"Authorization": f"Bearer {made['api_key']}"},
    ).json()
    (comp,) = traj["completions"]
    assert comp["prompt_ids"] == tokenizer.encode_chat(
        [{"role": "user", "content": "Name three colours."}]
    )
    # vLLM itself, asked with the recorded prompt ids, reports the recorded output ids.
    direct = httpx.post(
        f"{vllm_service.url}/inference/v1/generate",
        json={
            "token_ids": comp["prompt_ids"],
            "sampling_params": {
                "temperature": 0,
                "max_tokens": 16,
                "logprobs": 0,
                "stop_token_ids": tokenizer.eos_token_ids,
                "skip_special_tokens": False,
            },
        },
        timeout=120,
    ).json()["choices"][0]
    assert comp["output_ids"] == direct["token_ids"]
    vllm_logprobs = [c["logprob"] for c in direct["logprobs"]["content"]]
    assert comp["output_logprobs"] == pytest.approx(vllm_logprobs, abs=1e-4)
    assert len(comp["output_versions"]) == len(comp["output_ids"])
    content_ids = comp["output_ids"]
    if comp["finish_reason"] == "stop":
        content_ids = content_ids[:-1]
    assert tokenizer.decode(content_ids) == text
    assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(
        comp["output_logprobs"][: len(content_ids)]
    )
    health = httpx.get(f"{vllm_service.proxy_url}/health").json()
    assert health["engine"]["backend"] == "vllm" and health["engine"]["status"] == "ok"


@pytest.fixture
async def no_dev_engine(vllm_service: Any, model_dir: Path, tokenizer: Any) -> Any:
    """An engine that treats the server as one started without VLLM_SERVER_DEV_MODE."""
    probe = await asyncio.to_thread(VLLMEngine.connect, vllm_service.url, model_dir=str(model_dir))
    await probe.close()
    engine = VLLMEngine(
        vllm_service.url,
        dev_mode=False,
        model_name=probe.model_name,
        max_context=probe.max_context,
        model_dir=str(model_dir),
        decode=tokenizer.decode,
    )
    yield engine
    await engine.close()


async def test_without_dev_mode_updates_drain_and_full_updates_are_refused(
    no_dev_engine: VLLMEngine, hf_model: Any
) -> None:
    """No /pause and no /collective_rpc: pause holds new requests only, a LoRA update waits
    for the requests in flight (they finish on the old weights, uninterrupted), and a full
    update is refused with the fix."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    engine = no_dev_engine
    assert not engine.can_pause
    with pytest.raises(UserError, match="VLLM_SERVER_DEV_MODE=1"):
        await engine.update_weights(WeightUpdate(state_dict=hf_model.state_dict()))
    prompt = [100, 200, 300]
    greedy = SamplingParams(temperature=0, max_new_tokens=4)

    await engine.pause()
    held = asyncio.create_task(engine.generate(prompt, greedy))
    await asyncio.sleep(0.5)
    assert not held.done() and (await engine.health())["status"] == "paused"
    await engine.resume()
    assert len((await held).output_ids) == 4

    start = time.perf_counter()
    await engine.generate(prompt, greedy.replace(max_new_tokens=32))
    rate = 32 / (time.perf_counter() - start)
    n = min(engine.max_context - len(prompt) - 1, max(100, int(rate * 2)))  # about 2 s
    long = asyncio.create_task(engine.generate(prompt, greedy.replace(max_new_tokens=n)))
    await asyncio.sleep(0.2)
    assert not long.done(), f"{n} tokens took under 0.2 s"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    probe = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(3)
    lora = {
        k: torch.randn(v.shape, generator=gen) for k, v in get_peft_model_state_dict(probe).items()
    }
    update = asyncio.create_task(
        engine.update_weights(WeightUpdate(kind="lora", state_dict=lora, lora_config=config))
    )
    first = await long
    version = await update
    assert first.interruptions == 0 and first.output_versions == [0] * n
    assert version == 1
    after = await engine.generate(prompt, greedy)
    assert after.output_versions == [1] * 4


async def test_two_engines_behind_a_router_share_updates(
    vllm_service: Any, model_dir: Path, hf_model: Any
) -> None:
    """RoutedEngine over remote engines: an in-memory update is written once and every
    replica loads it (here both replicas are the one session server)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from areal_agents.engines.router import RoutedEngine

    replicas = [
        await asyncio.to_thread(VLLMEngine.connect, vllm_service.url, model_dir=str(model_dir))
        for _ in range(2)
    ]
    engine = RoutedEngine(replicas)
    try:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False)
        probe = get_peft_model(copy.deepcopy(hf_model), config)
        gen = torch.Generator().manual_seed(5)
        lora = {
            k: torch.randn(v.shape, generator=gen) * 2
            for k, v in get_peft_model_state_dict(probe).items()
        }
        version = await engine.update_weights(
            WeightUpdate(kind="lora", state_dict=lora, lora_config=config)
        )
        assert [r.version for r in replicas] == [version, version]
        greedy = SamplingParams(temperature=0, max_new_tokens=6)
        a = await engine.generate([100, 200], greedy, route_key="session-a")
        b = await engine.generate([100, 200], greedy, route_key="session-b")
        assert engine.replica_for("session-a") != engine.replica_for("session-b")
        assert a.output_ids == b.output_ids  # the same adapter on both replicas
        assert a.output_versions == b.output_versions == [version] * 6
    finally:
        await engine.close()


async def test_seeded_requests_with_long_prompts_at_once_do_not_kill_a_cpu_server(
    vllm_service: Any, model_dir: Path
) -> None:
    """Eight seeded requests of ~1,500 prompt tokens at once, over a 2,048-token context:
    with chunked prefill (vLLM's default) the second prompt is split over two steps and the
    CPU build dies rewinding its seeded generator ("CPU Generator does not use offset"), as
    a training run's server did. Launched by this project, a CPU build prefills each prompt
    in one step; the requests all finish, reproducibly."""
    import os
    import random

    from areal_agents.engines.vllm import cpu_build, find_python, prefill_schedule

    engine = await asyncio.to_thread(VLLMEngine.connect, vllm_service.url, model_dir=str(model_dir))
    try:
        if not os.environ.get("AREAL_VLLM_URL"):  # launched here by `areal-agent serve`
            assert cpu_build(find_python(None))
            with httpx.Client(base_url=vllm_service.url) as http:
                assert prefill_schedule(http) == ("cpu", False)
            assert engine.send_seeds
        rng = random.Random(3)
        prompts = [[rng.randrange(100, 20000) for _ in range(1400 + 20 * i)] for i in range(8)]
        params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=i) for i in range(8)]
        first = await asyncio.gather(
            *(engine.generate(p, s) for p, s in zip(prompts, params, strict=True))
        )
        again = await engine.generate(prompts[5], params[5])
        assert all(1 <= len(r.output_ids) <= 4 for r in first)
        assert again.output_ids == first[5].output_ids
        health = await engine.health()
        assert health["status"] == "ok", health
    finally:
        await engine.close()
