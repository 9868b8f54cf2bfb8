"""Weights as files, for engines in another process: checking and staging checkpoints.

A server (vLLM, SGLang) loads new weights from a directory, so an in-memory
:class:`~areal_agents.engines.protocol.WeightUpdate` is first written as safetensors (a full
model) or as a peft adapter directory (LoRA). Before a server is asked to load a directory,
its tensor names and shapes are compared with the served checkpoint's: a server that meets
unknown or missing tensors half-way through a reload can be left unusable, so a mismatch is
refused here with the names that differ.

Reading safetensors headers needs no torch (8-byte length, then a JSON header); staging an
in-memory state dict imports torch and safetensors (and peft for LoRA) on first use.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from areal_agents.engines.protocol import WeightUpdate
from areal_agents.errors import UserError

TensorIndex = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (safetensors dtype, shape)."""


def safetensors_index(directory: str | Path) -> TensorIndex:
    """Names, dtypes and shapes of every tensor in a directory's ``*.safetensors`` files."""
    root = Path(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors files in {root}; save the model with save_pretrained")
    out: TensorIndex = {}
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise UserError(f"{f} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 1024 * 1024:
                raise UserError(f"{f} is not a safetensors file (header of {size} bytes)")
            try:
                header = json.loads(fh.read(size))
            except ValueError as exc:
                raise UserError(f"{f} is not a safetensors file: {exc}") from None
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
    return out


def check_same_tensors(new_dir: str | Path, base_dir: str | Path, *, tied: bool) -> None:
    """Refuse ``new_dir`` unless it holds exactly the tensors (names, shapes) of ``base_dir``.

    ``tied``: the model ties ``lm_head.weight`` to the embeddings, so that tensor may be
    present in one checkpoint and absent from the other.
    """
    new, base = safetensors_index(new_dir), safetensors_index(base_dir)
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(k for k in base if k not in new and k not in optional)
    unknown = sorted(k for k in new if k not in base and k not in optional)
    shapes = sorted(k for k in new if k in base and new[k][1] != base[k][1])
    if missing or unknown or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors (e.g. {missing[:3]})")
        if unknown:
            parts.append(f"{len(unknown)} unknown tensors (e.g. {unknown[:3]})")
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} shape mismatches (e.g. {k}: {new[k][1]} vs {base[k][1]})")
        raise UserError(
            f"the checkpoint in {new_dir} does not match the served model ({base_dir}): "
            + ", ".join(parts)
            + "; send the complete weights of the same architecture, or use kind='lora'"
        )


def check_adapter_dir(directory: str | Path) -> None:
    """Refuse a LoRA directory without ``adapter_config.json`` and adapter weights."""
    root = Path(directory)
    if not (root / "adapter_config.json").exists():
        raise UserError(
            f"{root} has no adapter_config.json; save the adapter with peft's save_pretrained"
        )
    if not list(root.glob("adapter_model.*")):
        raise UserError(f"{root} has no adapter_model.safetensors (or .bin)")


def tied_embeddings(model_dir: str | Path) -> bool:
    """Whether the HF config in ``model_dir`` ties the output layer to the embeddings."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def stage_update(update: WeightUpdate, root: str | Path) -> WeightUpdate:
    """Return ``update`` as a directory-based update, writing its state dict under ``root``.

    Updates that already name a ``path`` are returned unchanged. A full state dict becomes
    ``model.safetensors``; a LoRA state dict becomes a peft adapter directory
    (``adapter_model.safetensors`` + ``adapter_config.json`` from ``update.lora_config``).
    """
    if (update.state_dict is None) == (update.path is None):
        raise UserError("a WeightUpdate needs exactly one of state_dict or path")
    if update.path is not None:
        return update
    target = Path(tempfile.mkdtemp(prefix=f"{update.kind}-", dir=root))
    if update.kind == "lora":
        if update.lora_config is None:
            raise UserError(
                "a LoRA update from a state dict needs lora_config (a peft.LoraConfig) so "
                "that the server knows the adapter's rank, alpha and target modules"
            )
        update.lora_config.save_pretrained(str(target))
        _save_safetensors(update.state_dict, target / "adapter_model.safetensors")
    elif update.kind == "full":
        _save_safetensors(update.state_dict, target / "model.safetensors")
    else:
        raise UserError(f"unknown weight update kind {update.kind!r}; expected 'full' or 'lora'")
    return WeightUpdate(
        kind=update.kind, path=str(target), lora_config=update.lora_config, version=update.version
    )


def _save_safetensors(state_dict: Any, path: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415  it loads torch; staging only

    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.data_ptr()
        if ptr in seen:  # tied weights share storage; safetensors wants distinct buffers
            t = t.clone()
        seen.add(ptr)
        tensors[name] = t
    save_file(tensors, str(path))


class StagingArea:
    """A directory of staged updates that keeps, per kind, only the newest committed ones.

    A server may read a weights directory again after it was loaded: vLLM re-reads an
    adapter from its path after a full update, and a request that reached the server before
    an in-place adapter reload may make a worker load the adapter it named, from its
    directory, after the reload. So the newest ``keep["lora"]`` adapter directories (3 by
    default: the current one and two before it) and the newest ``keep["full"]`` full-weight
    directories (1: they are large) stay until newer ones of the same kind are committed or
    the area is closed.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        prefix: str = "areal-weights-",
        keep: dict[str, int] | None = None,
    ) -> None:
        self._root = Path(root) if root else None
        self._prefix = prefix
        self._owns_root = root is None
        self._keep = {"lora": 3, "full": 1, **(keep or {})}
        self._pending: list[tuple[str, Path]] = []
        self._current: dict[str, list[Path]] = {}

    @property
    def root(self) -> Path:
        """The directory (a new temporary one, made on first use, unless one was given)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix=self._prefix))
        return self._root

    def stage(self, update: WeightUpdate) -> WeightUpdate:
        """Write ``update`` here if it is in memory; see :func:`stage_update`."""
        if update.path is not None and update.state_dict is None:
            return update  # already files
        staged = stage_update(update, self.root)
        if staged.path != update.path:
            self._pending.append((staged.kind, Path(str(staged.path))))
        return staged

    def commit(self, staged: WeightUpdate) -> None:
        """``staged`` was loaded: it becomes current; the oldest of its kind beyond what is
        kept are deleted."""
        path = Path(str(staged.path))
        for kind, p in list(self._pending):
            if p == path:
                self._pending.remove((kind, p))
                kept = [old for old in self._current.get(kind, []) if old != path] + [path]
                for old in kept[: -self._keep.get(kind, 1)]:
                    shutil.rmtree(old, ignore_errors=True)
                self._current[kind] = kept[-self._keep.get(kind, 1) :]

    def discard(self, staged: WeightUpdate) -> None:
        """``staged`` was not loaded: delete it if it was written here."""
        path = Path(str(staged.path))
        for kind, p in list(self._pending):
            if p == path:
                self._pending.remove((kind, p))
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        for _, p in self._pending:
            shutil.rmtree(p, ignore_errors=True)
        for paths in self._current.values():
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        self._pending.clear()
        self._current.clear()
        if self._owns_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def with_output_layer(directory: str | Path, root: str | Path) -> Path:
    """``directory`` as a checkpoint that holds ``lm_head.weight`` (for tied models).

    vLLM's in-place reload treats a tied output layer as a layer of its own: a checkpoint
    without ``lm_head.weight`` leaves it with its old values (and one with it unties it), so
    every reload of a tied model must carry ``lm_head.weight`` equal to the embeddings. When
    ``directory`` lacks it, a new directory under ``root`` links its safetensors files and
    adds ``lm_head.safetensors`` with a copy of the embedding matrix (raw bytes, no torch).
    """
    src = Path(directory)
    index = safetensors_index(src)
    if "lm_head.weight" in index:
        return src
    embeds = [k for k in index if k.endswith(("embed_tokens.weight", "wte.weight"))]
    if len(embeds) != 1:
        raise UserError(
            f"{src} has no lm_head.weight and no single embedding matrix to tie it to "
            f"(found {embeds}); save the output layer explicitly"
        )
    dtype, shape, data = _read_tensor(src, embeds[0])
    target = Path(tempfile.mkdtemp(prefix="tied-", dir=root))
    for f in sorted(src.glob("*.safetensors")):
        (target / f.name).symlink_to(f.resolve())
    header = json.dumps(
        {"lm_head.weight": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(data)]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(target / "lm_head.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header + data)
    return target


def _read_tensor(directory: Path, name: str) -> tuple[str, tuple[int, ...], bytes]:
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            if name in header:
                meta = header[name]
                start, end = meta["data_offsets"]
                fh.seek(8 + size + start)
                return str(meta["dtype"]), tuple(meta["shape"]), fh.read(end - start)
    raise UserError(f"no tensor {name} in {directory}")
