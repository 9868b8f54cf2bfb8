"""The embedded inference engine: transformers + torch in a worker thread.

Continuous batching on one device: every active request holds a row of one batched KV
cache (left-padded to a common length), kept in preallocated buffers: a decode step writes
its keys and values in place, a joining request fills the next free row and a finished one's
row is refilled by the last row, so no step copies the whole batch's cache (transformers'
``DynamicCache`` concatenates at every step). Each loop iteration the worker

1. runs queued control commands (weight update, pause, resume) between forward passes;
2. admits waiting requests up to ``max_batch_size``: each is prefilled on its own (exact, no
   padding in the prompt pass) and its cache row joins the batch, so a request that arrives
   while others decode joins at the next step instead of waiting for the batch to finish;
3. runs one batched decode step for all active rows, samples one token per row with that
   row's own sampling parameters and random generator, and retires finished rows.

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

Logprobs follow :mod:`areal_agents.engines.protocol`: ``log_softmax(logits / T)`` in float32 over the
full vocabulary, before top-k / top-p truncation (T = 1 for greedy decoding).

The worker thread owns the model; the event loop only enqueues work and awaits futures, so
the proxy is never blocked by a forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from areal_agents import spans
from areal_agents.engines.protocol import GenerateResult, SamplingParams, WeightUpdate
from areal_agents.engines.weights import MergedLora, apply_weight_update
from areal_agents.errors import BackendError, ContextOverflow, UserError
from areal_agents.hardware import default_device, resolve_dtype
from areal_agents.trajectory import common_prefix_len

log = logging.getLogger(__name__)

DecodeFn = Callable[[list[int]], str]


_LOGIT_SLICE = 1024
"""Vocabulary rows of the output projection per matmul on CPU (:func:`_slice_output_projection`)."""

_CASCADE_MIN_TOKENS = 16
"""Decode steps attend to a prefix shared by every row at least this long as one block
(:func:`_cascade_attention`); shorter shared prefixes are read per row."""

KV_ON_UPDATE = ("recompute", "keep")
"""What a weight update does with the KV caches of requests in flight (see the module doc)."""

_SHARE_MIN_TOKENS = 32
"""A request waits for the next admission round when an earlier request of this round will
compute at least this many more of its prefix than the cache holds."""


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    interruptions: int = 0
    kept_kv: bool = False
    """Its cache holds keys and values of older weights (kept through an update)."""

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        result = GenerateResult(
            output_ids=self.out_ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=reason,  # type: ignore[arg-type]
            stop_reason=stop_reason,
            top_logprobs=self.top,
            prompt_tokens=len(self.prompt_ids),
            queue_s=(self.started or time.perf_counter()) - self.submitted,
            latency_s=time.perf_counter() - self.submitted,
            interruptions=self.interruptions,
        )
        self.loop.call_soon_threadsafe(_set_result, self.future, result)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class EmbeddedEngine:
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
        kv_on_update: str = "recompute",
        cpu_time_spans: bool = False,
    ) -> None:
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update: one of {KV_ON_UPDATE}, got {kv_on_update!r}")
        self.kv_on_update = kv_on_update
        self.cpu_time_spans = cpu_time_spans
        """Record each prefill / decode span only as long as the CPU time this process
        spent in it (per torch thread), from its start: for an engine that shares its
        cores at the idle priority, whose wall time includes the time others had them."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        _slice_output_projection(model)
        _use_cascade_attention(model)
        self.model_name = model_name
        self.eos_token_ids = tuple(eos_token_ids)
        self._decode = decode
        self.max_batch_size = max_batch_size
        cfg_ctx = getattr(model.config, "max_position_embeddings", None)
        self.max_context = int(max_context or cfg_ctx or 4096)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._version = version
        self._device = next(model.parameters()).device
        self._cache_kwarg = _cache_kwarg(model)
        # Shared with a trainer in the same process on CPU: two OpenMP teams on the same
        # cores slow both down many times over, so forward passes take turns.
        self._compute = spans.TimedLock(compute_lock, "engine")
        self._inbox: queue.Queue[_Request] = queue.Queue()
        self._commands: queue.Queue[tuple[str, Any, asyncio.Future[Any], Any]] = queue.Queue()
        self._wake = threading.Event()
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._cache: Any = None  # batched DynamicCache for self._active
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left pad
        self._shared: _SharedPrefix | None = None  # the cached tokens every row starts with
        self._paused = False
        self._closed = False
        self._stats = {
            "requests": 0,
            "output_tokens": 0,
            "decode_steps": 0,
            "prefills": 0,
            "prefill_tokens": 0,
            "prefix_hit_tokens": 0,
            "prefix_full_hits": 0,
            "prefill_batches": 0,
            "cascade_steps": 0,
            "kept_on_update": 0,
        }
        self._prefixes = _PrefixCache(prefix_cache_entries)
        # LoRA updates of a float32 model are merged into its weights (weights.MergedLora)
        self._lora = merged_lora or MergedLora()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()

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
        from transformers import AutoModelForCausalLM, GenerationConfig

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

        ``route_key`` is accepted for the :class:`~areal_agents.engines.protocol.Engine` protocol and
        ignored (one replica)."""
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
        req = _Request(prompt, params, loop.create_future(), loop)
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

    # ------------------------------------------------------------------ worker side
    async def _command(self, name: str, arg: Any) -> Any:
        if self._closed:
            raise BackendError("the engine is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._commands.put((name, arg, fut, loop))
        self._wake.set()
        return await fut

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._closed:
                    self._run_commands()
                    self._drain_inbox()
                    if self._paused or not (self._waiting or self._active):
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    self._admit()
                    if self._active:
                        with self._timed("decode"):
                            self._decode_step()
        except BaseException as exc:  # the worker must report, never die silently
            log.exception("embedded engine worker failed")
            self._error = exc
            for req in self._active + self._waiting:
                req.loop.call_soon_threadsafe(
                    _set_exception, req.future, BackendError(f"engine failure: {exc!r}")
                )
        finally:
            for req in self._active + self._waiting + self._drain_all():
                req.finish("abort")

    def _drain_all(self) -> list[_Request]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _drain_inbox(self) -> None:
        self._waiting.extend(self._drain_all())

    def _run_commands(self) -> None:
        while True:
            try:
                name, arg, fut, loop = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if name == "pause":
                    self._paused, value = True, None
                elif name == "resume":
                    self._paused, value = False, None
                elif name == "abort":
                    value = self._abort_all()
                else:
                    with spans.span("engine", "weight_update"):
                        value = self._apply_update(arg)
                loop.call_soon_threadsafe(_set_result, fut, value)
            except Exception as exc:
                loop.call_soon_threadsafe(_set_exception, fut, exc)

    @contextlib.contextmanager
    def _timed(self, name: str, **attrs: Any) -> Iterator[None]:
        """A compute span on lane ``engine`` (see :attr:`cpu_time_spans`)."""
        t0 = time.perf_counter()
        cpu0 = time.process_time() if self.cpu_time_spans else 0.0
        try:
            yield
        finally:
            t1 = time.perf_counter()
            if self.cpu_time_spans:
                cpu = (time.process_time() - cpu0) / max(torch.get_num_threads(), 1)
                t1 = min(t1, t0 + cpu)
            spans.add("engine", name, t0, t1, **attrs)

    def _abort_all(self) -> int:
        self._drain_inbox()
        aborted = self._active + self._waiting
        self._active, self._waiting, self._cache, self._mask = [], [], None, None
        self._shared = None
        for req in aborted:
            req.finish("abort")
        return len(aborted)

    def _apply_update(self, update: WeightUpdate) -> int:
        if self.kv_on_update == "keep":  # the active rows decode on from their caches
            self._stats["kept_on_update"] += len(self._active)
            for req in self._active:
                req.kept_kv = True
            if self._shared is not None:  # rows joining later read their own prefix
                self._shared.length = 0
        else:  # interrupt: drop every active request's KV cache; re-prefill after the update
            for req in self._active:
                req.interruptions += 1
            self._waiting = self._active + self._waiting
            self._active, self._cache, self._mask, self._shared = [], None, None, None
        self._prefixes.clear()  # new requests start from keys and values of the new weights
        self.model = apply_weight_update(self.model, update, self._lora)
        self.model.eval()
        self._version = update.version if update.version is not None else self._version + 1
        return self._version

    # -- admission: prefill waiting requests (batched) and join the batch -----------
    def _admit(self) -> None:
        """Prefill waiting requests and add their cache rows to the batch.

        Every active row keeps exactly one *pending* token outside the cache: the last token
        of its prompt (or the last one it sampled). The prefill therefore covers the sequence
        minus its last token, and every decode step feeds all rows their pending token.

        Each round takes as many waiting requests as there are free rows, looks up their
        longest cached prefix and prefills the rest of them together (:meth:`_prefill_many`).
        A request that shares more of its prefix with an earlier request of the round than
        the cache holds waits for the next round, when that request's prefill is cached:
        a group's identical prompts, or its episodes re-prefilled after a weight update,
        compute their common part once.
        """
        self._waiting = [r for r in self._waiting if not r.future.cancelled()]
        while self._waiting and len(self._active) < self.max_batch_size:
            room = self.max_batch_size - len(self._active)
            jobs: list[_Prefill] = []
            later: list[_Request] = []
            for req in self._waiting:
                if len(jobs) >= room:
                    later.append(req)
                    continue
                prefix = (req.prompt_ids + req.out_ids)[:-1]
                hit, kv = self._prefixes.lookup(prefix)
                shared = max((common_prefix_len(prefix, j.prefix) for j in jobs), default=0)
                if shared >= hit + _SHARE_MIN_TOKENS:
                    later.append(req)
                    continue
                if req.started is None:
                    req.started = time.perf_counter()
                jobs.append(_Prefill(req, prefix, hit, kv))
            self._waiting = later
            again = any(j.req.out_ids for j in jobs)  # requests a weight update interrupted
            with self._timed("reprefill" if again else "prefill", rows=len(jobs)):
                caches = self._prefill_many(jobs)
            for job, cache in zip(jobs, caches, strict=True):
                self._join(job.req, cache, len(job.prefix))

    def _prefill_many(self, jobs: list[_Prefill]) -> list[Any]:
        """The KV caches of the jobs' prefixes, each continuing its cached prefix (computed
        by the current weights: the cache is cleared on every weight update).

        A fully cached prefix needs no forward pass. The others are prefilled in chunks of
        similar length, one forward pass per chunk: the cached keys and values left-padded to
        a common width, the new tokens right-padded, a padding mask and every token at its
        own position; each row's keys and values are then cut out of the chunk's cache. A
        chunk admits a row while its padding stays under half of its real tokens.
        """
        from transformers import DynamicCache

        out: dict[int, Any] = {}
        todo = []
        for i, job in enumerate(jobs):
            self._stats["prefix_hit_tokens"] += job.hit
            if not job.prefix:
                out[i] = self._empty_cache()
            elif job.hit == len(job.prefix):  # e.g. a group's identical prompts: no forward
                self._stats["prefix_full_hits"] += 1
                out[i] = DynamicCache(ddp_cache_data=job.kv)  # joining copies it
            else:
                todo.append(i)
        todo.sort(key=lambda i: len(jobs[i].prefix) - jobs[i].hit)
        chunks: list[list[int]] = []
        real = 0  # new tokens in the last chunk
        for i in todo:
            new = len(jobs[i].prefix) - jobs[i].hit  # the largest so far: todo is sorted
            if chunks and (len(chunks[-1]) + 1) * new <= 1.5 * (real + new):
                chunks[-1].append(i)
                real += new
            else:
                chunks.append([i])
                real = new
        for chunk in chunks:
            caches = self._forward_chunk([jobs[j] for j in chunk])
            out.update(zip(chunk, caches, strict=True))
        return [out[i] for i in range(len(jobs))]

    def _forward_chunk(self, jobs: list[_Prefill]) -> list[Any]:
        from transformers import DynamicCache

        width = max(j.hit for j in jobs)  # cached columns, left-padded
        new = max(len(j.prefix) - j.hit for j in jobs)  # new columns, right-padded
        n, dev = len(jobs), self._device
        ids = torch.zeros(n, new, dtype=torch.long)
        pos = torch.zeros(n, new, dtype=torch.long)
        mask = torch.zeros(n, width + new, dtype=torch.long)
        for r, j in enumerate(jobs):
            rest = j.prefix[j.hit :]
            ids[r, : len(rest)] = torch.tensor(rest)
            pos[r, : len(rest)] = torch.arange(j.hit, len(j.prefix))
            mask[r, width - j.hit : width + len(rest)] = 1
        kwargs: dict[str, Any] = {}
        if width:
            past = []
            cached = next(j.kv for j in jobs if j.kv)
            for layer in range(len(cached)):
                ref = cached[layer][0]
                k = ref.new_zeros(n, ref.shape[1], width, ref.shape[3])
                v = torch.zeros_like(k)
                for r, j in enumerate(jobs):
                    if j.hit:
                        k[r, :, width - j.hit :] = j.kv[layer][0][0]
                        v[r, :, width - j.hit :] = j.kv[layer][1][0]
                past.append((k, v))
            kwargs[self._cache_kwarg] = DynamicCache(ddp_cache_data=past)
        if n > 1 or width:
            kwargs["attention_mask"] = mask.to(dev)
        with self._compute():
            res = self.model(
                input_ids=ids.to(dev),
                position_ids=pos.to(dev),
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        layers = _cache_of(res).layers
        self._stats["prefills"] += n
        self._stats["prefill_batches"] += 1
        caches = []
        for r, j in enumerate(jobs):
            cols = slice(width - j.hit, width + len(j.prefix) - j.hit)
            kv = [
                (layer.keys[r : r + 1, :, cols].clone(), layer.values[r : r + 1, :, cols].clone())
                for layer in layers
            ]
            self._stats["prefill_tokens"] += len(j.prefix) - j.hit
            self._prefixes.store(j.prefix, kv)
            caches.append(DynamicCache(ddp_cache_data=kv))
        return caches

    def _empty_cache(self) -> Any:
        from transformers import DynamicCache

        cfg = self.model.config.get_text_config()
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros(1, heads, 0, head_dim, dtype=dtype, device=self._device)
        return DynamicCache(ddp_cache_data=[(empty, empty)] * cfg.num_hidden_layers)

    def _join(self, req: _Request, cache: Any, length: int) -> None:
        """Add a prefilled request as the batch's last row (its keys and values are copied
        into the batch buffers, right-aligned: rows are left-padded to a common width)."""
        row = torch.ones(1, length, dtype=torch.long)
        ids = (req.prompt_ids + req.out_ids)[:-1]
        if self._cache is None or self._shared is None:
            # the row's own tensors: never modified in place (the batch copies them)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            self._shared = _SharedPrefix(ids, kv, length)
        else:
            self._shared.length = common_prefix_len(ids, self._shared.ids[: self._shared.length])
        if self._cache is None:
            batch_layer = _batch_layer_class()
            cache.layers = [batch_layer(layer.keys, layer.values) for layer in cache.layers]
            self._cache, self._mask, self._active = cache, row, [req]
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], length)
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.add_row(theirs.keys, theirs.values)
        self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(row, width)])
        self._active.append(req)

    # -- one batched decode step ------------------------------------------------------
    def _decode_step(self) -> None:
        """Feed every row its pending token, sample the next one, retire finished rows."""
        assert self._mask is not None
        pending = [(r.out_ids or r.prompt_ids)[-1] for r in self._active]
        last = torch.tensor(pending, device=self._device).unsqueeze(1)
        ones = torch.ones(len(self._active), 1, dtype=torch.long)
        self._mask = torch.cat([self._mask, ones], 1)
        positions = (self._mask.sum(1, keepdim=True) - 1).to(self._device)
        with self._compute():
            out = self._model_step(last, positions)
        self._cache = _cache_of(out)
        tokens, logps, tops = self._sample(out.logits[:, -1, :].float())
        self._after_step(tokens, logps, tops)

    def _model_step(self, last: torch.Tensor, positions: torch.Tensor) -> Any:
        assert self._mask is not None
        plan = None
        shared = self._shared
        if shared is not None and shared.length >= _CASCADE_MIN_TOKENS and _cascading(self.model):
            n, width = shared.length, self._mask.shape[1]
            # row r's tokens start at column pad_r; its own (unshared) ones at pad_r + n
            pad = width - self._mask.sum(1, keepdim=True)
            cols = torch.arange(n, width).unsqueeze(0)
            bias = torch.zeros(cols.shape[1]).expand(len(pad), -1)
            bias = bias.masked_fill(cols < pad + n, float("-inf"))
            plan = _CascadePlan(
                n, [(k[:, :, :n], v[:, :, :n]) for k, v in shared.kv], bias.to(self._device)
            )
            self._stats["cascade_steps"] += 1
        _PLAN.value = plan
        try:
            return self.model(
                input_ids=last,
                attention_mask=self._mask.to(self._device),
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: self._cache},
            )
        finally:
            _PLAN.value = None

    def _after_step(self, tokens: list[int], logps: list[float], tops: list[Any]) -> None:
        self._stats["decode_steps"] += 1
        keep: list[int] = []
        for i, req in enumerate(self._active):
            tok = tokens[i]
            req.out_ids.append(tok)
            req.logprobs.append(logps[i])
            req.versions.append(self._version)
            if req.params.top_logprobs:
                req.top.append(tops[i])
            self._stats["output_tokens"] += 1
            done = self._finished(req, tok)
            if done is not None:
                self._stats["requests"] += 1
                self._remember(i, req)
                req.finish(*done)
            elif not req.future.cancelled():
                keep.append(i)
        self._retain(keep)

    def _remember(self, row: int, req: _Request) -> None:
        """Store a finished row's keys and values in the prefix cache (copies): its
        conversation's next turn (the same tokens, a tool result appended) then prefills
        only what was appended, not the tokens generated in this turn."""
        assert self._mask is not None and self._cache is not None
        ids = (req.prompt_ids + req.out_ids)[:-1]  # the last sampled token is not cached
        n = int(self._mask[row].sum())
        if n != len(ids) or self._prefixes.max_entries < 1 or req.kept_kv:
            return
        kv = [
            (layer.keys[row : row + 1, :, -n:].clone(), layer.values[row : row + 1, :, -n:].clone())
            for layer in self._cache.layers
        ]
        self._prefixes.store(ids, kv)

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float], list[Any]]:
        temps = torch.tensor(
            [r.params.temperature if r.params.temperature > 0 else 1.0 for r in self._active],
            device=logits.device,
        ).unsqueeze(1)
        logp = torch.log_softmax(logits / temps, dim=-1)
        tokens: list[int] = logp.argmax(-1).tolist()  # greedy rows keep these
        sampled = [i for i, r in enumerate(self._active) if r.params.temperature > 0]
        if sampled:
            rows = [_truncate(logp[i], self._active[i].params) for i in sampled]
            uniforms = torch.cat(
                [
                    torch.rand(1, generator=self._active[i].generator, device=logp.device)
                    for i in sampled
                ]
            )
            for i, tok in zip(sampled, _sample_rows(torch.stack(rows), uniforms), strict=True):
                tokens[i] = tok
        tops: list[Any] = []
        for i, req in enumerate(self._active):
            if req.params.top_logprobs:
                v, ix = torch.topk(logp[i], req.params.top_logprobs)
                tops.append(list(zip(ix.tolist(), v.tolist(), strict=True)))
            else:
                tops.append(None)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1))
        return tokens, chosen.squeeze(1).tolist(), tops

    def _finished(self, req: _Request, tok: int) -> tuple[str, int | str | None] | None:
        p = req.params
        if tok in p.stop_token_ids or tok in self.eos_token_ids:
            return ("stop", tok)
        if p.stop and self._decode is not None:
            text = self._decode(req.out_ids)
            for s in p.stop:
                if s and s in text:
                    return ("stop", s)
        if len(req.out_ids) >= p.max_new_tokens:
            return ("length", None)
        if len(req.prompt_ids) + len(req.out_ids) >= self.max_context:
            return ("length", None)
        return None

    def _retain(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (ascending). Each removed row's slot is refilled by the
        last kept row (one row copied per retired request, not the whole batch), so the
        order of the rows changes; then columns that are padding in every row are dropped."""
        if len(keep) == len(self._active):
            return
        if not keep:
            self._active, self._cache, self._mask, self._shared = [], None, None, None
            return
        assert self._mask is not None
        kept, n = set(keep), len(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in range(n, len(self._active)) if i in kept]
        order = list(range(n))
        for dst, src in zip(holes, movers, strict=True):
            order[dst] = src
        self._active = [self._active[i] for i in order]
        mask = self._mask[order]
        trim = int((mask.cumsum(1) == 0).all(0).sum())
        self._mask = mask[:, trim:]
        for layer in self._cache.layers:
            layer.compact(n, list(zip(holes, movers, strict=True)), trim)


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


