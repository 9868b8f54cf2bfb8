"""The embedded inference engine: transformers + torch in a worker thread.

Continuous batching on one device (:mod:`areal_agents.engines.batching`): every active
request holds a row of one batched KV cache, kept in preallocated buffers
(:mod:`areal_agents.engines.kv_cache`): a decode step writes its keys and values in place, a
joining request fills the next free row and a finished one's row is refilled by the last
row, so no step copies the whole batch's cache (transformers' ``DynamicCache`` concatenates
at every step). A request that arrives while others decode joins at the next step. On CPU,
decode steps read a prefix shared by every row once per step, and the vocabulary projection
runs in slices (:mod:`areal_agents.engines.attention`).

Weight updates interrupt generation in flight: the KV cache of every active request is
dropped, the new weights are loaded, and each request is re-prefilled from its prompt plus
the tokens it already generated, so later tokens are sampled (and tagged) with the new
policy version. With ``kv_on_update="keep"`` the requests in flight instead continue on
their caches (keys and values of the earlier tokens as the old weights computed them), as
in-flight weight updates do elsewhere: no re-prefill; later tokens are still sampled by the
new weights, tagged with the new version, and their logprobs are the ones they were sampled
with, so the trainer's off-policy correction sees exactly what happened.

A LoRA adapter of a float32 model is merged into the weights it adapts
(:class:`areal_agents.engines.weights.MergedLora`), so decoding runs the plain model's forward.

Logprobs follow :mod:`areal_agents.engines.protocol`: ``log_softmax(logits / T)`` in float32
over the full vocabulary, before top-k / top-p truncation (T = 1 for greedy decoding;
:mod:`areal_agents.engines.sampling`).

The worker thread owns the model; the event loop only enqueues work and awaits futures, so
the proxy is never blocked by a forward pass.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import torch

from areal_agents.engines.attention import slice_output_projection, use_cascade_attention
from areal_agents.engines.batching import BatchingWorker, DecodeFn, Request
from areal_agents.engines.protocol import (
    GenerateResult,
    KvOnUpdate,
    SamplingParams,
    WeightUpdate,
)
from areal_agents.engines.weights import MergedLora, apply_weight_update
from areal_agents.errors import BackendError, ContextOverflow, UserError
from areal_agents.hardware import default_device, resolve_dtype

KV_ON_UPDATE: tuple[KvOnUpdate, ...] = get_args(KvOnUpdate)
"""What a weight update may do with the KV caches of requests in flight (the module doc)."""


class EmbeddedEngine(BatchingWorker):
    """A transformers causal LM served in-process with continuous batching.

    Example::

        engine = EmbeddedEngine.from_pretrained("path/to/model")
        result = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        await engine.close()
    """

    def __init__(
        self,
        model: Any,
        *,
        model_name: str = "model",
        eos_token_ids: Sequence[int] = (),
        decode: DecodeFn | None = None,
        max_batch_size: int = 64,
        max_context: int | None = None,
        version: int = 0,
        compute_lock: FairLock | None = None,
        prefix_cache_entries: int = 64,
        merged_lora: MergedLora | None = None,
        kv_on_update: KvOnUpdate = "recompute",
        cpu_time_spans: bool = False,
    ) -> None:
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update: one of {KV_ON_UPDATE}, got {kv_on_update!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        served = model.eval()
        slice_output_projection(model)
        use_cascade_attention(model)
        self.model_name = model_name
        cfg_ctx = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        super().__init__(
            served,
            eos_token_ids=eos_token_ids,
            decode=decode,
            max_batch_size=max_batch_size,
            max_context=int(max_context or cfg_ctx or 4096),
            version=version,
            compute_lock=compute_lock,
            prefix_cache_entries=prefix_cache_entries,
            merged_lora=merged_lora,
            kv_on_update=kv_on_update,
            cpu_time_spans=cpu_time_spans,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "auto",
        device: str | None = None,
        adapter: str | Path | None = None,
        **kwargs: Any,
    ) -> EmbeddedEngine:
        """Load a HF model directory (or hub id) and serve it.

        ``dtype``: "float32", "bfloat16", "float16" or "auto" (bfloat16 where the device
        computes it natively, else float32: :func:`areal_agents.hardware.resolve_dtype`).
        ``adapter``: a saved peft LoRA adapter directory (``adapter_config.json`` and its
        weights, e.g. ``model/`` of a training checkpoint) applied on top of the model.
        """
        from transformers import (  # noqa: PLC0415  transformers loads with a model
            AutoModelForCausalLM,
            GenerationConfig,
        )

        device = default_device(device)
        torch_dtype = getattr(torch, resolve_dtype(dtype, device))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
        model = model.to(device)  # type: ignore[arg-type]
        merged = MergedLora()
        if adapter is not None:
            if not (Path(adapter) / "adapter_config.json").exists():
                raise UserError(
                    f"--adapter {adapter}: no adapter_config.json there; pass a directory "
                    "saved by peft (a training checkpoint's model/ directory)"
                )
            update = WeightUpdate(kind="lora", path=str(adapter))
            model = apply_weight_update(model, update, merged)
            model.eval()
        eos: list[int] = []
        try:
            gen = GenerationConfig.from_pretrained(str(path))
            ids = gen.eos_token_id
            eos = [ids] if isinstance(ids, int) else list(ids or [])
        except OSError:
            pass
        if not eos and model.config.eos_token_id is not None:
            ids = model.config.eos_token_id
            eos = [ids] if isinstance(ids, int) else list(ids)
        kwargs.setdefault("model_name", Path(str(path)).name)
        return cls(model, eos_token_ids=eos, merged_lora=merged, **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        """Generate from ``prompt_ids``; see the module docstring for the semantics.

        ``route_key`` is accepted for the :class:`~areal_agents.engines.protocol.Engine`
        protocol and ignored (one replica)."""
        if self._closed:
            raise BackendError("the engine is closed")
        if self._error is not None:
            raise BackendError(f"the engine worker died: {self._error!r}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:  # an embedding lookup out of range would kill the worker
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(prompt) >= self.max_context:
            raise ContextOverflow(
                f"the prompt has {len(prompt)} tokens but the model's context is "
                f"{self.max_context}; shorten the conversation"
            )
        loop = asyncio.get_running_loop()
        req = Request(prompt, params, loop.create_future(), loop)
        if params.seed is not None:
            req.generator = torch.Generator(device=self._device).manual_seed(params.seed)
        self._inbox.put(req)
        self._wake.set()
        return await req.future

    async def update_weights(self, update: WeightUpdate) -> int:
        """Load new weights between two decode steps; returns the new policy version."""
        return int(await self._command("update", update))

    async def pause(self) -> None:
        """Stop scheduling forward passes (in-flight requests wait) until :meth:`resume`."""
        await self._command("pause", None)

    async def resume(self) -> None:
        await self._command("resume", None)

    async def abort_all(self) -> int:
        """Finish every waiting and active request now with finish reason "abort", keeping
        the tokens generated so far; returns how many were aborted."""
        return int(await self._command("abort", None))

    async def health(self) -> dict[str, Any]:
        return {
            "status": "closed"
            if self._closed
            else ("error" if self._error else ("paused" if self._paused else "ok")),
            "backend": "embedded",
            "model": self.model_name,
            "version": self._version,
            "active": len(self._active),
            "waiting": len(self._waiting) + self._inbox.qsize(),
            "device": str(self._device),
            **self._stats,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)

    async def _command(self, name: str, arg: Any) -> Any:
        if self._closed:
            raise BackendError("the engine is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._commands.put((name, arg, fut, loop))
        self._wake.set()
        return await fut


class FairLock:
    """A first-come, first-served lock for forward passes shared by threads.

    ``threading.Lock`` lets the engine's decode loop take the lock again right after
    releasing it, starving a trainer thread that waits for it; tickets make them alternate.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self) -> FairLock:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._cond.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()
