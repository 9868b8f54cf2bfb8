"""Weight updates: a LoRA adapter merged into a float32 model (MergedLora) computes what peft's
unmerged forward computes, every update starts from the base weights, a full update keeps the
adapter, a bad adapter leaves the previous one in place, and low precision stays unmerged."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from areal_agents.engines.protocol import WeightUpdate
from areal_agents.engines.weights import MergedLora, apply_weight_update
from areal_agents.errors import UserError

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _adapter(base, seed: int) -> dict[str, torch.Tensor]:
    probe = get_peft_model(copy.deepcopy(base), copy.deepcopy(CONFIG))
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen) * 0.5
        for k, v in get_peft_model_state_dict(probe).items()
    }


def _unmerged(model, sd):
    return apply_weight_update(
        copy.deepcopy(model), WeightUpdate(kind="lora", state_dict=sd, lora_config=CONFIG)
    )


def _logits(model) -> torch.Tensor:
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_merged_adapter_computes_the_unmerged_forward(base):
    sd = _adapter(base, 1)
    merged = MergedLora()
    model = apply_weight_update(
        copy.deepcopy(base), WeightUpdate(kind="lora", state_dict=sd, lora_config=CONFIG), merged
    )
    assert not isinstance(model, PeftModel) and merged.active
    reference = _unmerged(base, sd)
    assert isinstance(reference, PeftModel)
    assert torch.allclose(_logits(model), _logits(reference), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(model), _logits(base), atol=1e-2)


def test_each_update_merges_onto_the_base_weights(base):
    """Adapter 1, then adapter 2 (with no config: the first one's is kept) gives exactly the
    weights of adapter 2 merged once; nothing of adapter 1 remains."""
    first, second = _adapter(base, 1), _adapter(base, 2)
    merged = MergedLora()
    model = copy.deepcopy(base)
    model = apply_weight_update(
        model, WeightUpdate(kind="lora", state_dict=first, lora_config=CONFIG), merged
    )
    model = apply_weight_update(model, WeightUpdate(kind="lora", state_dict=second), merged)
    once = apply_weight_update(
        copy.deepcopy(base),
        WeightUpdate(kind="lora", state_dict=second, lora_config=CONFIG),
        MergedLora(),
    )
    got, want = _weights(model), _weights(once)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_full_update_keeps_the_merged_adapter(base):
    sd = _adapter(base, 3)
    new_base = {k: v + 0.01 for k, v in base.state_dict().items()}
    merged = MergedLora()
    model = apply_weight_update(
        copy.deepcopy(base), WeightUpdate(kind="lora", state_dict=sd, lora_config=CONFIG), merged
    )
    model = apply_weight_update(model, WeightUpdate(kind="full", state_dict=new_base), merged)
    moved = copy.deepcopy(base)
    moved.load_state_dict(new_base)
    reference = _unmerged(moved, sd)
    assert torch.allclose(_logits(model), _logits(reference), atol=1e-5, rtol=1e-5)


def test_a_bad_adapter_leaves_the_previous_one_merged(base):
    sd = _adapter(base, 4)
    merged = MergedLora()
    model = apply_weight_update(
        copy.deepcopy(base), WeightUpdate(kind="lora", state_dict=sd, lora_config=CONFIG), merged
    )
    before = _weights(model)
    bad = {**sd, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 8)}
    with pytest.raises(UserError, match="keys the adapter does not know"):
        apply_weight_update(model, WeightUpdate(kind="lora", state_dict=bad), merged)
    after = _weights(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(UserError, match="lora_config"):
        apply_weight_update(
            copy.deepcopy(base), WeightUpdate(kind="lora", state_dict=sd), MergedLora()
        )
    half = dict(list(sd.items())[: len(sd) // 2])
    with pytest.raises(UserError, match="lacks"):  # a first adapter must be whole
        apply_weight_update(
            copy.deepcopy(base),
            WeightUpdate(kind="lora", state_dict=half, lora_config=CONFIG),
            MergedLora(),
        )
    # later updates without a config may send some tensors: the others keep their values
    changed = {k: v * 2 for k, v in half.items()}
    model = apply_weight_update(model, WeightUpdate(kind="lora", state_dict=changed), merged)
    whole = apply_weight_update(
        copy.deepcopy(base),
        WeightUpdate(kind="lora", state_dict={**sd, **changed}, lora_config=CONFIG),
        MergedLora(),
    )
    after, want = _weights(model), _weights(whole)
    assert all(torch.equal(after[k], want[k]) for k in want)
    assert not all(torch.equal(after[k], before[k]) for k in before)


def test_low_precision_keeps_the_adapter_unmerged(base):
    half = copy.deepcopy(base).to(torch.bfloat16)
    merged = MergedLora()
    update = WeightUpdate(kind="lora", state_dict=_adapter(base, 5), lora_config=CONFIG)
    model = apply_weight_update(half, update, merged)
    assert isinstance(model, PeftModel) and not merged.active


def test_a_merger_turns_each_lora_update_into_the_full_merged_weights(
    base, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``engine.lora_updates: merged``: W = W0 + (alpha / r) B A for every adapted layer,
    from the base weights each time; every other tensor is the base's; the result is what
    a float32 server loads (written to files and read back)."""
    from areal_agents.engines.weight_files import stage_update
    from areal_agents.engines.weights import LoraMerger, read_state_dict

    merger = LoraMerger(tiny_model_dir)
    w0 = _weights(base)
    key = "model.layers.0.self_attn.q_proj.weight"
    for seed, version in ((1, 3), (2, 4)):
        sd = _adapter(base, seed)
        full = merger.full_update(
            WeightUpdate(kind="lora", state_dict=sd, lora_config=CONFIG, version=version)
        )
        assert full.kind == "full" and full.version == version
        written = read_state_dict(str(stage_update(full, tmp_path).path))
        a = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
        b = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        assert torch.allclose(written[key], w0[key] + (8 / 4) * b @ a, atol=1e-6)
        untouched = "model.layers.0.mlp.up_proj.weight"
        assert torch.equal(written[untouched], w0[untouched])
        assert set(written) >= {k for k in w0 if k != "lm_head.weight"}
    # The merged weights compute the adapter's forward (the last update's).
    served = copy.deepcopy(base)
    served.load_state_dict(written, strict=False)
    assert torch.allclose(_logits(served), _logits(_unmerged(base, sd)), atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="merges LoRA updates"):
        merger.full_update(WeightUpdate(kind="full", state_dict=w0))