@dataclass
class _SharedPrefix:
    """The first ``length`` cached tokens of every active row (``ids[:length]``), with the
    keys and values of the row they were taken from (``[1, H_kv, >= length, D]`` per layer)."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    length: int


@dataclass
class _CascadePlan:
    """What one decode step's attention needs besides the batch cache: the shared prefix's
    keys and values per layer (``[1, H_kv, n, D]``) and, over the batch cache's columns
    ``n..W-1``, an additive bias that is 0 on each row's own tokens and -inf elsewhere (its
    padding and its copy of the shared prefix)."""

    n: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    bias: torch.Tensor  # [B, W - n]


_PLAN = threading.local()
_CASCADE = "areal_cascade"


def _cascading(model: Any) -> bool:
    return getattr(model.config, "_attn_implementation", None) == _CASCADE


def _use_cascade_attention(model: Any) -> None:
    """Let a CPU model's decode steps read a prefix shared by every row once per step
    instead of once per row (:func:`_cascade_attention`); other forward passes (prefill, a
    model without a plan) run transformers' ``sdpa`` attention unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if (
        next(model.parameters()).device.type != "cpu"
        or getattr(model.config, "_attn_implementation", None) != "sdpa"
        or not hasattr(model, "set_attn_implementation")
    ):
        return
    AttentionInterface.register(_CASCADE, _cascade_attention)
    AttentionMaskInterface.register(_CASCADE, sdpa_mask)
    model.set_attn_implementation(_CASCADE)


