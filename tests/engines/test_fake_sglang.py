"""The fake SGLang server speaks SGLang's native API: shapes, errors, pause, weights."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.testing.fake_sglang import FakeSGLang


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path) -> FakeSGLang:
    return FakeSGLang(str(tiny_model_dir), served_model_name="tiny", context_length=64)


@pytest.fixture
async def http(fake: FakeSGLang) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=fake.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as client:
        yield client


async def test_generate_answers_in_sglangs_shape(http: httpx.AsyncClient) -> None:
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0, "max_new_tokens": 5, "stop_token_ids": []},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "rid": "req-1",
    }
    r = await http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 5
    assert meta["id"] == "req-1" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == "default"
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None and e[0] < 0 for e in meta["output_token_logprobs"])
    assert [len(p) for p in meta["output_top_logprobs"]] == [2] * 5
    stop = out["output_ids"][1]
    stopping = {"temperature": 0, "max_new_tokens": 5, "stop_token_ids": [stop]}
    r = await http.post("/generate", json={**body, "sampling_params": stopping})
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert "output_token_logprobs" in meta


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": [1], "text": "a"}, "Only one of text, input_ids or input_embeds"),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1, "max_new_tokens": 4}},
            "temperature must be a non-negative finite number, got -1.0.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_p": 0, "max_new_tokens": 4}},
            "top_p must be in (0, 1], got 0.0.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_k": 0, "max_new_tokens": 4}},
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        ({"input_ids": list(range(64))}, "The input (64 tokens) is longer than the model's"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 62}},
            "Requested token count exceeds the model's maximum context length of 64 tokens. "
            "You requested a total of 64 tokens: 2 tokens from the input messages and 62",
        ),
        (
            {"input_ids": [1], "lora_path": "nope", "sampling_params": {"max_new_tokens": 4}},
            "requested LoRA adapters are not loaded: nope",
        ),
        ({"input_ids": [1, 10**9]}, "contains values greater than the vocab size"),
    ],
)
async def test_malformed_requests_get_sglangs_400(
    http: httpx.AsyncClient, body: dict[str, Any], message: str
) -> None:
    r = await http.post("/generate", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


async def test_a_body_of_the_wrong_type_is_a_validation_error(http: httpx.AsyncClient) -> None:
    r = await http.post("/generate", json={"input_ids": "not a list"})
    assert r.status_code == 400
    assert r.json()["object"] == "error" and r.json()["code"] == 400


async def test_pause_in_abort_mode_returns_requests_in_flight(
    http: httpx.AsyncClient, fake: FakeSGLang
) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"temperature": 0, "max_new_tokens": 60}}
    running = asyncio.create_task(http.post("/generate", json=body))
    while fake._in_flight == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    r = await http.post("/pause_generation", json={"mode": "abort"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    out = (await running).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 60
    held = asyncio.create_task(http.post("/generate", json={**body, "input_ids": [3]}))
    await asyncio.sleep(0.3)
    assert not held.done()  # new requests wait while paused
    await http.post("/continue_generation", json={})
    assert len((await held).json()["output_ids"]) == 60
    r = await http.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "Invalid mode" in r.json()["error"]["message"]


async def test_weights_and_adapters(http: httpx.AsyncClient, tiny_model_dir: Path) -> None:
    r = await http.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = await http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "7"}
    )
    assert r.json()["success"] is True
    assert (await http.get("/get_model_info")).json()["weight_version"] == "7"
    r = await http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = await http.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 400
    card = (await http.get("/v1/models")).json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 64
    assert (await http.get("/health")).status_code == 200


def _adapter(root: Path, seed: int) -> str:
    """A random LoRA adapter of the tiny model, as a peft directory under ``root``."""
    import torch
    from peft import LoraConfig

    from areal_agents.engines.protocol import WeightUpdate
    from areal_agents.engines.weight_files import stage_update

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    g = torch.Generator().manual_seed(seed)
    hidden, q_out = 128, 2 * 64  # the tiny Qwen3: hidden_size, heads x head_dim
    state = {}
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        state[f"{prefix}.lora_A.weight"] = torch.randn(2, hidden, generator=g)
        state[f"{prefix}.lora_B.weight"] = torch.randn(q_out, 2, generator=g)
    root.mkdir(parents=True, exist_ok=True)
    staged = stage_update(WeightUpdate(kind="lora", state_dict=state, lora_config=config), root)
    return str(staged.path)


async def _client(fake: FakeSGLang) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app), base_url="http://s")


async def test_an_adapter_other_than_the_newest_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A client that keeps naming the adapter it used before an update gets HTTP 400 naming
    the newest adapter; an adapter never loaded gets SGLang's "not loaded"."""
    fake = FakeSGLang(str(tiny_model_dir), context_length=64)
    body = {"input_ids": [1, 2], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    async with await _client(fake) as http:
        for name, seed in (("old", 0), ("new", 1)):
            path = _adapter(tmp_path / name, seed)
            r = await http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 200, r.text
        assert (await http.post("/generate", json={**body, "lora_path": "new"})).status_code == 200
        r = await http.post("/generate", json={**body, "lora_path": "old"})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "old is not the newest one loaded" in message and "new was loaded" in message
        r = await http.post("/generate", json={**body, "lora_path": "gone"})
        assert r.status_code == 400
        assert "not loaded: gone" in r.json()["error"]["message"]
        # Resolved when admitted: a request held by a pause, sent with the adapter that was
        # newest then, is refused once a newer one is loaded during the pause.
        await http.post("/pause_generation", json={"mode": "abort"})
        held = asyncio.create_task(http.post("/generate", json={**body, "lora_path": "new"}))
        await asyncio.sleep(0.1)
        path = _adapter(tmp_path / "newer", 2)
        r = await http.post("/load_lora_adapter", json={"lora_name": "newer", "lora_path": path})
        assert r.status_code == 200
        await http.post("/continue_generation", json={})
        r = await held
        assert r.status_code == 400 and "newer was loaded" in r.json()["error"]["message"]
        # Once the newer ones are unloaded, the one left is the newest.
        for name in ("newer", "new"):
            await http.post("/unload_lora_adapter", json={"lora_name": name})
        assert (await http.post("/generate", json={**body, "lora_path": "old"})).status_code == 200
        assert [kind for kind, _ in fake.loads] == ["lora"] * 3
    await fake.close()


async def test_an_integer_version_label_never_goes_back(tiny_model_dir: Path) -> None:
    fake = FakeSGLang(str(tiny_model_dir), context_length=64)

    async def label(version: Any) -> httpx.Response:
        return await http.post("/update_weight_version", json={"new_version": version})

    async with await _client(fake) as http:
        assert (await label("5")).status_code == 200  # from "default": any label
        r = await label("4")
        assert r.status_code == 400
        assert "cannot go back from 5 to 4" in r.json()["error"]["message"]
        assert fake.weight_version == "5"
        assert (await label("5")).status_code == 200  # the same again is not back
        assert (await label("run-b")).status_code == 200  # other labels as before
        assert (await label("2")).status_code == 200
        assert (await label("3")).status_code == 200
        model = str(tiny_model_dir)
        r = await http.post(
            "/update_weights_from_disk", json={"model_path": model, "weight_version": "1"}
        )
        assert r.status_code == 400 and r.json()["success"] is False
        assert "cannot go back from 3 to 1" in r.json()["message"]
        assert fake.weight_version == "3" and fake.loads == []  # nothing was loaded
        r = await http.post(
            "/update_weights_from_disk", json={"model_path": model, "weight_version": "4"}
        )
        assert r.status_code == 200 and fake.loads == [("full", model)]
        assert (await http.get("/get_weight_version")).json() == {"weight_version": "4"}
    await fake.close()


async def test_weights_outside_the_readable_root_cannot_be_read(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``readable_root`` (``--readable-root``): weights elsewhere fail as on a server on
    another machine, in SGLang's words; those under it load."""
    shared = tmp_path / "shared"
    fake = FakeSGLang(str(tiny_model_dir), context_length=64, readable_root=str(shared))
    inside = _adapter(shared, 0)
    outside = _adapter(tmp_path / "local", 0)
    async with await _client(fake) as http:
        r = await http.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir)})
        assert r.status_code == 400 and r.json()["success"] is False
        assert r.json()["message"] == (
            f"Failed to get weights iterator: [Errno 2] No such file or directory: "
            f"'{tiny_model_dir}'."
        )
        r = await http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": outside})
        assert r.status_code == 400 and r.json()["success"] is False
        assert "No such file or directory" in r.json()["error_message"]
        r = await http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": inside})
        assert r.status_code == 200, r.text
        assert fake.loads == [("lora", inside)]
    await fake.close()


