"""Session-sticky routing over several replicas, and the proxy's routing key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from areal_agents.engines.protocol import (
    GenerateResult,
    SamplingParams,
    WeightUpdate,
    accepts_route_key,
)
from areal_agents.engines.router import RoutedEngine
from areal_agents.errors import UserError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

PARAMS = SamplingParams(max_new_tokens=3)


class OldEngine(FakeEngine):
    """An engine written before route_key existed (its generate takes no such keyword)."""

    async def generate(  # type: ignore[override]
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> GenerateResult:
        return await super().generate(prompt_ids, params)


def test_accepts_route_key_tells_old_engines_apart() -> None:
    assert accepts_route_key(FakeEngine())
    assert not accepts_route_key(OldEngine())


async def test_a_key_sticks_to_one_replica_and_new_keys_spread() -> None:
    replicas = [FakeEngine(), FakeEngine(), FakeEngine()]
    engine = RoutedEngine(replicas)
    for _ in range(4):
        for key in ("a", "b", "c"):
            await engine.generate([1, 2], PARAMS, route_key=key)
    assert [r.calls for r in replicas] == [4, 4, 4]  # one replica per key, all different
    assert engine.replica_for("a") == engine.replica_for("a")
    assert len({engine.replica_for(k) for k in "abc"}) == 3


async def test_new_keys_go_to_the_least_loaded_replica() -> None:
    slow, fast = FakeEngine(delay_s=0.5), FakeEngine()
    engine = RoutedEngine([slow, fast])
    busy = asyncio.create_task(engine.generate([1], PARAMS, route_key="long"))
    await asyncio.sleep(0.05)
    assert engine.replica_for("long") == 0
    assert engine.replica_for("new") == 1  # replica 0 has a request in flight
    await busy


async def test_keys_are_forgotten_least_recently_used_first() -> None:
    engine = RoutedEngine([FakeEngine(), FakeEngine()], max_keys=2)
    for key in ("a", "b", "c"):
        engine.replica_for(key)
    assert list(engine._keys) == ["b", "c"]


async def test_updates_and_control_reach_every_replica() -> None:
    replicas = [FakeEngine(), OldEngine()]
    engine = RoutedEngine(replicas)
    assert await engine.update_weights(WeightUpdate(path="/unused")) == 1
    assert [r.version for r in replicas] == [1, 1] and engine.version == 1
    assert await engine.update_weights(WeightUpdate(path="/unused", version=9)) == 9
    assert [r.version for r in replicas] == [9, 9]
    await engine.pause()
    assert (await engine.health())["status"] == "paused"
    task = asyncio.create_task(engine.generate([1], PARAMS, route_key="x"))
    await asyncio.sleep(0.1)
    assert not task.done()
    await engine.resume()
    assert (await task).output_versions == [9]
    health = await engine.health()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    await engine.close()


def test_replicas_must_serve_one_model() -> None:
    with pytest.raises(UserError, match="different models"):
        RoutedEngine([FakeEngine(model_name="a"), FakeEngine(model_name="b")])
    with pytest.raises(UserError, match="at least one"):
        RoutedEngine([])


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_model_dir: Any) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize("cls", [FakeEngine, OldEngine])
def test_the_proxy_keeps_each_session_on_one_replica(cls: type, qwen_tokenizer: Any) -> None:
    replicas = [cls(), cls(), cls()]
    proxy = Proxy(RoutedEngine(replicas), qwen_tokenizer)
    with ProxyServer.start(proxy) as server:
        sessions = [proxy.sessions.create() for _ in range(3)]
        for turn in range(3):
            for s in sessions:
                r = httpx.post(
                    f"{server.base_url}/chat/completions",
                    headers={"Authorization": f"Bearer {s.api_key}"},
                    json={"messages": [{"role": "user", "content": f"turn {turn}"}], "n": 2},
                )
                assert r.status_code == 200, r.text
    assert [r.calls for r in replicas] == [6, 6, 6]  # 3 turns x n=2, each session on one


def test_the_proxy_works_with_engines_without_route_key(qwen_tokenizer: Any) -> None:
    engine = OldEngine()
    proxy = Proxy(engine, qwen_tokenizer)
    with ProxyServer.start(proxy) as server:
        s = proxy.sessions.create()
        r = httpx.post(
            f"{server.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {s.api_key}"},
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 200 and engine.calls == 1


async def test_a_merging_router_merges_once_and_every_replica_loads_the_same_files(
    tiny_model_dir: Any, tmp_path: Any
) -> None:
    """``engine.lora_updates: merged`` over several servers: the adapter is merged once, the
    full weights are written once, and every replica gets the same directory."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from areal_agents.engines.weights import LoraMerger

    received: list[WeightUpdate] = []

    class Recording(FakeEngine):
        async def update_weights(self, update: WeightUpdate) -> int:
            received.append(update)
            return await super().update_weights(update)

    engine = RoutedEngine([Recording(), Recording()], staging_dir=str(tmp_path))
    engine.merger = LoraMerger(tiny_model_dir)
    merges: list[int] = []
    real = engine.merger.full_update
    engine.merger.full_update = lambda u: merges.append(1) or real(u)  # type: ignore[method-assign]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    lora = get_peft_model_state_dict(get_peft_model(copy.deepcopy(base), config))
    version = await engine.update_weights(
        WeightUpdate(kind="lora", state_dict=lora, lora_config=config)
    )
    assert version == 1 and merges == [1]
    assert [u.kind for u in received] == ["full", "full"]
    assert received[0].path is not None and received[0].path == received[1].path
    assert received[0].state_dict is None
    await engine.close()
