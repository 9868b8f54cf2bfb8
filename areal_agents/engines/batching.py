"""The embedded engine's worker: continuous batching on one device, in a thread.

Every active request holds a row of one batched KV cache (left-padded to a common length),
kept in preallocated buffers (:mod:`areal_agents.engines.kv_cache`). Each loop iteration the
worker

1. runs queued control commands (weight update, pause, resume, abort) between forward
   passes;
2. admits waiting requests up to ``max_batch_size``: their longest cached prefixes are
   looked up and the rest prefilled together, in chunks of similar length, and each
   request's cache row joins the batch, so a request that arrives while others decode joins
   at the next step instead of waiting for the batch to finish;
3. runs one batched decode step for all active rows, samples one token per row with that
   row's own sampling parameters and random generator
   (:mod:`areal_agents.engines.sampling`), and retires finished rows.

The worker thread owns the model; :class:`~areal_agents.engines.embedded.EmbeddedEngine`'s
methods only enqueue work and await futures, so the event loop is never blocked by a
forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_agents import spans
from areal_agents.engines.attention import cascade, cascade_plan
from areal_agents.engines.kv_cache import (
    KV,
    PrefixCache,
    SharedPrefix,
    batch_layer_class,
    cache_kwarg,
    cache_of,
    dynamic_cache,
    empty_cache,
    left_pad,
)
from areal_agents.engines.protocol import GenerateResult, KvOnUpdate, SamplingParams, WeightUpdate
from areal_agents.engines.sampling import sample
from areal_agents.engines.weights import MergedLora, apply_weight_update
from areal_agents.errors import BackendError
from areal_agents.trajectory import common_prefix_len

log = logging.getLogger(__name__)

DecodeFn = Callable[[list[int]], str]
"""Token ids to text (the tokenizer's ``decode``), for stop strings."""

_SHARE_MIN_TOKENS = 32
"""A request waits for the next admission round when an earlier request of this round will
compute at least this many more of its prefix than the cache holds."""


@dataclass(eq=False)
class Request:
    """One generation request, from its submission until it finishes."""

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


@dataclass
class Prefill:
    """One request of an admission round: its prefix and the cached part of it."""

    req: Request
    prefix: list[int]
    hit: int
    kv: KV


class BatchingWorker:
    """The worker side of :class:`~areal_agents.engines.embedded.EmbeddedEngine` (see the
    module docstring): its state, and the thread that owns ``model``, started last."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: Sequence[int],
        decode: DecodeFn | None,
        max_batch_size: int,
        max_context: int,
        version: int,
        compute_lock: Any,
        prefix_cache_entries: int,
        merged_lora: MergedLora | None,
        kv_on_update: KvOnUpdate,
        cpu_time_spans: bool,
    ) -> None:
        self.kv_on_update = kv_on_update
        self.cpu_time_spans = cpu_time_spans
        """Record each prefill / decode span only as long as the CPU time this process
        spent in it (per torch thread), from its start: for an engine that shares its
        cores at the idle priority, whose wall time includes the time others had them."""
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self._decode = decode
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self._version = version
        self._device = next(model.parameters()).device
        self._cache_kwarg = cache_kwarg(model)
        # Shared with a trainer in the same process on CPU: two OpenMP teams on the same
        # cores slow both down many times over, so forward passes take turns.
        self._compute = spans.TimedLock(compute_lock, "engine")
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._commands: queue.Queue[tuple[str, Any, asyncio.Future[Any], Any]] = queue.Queue()
        self._wake = threading.Event()
        self._waiting: list[Request] = []
        self._active: list[Request] = []
        self._cache: Any = None  # batched DynamicCache for self._active
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left pad
        self._shared: SharedPrefix | None = None  # the cached tokens every row starts with
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
        self._prefixes = PrefixCache(prefix_cache_entries)
        # LoRA updates of a float32 model are merged into its weights (weights.MergedLora)
        self._lora = merged_lora or MergedLora()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()

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

    def _drain_all(self) -> list[Request]:
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
            jobs: list[Prefill] = []
            later: list[Request] = []
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
                jobs.append(Prefill(req, prefix, hit, kv))
            self._waiting = later
            again = any(j.req.out_ids for j in jobs)  # requests a weight update interrupted
            with self._timed("reprefill" if again else "prefill", rows=len(jobs)):
                caches = self._prefill_many(jobs)
            for job, cache in zip(jobs, caches, strict=True):
                self._join(job.req, cache, len(job.prefix))

    def _prefill_many(self, jobs: list[Prefill]) -> list[Any]:
        """The KV caches of the jobs' prefixes, each continuing its cached prefix (computed
        by the current weights: the cache is cleared on every weight update).

        A fully cached prefix needs no forward pass. The others are prefilled in chunks of
        similar length, one forward pass per chunk: the cached keys and values left-padded to
        a common width, the new tokens right-padded, a padding mask and every token at its
        own position; each row's keys and values are then cut out of the chunk's cache. A
        chunk admits a row while its padding stays under half of its real tokens.
        """
        out: dict[int, Any] = {}
        todo = []
        for i, job in enumerate(jobs):
            self._stats["prefix_hit_tokens"] += job.hit
            if not job.prefix:
                out[i] = empty_cache(self.model, self._device)
            elif job.hit == len(job.prefix):  # e.g. a group's identical prompts: no forward
                self._stats["prefix_full_hits"] += 1
                out[i] = dynamic_cache(job.kv)  # joining copies it
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

    def _forward_chunk(self, jobs: list[Prefill]) -> list[Any]:
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
            kwargs[self._cache_kwarg] = dynamic_cache(past)
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
        layers = cache_of(res).layers
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
            caches.append(dynamic_cache(kv))
        return caches

    def _join(self, req: Request, cache: Any, length: int) -> None:
        """Add a prefilled request as the batch's last row (its keys and values are copied
        into the batch buffers, right-aligned: rows are left-padded to a common width)."""
        row = torch.ones(1, length, dtype=torch.long)
        ids = (req.prompt_ids + req.out_ids)[:-1]
        if self._cache is None or self._shared is None:
            # the row's own tensors: never modified in place (the batch copies them)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            self._shared = SharedPrefix(ids, kv, length)
        else:
            self._shared.length = common_prefix_len(ids, self._shared.ids[: self._shared.length])
        if self._cache is None:
            batch_layer = batch_layer_class()
            cache.layers = [batch_layer(layer.keys, layer.values) for layer in cache.layers]
            self._cache, self._mask, self._active = cache, row, [req]
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], length)
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.add_row(theirs.keys, theirs.values)
        self._mask = torch.cat([left_pad(self._mask, width), left_pad(row, width)])
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
        self._cache = cache_of(out)
        rows = self._active
        tokens, logps, tops = sample(
            out.logits[:, -1, :].float(), [r.params for r in rows], [r.generator for r in rows]
        )
        self._after_step(tokens, logps, tops)

    def _model_step(self, last: torch.Tensor, positions: torch.Tensor) -> Any:
        assert self._mask is not None
        plan = cascade_plan(self.model, self._shared, self._mask, self._device)
        if plan is not None:
            self._stats["cascade_steps"] += 1
        with cascade(plan):
            return self.model(
                input_ids=last,
                attention_mask=self._mask.to(self._device),
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: self._cache},
            )

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

    def _remember(self, row: int, req: Request) -> None:
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

    def _finished(self, req: Request, tok: int) -> tuple[str, int | str | None] | None:
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
