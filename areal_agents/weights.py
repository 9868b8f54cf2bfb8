"""Loading new weights into a served model: full state dicts and LoRA adapters.

A full update replaces every tensor of the base model (strictly: an unknown or missing key is
an error, so a mismatched checkpoint never half-loads). A LoRA update wraps the model with
peft on first use and then only copies adapter tensors, which is what makes adapter-only weight
sync cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .engine import WeightUpdate
from .errors import UserError


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` (or ``*.bin``) file of a directory into one state dict."""
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(root.glob("*.bin"))
    if not bins:
        raise UserError(f"no *.safetensors or *.bin weights in {root}")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def _base_model(model: Any) -> Any:
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def apply_weight_update(model: Any, update: WeightUpdate) -> Any:
    """Apply ``update`` to ``model`` in place; returns the (possibly peft-wrapped) model."""
    if (update.state_dict is None) == (update.path is None):
        raise UserError("a WeightUpdate needs exactly one of state_dict or path")
    if update.kind == "full":
        sd = update.state_dict if update.state_dict is not None else read_state_dict(update.path)  # type: ignore[arg-type]
        base = _base_model(model)
        own = base.state_dict()
        missing = [k for k in own if k not in sd and not _tied(base, k)]
        unknown = [k for k in sd if k not in own]
        if missing or unknown:
            raise UserError(
                f"full weight update does not match the model: {len(missing)} missing keys "
                f"(e.g. {missing[:3]}), {len(unknown)} unknown keys (e.g. {unknown[:3]}); "
                "send the complete state dict of the same architecture, or use kind='lora'"
            )
        with torch.no_grad():
            for k, v in sd.items():
                own[k].copy_(v.to(own[k].dtype))
        return model
    if update.kind == "lora":
        return _apply_lora(model, update)
    raise UserError(f"unknown weight update kind {update.kind!r}; expected 'full' or 'lora'")


def _tied(model: Any, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _apply_lora(model: Any, update: WeightUpdate) -> Any:
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

    config = update.lora_config
    sd = update.state_dict
    if update.path is not None:
        root = Path(update.path)
        if config is None and (root / "adapter_config.json").exists():
            config = LoraConfig(
                **_lora_kwargs(json.loads((root / "adapter_config.json").read_text()))
            )
        sd = read_state_dict(root)
    if not isinstance(model, PeftModel):
        if config is None:
            raise UserError(
                "the first LoRA update needs a lora_config (peft.LoraConfig) or an adapter "
                "directory with adapter_config.json"
            )
        model = get_peft_model(model, config)
    result = set_peft_model_state_dict(model, sd)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"LoRA update has keys the adapter does not know: {unexpected[:3]}")
    return model


def _lora_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    from peft import LoraConfig

    names = {f.name for f in dataclasses.fields(LoraConfig)}
    return {k: v for k, v in raw.items() if k in names}