def _cascade_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Decode-step attention in two parts, merged exactly.

    With the shared prefix ``K_s, V_s`` (``n`` tokens, the same for every row) and a row's
    own tokens ``K_r, V_r`` (the batch cache's columns from ``n`` on, masked to the row's
    tokens after its copy of the prefix), each query ``q`` (scaled scores ``s = q K^T *
    scaling``) gets::

        m_i = max(s_i),  z_i = sum exp(s_i - m_i),  o_i = exp(s_i - m_i) V_i   (i = s, r)
        out = (o_s e^(m_s - m) + o_r e^(m_r - m)) / (z_s e^(m_s - m) + z_r e^(m_r - m)),
        m = max(m_s, m_r)

    which is ``softmax([s_s, s_r]) [V_s; V_r]``, the attention over the whole row. The
    shared part is one matmul for all rows (the prefix is read once, not once per row: on a
    CPU the per-row reads of the keys and values bound a decode step). Grouped-query heads
    share their key-value head. Anything else (no plan: prefill, a model used elsewhere;
    sliding windows, soft-capping, attention sinks, position biases) is transformers' ``sdpa``
    attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: _CascadePlan | None = getattr(_PLAN, "value", None)
    layer = getattr(module, "layer_idx", None)
    if (
        plan is None
        or layer is None
        or query.shape[2] != 1
        or any(
            kwargs.get(k) is not None
            for k in ("sliding_window", "softcap", "s_aux", "position_bias")
        )
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    per = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.float().view(rows, kv_heads, per, dim)  # head h reads key-value head h // per
    ks, vs = plan.kv[layer]
    # shared: [kv_heads, rows * per, n]
    qs = q.transpose(0, 1).reshape(kv_heads, rows * per, dim)
    s_s = torch.matmul(qs, ks[0].float().transpose(-1, -2)) * scale
    m_s = s_s.amax(-1, keepdim=True)
    e_s = torch.exp(s_s - m_s)
    z_s, o_s = e_s.sum(-1, keepdim=True), torch.matmul(e_s, vs[0].float())

    def rowwise(x: torch.Tensor) -> torch.Tensor:  # [kv_heads, rows * per, d] -> [rows, ...]
        return x.view(kv_heads, rows, per, x.shape[-1]).transpose(0, 1)

    m_s, z_s, o_s = rowwise(m_s), rowwise(z_s), rowwise(o_s)
    # own tokens: [rows, kv_heads, per, W - n]
    kr, vr = key[:, :, plan.n :].float(), value[:, :, plan.n :].float()
    s_r = torch.matmul(q, kr.transpose(-1, -2)) * scale + plan.bias[:, None, None, :]
    m_r = s_r.amax(-1, keepdim=True)  # finite: every row has its current token
    e_r = torch.exp(s_r - m_r)
    z_r, o_r = e_r.sum(-1, keepdim=True), torch.matmul(e_r, vr)
    m = torch.maximum(m_s, m_r)
    a_s, a_r = torch.exp(m_s - m), torch.exp(m_r - m)
    out = (o_s * a_s + o_r * a_r) / (z_s * a_s + z_r * a_r)  # [rows, kv_heads, per, dim]
    out = out.reshape(rows, heads, 1, dim).transpose(1, 2).to(query.dtype)
    return out.contiguous(), None


def _sliced_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = self.weight, self.bias
    return torch.cat(
        [
            torch.nn.functional.linear(
                x, w[s : s + _LOGIT_SLICE], None if b is None else b[s : s + _LOGIT_SLICE]
            )
            for s in range(0, w.shape[0], _LOGIT_SLICE)
        ],
        -1,
    )


def _slice_output_projection(model: Any) -> None:
    """On CPU, compute the vocabulary projection in slices of ``_LOGIT_SLICE`` rows.

    ``logits[:, j] = x @ W[j]`` for every slice: the same dot products, in matmuls whose
    results stay in cache. One ``[32, 576] x [576, 49152]`` matmul of the default model takes
    ~51 ms on a 2-core AVX2 CPU and ~31 ms in slices (``benchmarks/README.md``), a decode step
    ~280 ms. The module keeps its weight (tied or not) and its state dict; only the
    instance's ``forward`` changes, so weight updates load as before.
    """
    import types

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (
        type(head) is torch.nn.Linear
        and head.weight.device.type == "cpu"
        and head.out_features >= 4 * _LOGIT_SLICE
    ):
        head.forward = types.MethodType(_sliced_linear, head)  # type: ignore[method-assign]


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.24 names the KV-cache argument ``cache``; earlier: past_key_values."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _PrefixCache:
    """Keys and values of recently prefilled token sequences, for exact reuse.

    ``lookup`` finds the stored sequence sharing the longest prefix with the query and
    returns that many tokens of its keys and values (the KV of a prefix depends only on the
    prefix): a system prompt and tool list common to many episodes, or the previous turn of
    the same conversation (its prompt and the reply generated for it, stored when the
    request finishes), are computed once. Entries are evicted least recently used.
    Tensors are never modified in place (caches grow by concatenation), so entries are
    shared without copies. Whoever changes the weights must ``clear`` it.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]
        self._entries = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, ids: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        query = tuple(ids)
        best, best_key = 0, None
        for key in self._entries:
            n = common_prefix_len(query, key)
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in self._entries[best_key]]

    def store(self, ids: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.max_entries < 1 or not ids:
            return
        key = tuple(ids)
        self._entries[key] = [(k[:, :, : len(key)], v[:, :, : len(key)]) for k, v in kv]
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


@dataclass
class _Prefill:
    """One request of an admission round: its prefix and the cached part of it."""

    req: _Request
    prefix: list[int]
    hit: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def _batch_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class BatchLayer(DynamicLayer):
        """One layer of the batch's KV cache, in buffers with room to grow.

        Rows ``[0, rows)`` are the active requests; the live columns ``[start, end)`` hold
        their keys and values, left-padded (with zeros) to a common width. ``keys`` and
        ``values`` are views of that region, which the model reads. A decode step writes
        its column in place (``DynamicLayer`` concatenates, copying the whole batch's cache
        at every step); a joining request is written into the next free row; a retired row
        is refilled by the last row (:meth:`compact`). Buffers are reallocated (one copy)
        only when they run out of rows or columns.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.device, self.is_initialized = keys.device, True
            self.rows, self.start, self.end = 0, 0, 0
            self._kbuf = keys.new_zeros(0, *keys.shape[1:2], 0, keys.shape[3])
            self._vbuf = values.new_zeros(0, *values.shape[1:2], 0, values.shape[3])
            self.add_row(keys, values)

        def _view(self) -> None:
            self.keys = self._kbuf[: self.rows, :, self.start : self.end]
            self.values = self._vbuf[: self.rows, :, self.start : self.end]

        def _realloc(self, rows: int, left: int, right: int) -> None:
            """New buffers for ``rows`` rows with ``left`` free columns before the live
            region and ``right`` after it."""
            width = self.end - self.start
            k, v = self._kbuf, self._vbuf
            self._kbuf = k.new_zeros(rows, k.shape[1], left + width + right, k.shape[3])
            self._vbuf = v.new_zeros(rows, v.shape[1], left + width + right, v.shape[3])
            self._kbuf[: self.rows, :, left : left + width] = k[
                : self.rows, :, self.start : self.end
            ]
            self._vbuf[: self.rows, :, left : left + width] = v[
                : self.rows, :, self.start : self.end
            ]
            self.start, self.end = left, left + width

        def add_row(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Append a request's cache (``[1, H, L, D]``) as the last row."""
            n, width = keys.shape[-2], self.end - self.start
            full = self.rows == self._kbuf.shape[0]
            if full or self.end - n < 0:  # no free row, or too little room on the left
                rows = max(4, 2 * self._kbuf.shape[0]) if full else self._kbuf.shape[0]
                room = max(64, max(width, n) // 2)
                self._realloc(rows, left=max(0, n - width) + room, right=room)
            if self.end - n < self.start:  # wider than the others: they get zero padding
                self._kbuf[: self.rows, :, self.end - n : self.start] = 0
                self._vbuf[: self.rows, :, self.end - n : self.start] = 0
                self.start = self.end - n
            r = self.rows
            self._kbuf[r, :, self.start : self.end - n] = 0
            self._vbuf[r, :, self.start : self.end - n] = 0
            self._kbuf[r, :, self.end - n : self.end] = keys[0]
            self._vbuf[r, :, self.end - n : self.end] = values[0]
            self.rows += 1
            self._view()

        def compact(self, rows: int, moves: list[tuple[int, int]], trim: int) -> None:
            """Keep ``rows`` rows after copying row ``src`` to ``dst`` for each move, and
            drop ``trim`` leading columns (padding in every row)."""
            live = slice(self.start, self.end)
            for dst, src in moves:
                self._kbuf[dst, :, live] = self._kbuf[src, :, live]
                self._vbuf[dst, :, live] = self._vbuf[src, :, live]
            self.rows = rows
            self.start += trim
            self._view()

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            new = key_states.shape[-2]
            if self.end + new > self._kbuf.shape[2]:
                width = self.end - self.start
                self._realloc(self._kbuf.shape[0], self.start, max(64, width // 2) + new)
            self._kbuf[: self.rows, :, self.end : self.end + new] = key_states
            self._vbuf[: self.rows, :, self.end : self.end + new] = value_states
            self.end += new
            self._view()
            return (
                self._kbuf[: self.rows, :, self.start : self.end],
                self._vbuf[: self.rows, :, self.start : self.end],
            )

    return BatchLayer


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a ``[B, T]`` mask with zeros to ``width`` columns."""
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([torch.zeros(mask.shape[0], missing, dtype=mask.dtype), mask], 1)


def _truncate(logp: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logprobs of one row with top-k / top-p truncation (-inf outside)."""
    scores = logp
    if p.top_k and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, -1)
        # keep the smallest prefix whose mass reaches top_p (always keep the first)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores


def _sample_rows(scores: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """One token per row of ``scores`` ([B, V] logprobs, -inf = excluded) by inversion:
    token ``i`` is drawn when ``C[i-1] <= u * C[V-1] < C[i]``, where ``C`` is the running sum
    of ``exp(scores)`` in float64 and ``u`` is the row's uniform in [0, 1), so
    ``P(i) = exp(scores[i]) / sum_j exp(scores[j])``. One pass over the batch, where
    ``torch.multinomial`` row by row cost ~1 ms per row for a 49k-token vocabulary."""
    cdf = torch.exp(scores.double() - scores.max(-1, keepdim=True).values.double()).cumsum(-1)
    target = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total < total, so picked < V up to rounding; the clamp guards the last ulp
    return picked.clamp_(max=scores.shape[-1] - 1).tolist()
