"""Loading new weights into a served model: full state dicts and LoRA adapters.

A full update replaces every tensor of the base model (strictly: an unknown or missing key is
an error, so a mismatched checkpoint never half-loads). A LoRA update ships only adapter
tensors, which is what makes adapter-only weight sync cheap. Served in float32 (given a
:class:`MergedLora`), the adapter is merged into the weights it adapts, so the forward pass is
the plain model's; in lower precision the model is wrapped with peft and the adapter runs
beside the frozen weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from areal_agents.engines.protocol import WeightUpdate
from areal_agents.errors import UserError


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` (or ``*.bin``) file of a directory into one state dict."""
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
    from peft import PeftModel  # noqa: PLC0415  peft loads on weight updates

    return model.get_base_model() if isinstance(model, PeftModel) else model


def apply_weight_update(model: Any, update: WeightUpdate, merged: MergedLora | None = None) -> Any:
    """Apply ``update`` to ``model`` in place; returns the model to serve (peft-wrapped after
    an unmerged LoRA update).

    ``merged``: the engine's :class:`MergedLora`; with it a LoRA update of a float32 model is
    merged into the weights, and a full update re-merges the adapter onto the new weights."""
    if (update.state_dict is None) == (update.path is None):
        raise UserError("a WeightUpdate needs exactly one of state_dict or path")
    if update.kind == "lora" and merged is not None and merged.can_merge(model):
        return merged.apply(model, update)
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
        if merged is not None and merged.active:
            return merged.rebase(model)
        return model
    if update.kind == "lora":
        return _apply_lora(model, update)
    raise UserError(f"unknown weight update kind {update.kind!r}; expected 'full' or 'lora'")


def _tied(model: Any, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _lora_parts(update: WeightUpdate) -> tuple[Any, dict[str, torch.Tensor]]:
    """The update's LoRA config (None when it has none) and adapter tensors."""
    from peft import LoraConfig  # noqa: PLC0415  peft loads on weight updates

    config, sd = update.lora_config, update.state_dict
    if update.path is not None:
        root = Path(update.path)
        if config is None and (root / "adapter_config.json").exists():
            config = LoraConfig(
                **_lora_kwargs(json.loads((root / "adapter_config.json").read_text()))
            )
        sd = read_state_dict(root)
    return config, sd


def _need_config(config: Any) -> Any:
    if config is None:
        raise UserError(
            "the first LoRA update needs a lora_config (peft.LoraConfig) or an adapter "
            "directory with adapter_config.json"
        )
    return config


def _load_adapter(model: Any, sd: dict[str, torch.Tensor], complete: bool = False) -> None:
    """Load adapter tensors into a peft model. ``complete``: the adapter was created without
    weights (``low_cpu_mem_usage``), so ``sd`` must hold every one of them."""
    from peft import set_peft_model_state_dict  # noqa: PLC0415  peft loads on weight updates

    result = set_peft_model_state_dict(model, sd, low_cpu_mem_usage=complete)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"LoRA update has keys the adapter does not know: {unexpected[:3]}")
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if complete and missing:
        raise UserError(
            f"LoRA update lacks {len(missing)} adapter tensors (e.g. {missing[:2]}); the first "
            "update must carry the whole adapter (peft's get_peft_model_state_dict)"
        )


def _apply_lora(model: Any, update: WeightUpdate) -> Any:
    from peft import PeftModel, get_peft_model  # noqa: PLC0415  peft loads on weight updates

    config, sd = _lora_parts(update)
    if not isinstance(model, PeftModel):
        model = get_peft_model(model, _need_config(config))
    _load_adapter(model, sd)
    return model