def _launch(model: Path, tmp_path: Path) -> Any:
    """SGLangEngine.launch with SGLang's flags, running the fake server's module."""
    import sys

    from areal_agents.engines.sglang import SGLangEngine

    return SGLangEngine.launch(
        str(model),
        python=sys.executable,
        server_module="areal_agents.testing.fake_sglang",
        dtype="float32",
        log_path=str(tmp_path / "sglang.log"),
        start_timeout_s=180,
    )


def test_sglang_engine_launches_a_server_and_stops_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLangEngine.launch with SGLang's flags, here running the fake server's module."""

    from areal_agents.engines.protocol import SamplingParams

    engine = _launch(tiny_model_dir, tmp_path)
    assert engine.server is not None and engine.model_name == tiny_model_dir.name

    async def run() -> Any:
        try:
            return await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
        finally:
            await engine.close()

    res = asyncio.run(run())
    assert len(res.output_ids) == 3 and res.output_versions == [0, 0, 0]
    assert not engine.server.running


def test_weights_over_a_process_group_reach_the_server_bit_for_bit(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``init_weight_group`` / ``update_weights_distributed``: the fake server (its own
    process) joins the engine's gloo group, receives every tensor of a changed model exactly
    (SHA-256 of each, on the server, against the trainer's), serves them under the new
    version, and a second update goes through the same group."""

    import torch
    from transformers import AutoModelForCausalLM

    from areal_agents.engines.protocol import SamplingParams
    from areal_agents.engines.weight_transfer import digest

    engine = _launch(tiny_model_dir, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def run() -> None:
        try:
            before = await engine.generate([1, 2, 3], greedy)
            await engine.init_weight_group(backend="gloo", timeout_s=60)
            assert await engine.update_weights_distributed(state, version=3) == 3
            received = httpx.get(f"{engine.url}/debug/received_weights").json()
            assert received == {k: digest(v) for k, v in state.items()}
            after = await engine.generate([1, 2, 3], greedy)
            assert after.output_versions == [3] * len(after.output_ids)
            assert after.output_logprobs != before.output_logprobs
            half = {k: v * 0.5 for k, v in state.items()}
            assert await engine.update_weights_distributed(half) == 4
            received = httpx.get(f"{engine.url}/debug/received_weights").json()
            assert received == {k: digest(v) for k, v in half.items()}
            # A lower version is refused (after the tensors are received, so the group stays
            # in step); the served weights and the label stay those of version 4.
            with pytest.raises(ValueError, match="cannot go back from 4 to 2"):
                await engine.update_weights_distributed(state, version=2)
            assert httpx.get(f"{engine.url}/get_weight_version").json()["weight_version"] == "4"
            assert engine.version == 4
            again = await engine.generate([1, 2, 3], greedy)
            assert again.output_versions == [4] * len(again.output_ids)
        finally:
            await engine.close()

    asyncio.run(run())