class MergedLora:
    """A LoRA adapter served merged into the weights it adapts, for float32 models.

    peft's forward runs each adapted linear layer as ``W x + s B (A x)``: two more small
    matrix products and a few more Python calls per layer, which cost ~15% of a decode step of
    the default model on CPU. Merged, the layer computes ``(W0 + s B A) x`` with the plain
    model's forward. Every update starts again from the base weights ``W0`` (kept aside on the
    first merge) and merges the new adapter with peft (``merge_and_unload``; so rsLoRA, rank
    and alpha patterns follow peft)::

        W = W0 + s * B @ A,    s = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)

    so no rounding accumulates over updates. A full update replaces ``W0`` and the current
    adapter is merged onto it again (as it stays active on a peft model). Only for float32
    (or float64) weights: in bfloat16 a delta of ~1e-3 of ``W`` is below the format's
    resolution (2^-8) and would round away, so those models keep peft's unmerged forward.
    """

    def __init__(self) -> None:
        self.config: Any = None
        self.state: dict[str, torch.Tensor] | None = None
        self._base: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        """Whether an adapter is merged into the model."""
        return self.state is not None

    @staticmethod
    def can_merge(model: Any) -> bool:
        from peft import PeftModel  # noqa: PLC0415  peft loads on weight updates

        return not isinstance(model, PeftModel) and all(
            p.dtype in (torch.float32, torch.float64)
            for p in model.parameters()
            if p.is_floating_point()
        )

    def apply(self, model: Any, update: WeightUpdate) -> Any:
        """Merge the update's adapter (replacing the one merged before); returns the model.
        A bad adapter leaves the one merged before in place."""
        config, sd = _lora_parts(update)
        if config is None and self.state is not None:  # the same adapter: tensors not sent keep
            sd = {**self.state, **sd}
        config = _need_config(config if config is not None else self.config)
        self._restore()
        try:
            model = self._merge(model, config, sd)
        except BaseException:
            if self.state is not None:  # keep serving the adapter merged before
                model = self._merge(model, self.config, self.state)
            raise
        self.config, self.state = config, {k: v.detach().clone() for k, v in sd.items()}
        return model

    def _merge(self, model: Any, config: Any, sd: dict[str, torch.Tensor]) -> Any:
        from peft import get_peft_model  # noqa: PLC0415  peft loads on weight updates

        # low_cpu_mem_usage: no random initialisation of adapter weights about to be replaced
        wrapped = get_peft_model(model, copy.deepcopy(config), low_cpu_mem_usage=True)
        try:
            _load_adapter(wrapped, sd, complete=True)
        except BaseException:
            wrapped.unload()
            raise
        kept = {id(param) for param, _ in self._base}  # W0 already set aside stays as it is
        self._base += [
            (layer.weight, layer.weight.detach().clone())
            for layer in (m.get_base_layer() for m in wrapped.modules() if _is_lora_layer(m))
            if id(layer.weight) not in kept
        ]
        return wrapped.merge_and_unload()

    def rebase(self, model: Any) -> Any:
        """After a full update: take the new weights as ``W0`` and merge the adapter again."""
        assert self.state is not None
        self._base = []  # the full update wrote the new W0
        return self.apply(model, WeightUpdate(kind="lora", state_dict=self.state))

    def _restore(self) -> None:
        """Every weight an adapter was merged into back to its base value ``W0``."""
        with torch.no_grad():
            for param, original in self._base:
                param.copy_(original)


def _is_lora_layer(module: Any) -> bool:
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415  peft loads on weight updates

    return isinstance(module, LoraLayer)


def _lora_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    from peft import LoraConfig  # noqa: PLC0415  peft loads on weight updates

    names = {f.name for f in dataclasses.fields(LoraConfig)}
    return {k: v for k, v in raw.items() if k in names}


class LoraMerger:
    """Full weights from LoRA updates, for a server that serves the adapter merged (a
    server backend's ``engine.lora_updates: merged``).

    vLLM's CPU build runs a model with an adapter several times slower than the same model
    without one. Merged on the host, every LoRA update becomes a full update of the served
    model: a float32 copy of the base model ``W0`` (loaded from ``model_dir`` on the first
    update) takes the adapter with :class:`MergedLora`, so every update starts again from
    ``W0``::

        W = W0 + s * B @ A,    s = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)

    and the whole state dict is sent (the server's reload needs every tensor). The server
    should run in float32: in bfloat16 a delta below 2^-8 of a weight rounds away. Costs one
    float32 copy of the model in this process and a full checkpoint written per update.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = str(model_dir)
        self._model: Any = None
        self._merged = MergedLora()

    def full_update(self, update: WeightUpdate) -> WeightUpdate:
        """``update`` (a LoRA update, in memory or a directory) as a full update of the
        merged float32 weights, with the same version."""
        if update.kind != "lora":
            raise UserError(f"LoraMerger merges LoRA updates, not {update.kind!r} ones")
        if self._model is None:
            from transformers import AutoModelForCausalLM  # noqa: PLC0415  loads on the first merge

            with torch.random.fork_rng(devices=[]):  # the caller's random stream stays
                self._model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=torch.float32
                )
        self._model = self._merged.apply(self._model, update)
        return WeightUpdate(
            kind="full", state_dict=self._model.state_dict(), version=update.version
        )
