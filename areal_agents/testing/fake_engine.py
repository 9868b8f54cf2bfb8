"""An instant, scripted engine for tests and proxy benchmarks (no torch, no model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from areal_agents.engines.protocol import GenerateResult, SamplingParams, WeightUpdate

Script = Callable[[list[int], SamplingParams], list[int]]


class FakeEngine:
    """Answers every request at once with token ids chosen by ``script``.

    ``script(prompt_ids, params)`` returns the output ids; the default echoes the last few
    prompt tokens. Logprobs are a constant ``-0.5``; versions are the current version. The
    optional ``delay_s`` simulates model time without blocking the event loop.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        model_name: str = "fake",
        eos_token_id: int | None = None,
        delay_s: float = 0.0,
        max_context: int = 32768,
    ) -> None:
        self.model_name = model_name
        self.max_context = max_context
        self._script = script or (lambda ids, p: list(ids[-min(len(ids), p.max_new_tokens) :]))
        self._eos = eos_token_id
        self._delay_s = delay_s
        self._version = 0
        self._paused = asyncio.Event()
        self._paused.set()
        self.calls = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        start = time.perf_counter()
        await self._paused.wait()
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        self.calls += 1
        out = list(self._script(list(prompt_ids), params))[: params.max_new_tokens]
        stop_ids = set(params.stop_token_ids) | ({self._eos} if self._eos is not None else set())
        finish, reason = "length", None
        for i, tok in enumerate(out):
            if tok in stop_ids:
                out, finish, reason = out[: i + 1], "stop", tok
                break
        return GenerateResult(
            output_ids=out,
            output_logprobs=[-0.5] * len(out),
            output_versions=[self._version] * len(out),
            finish_reason=finish,  # type: ignore[arg-type]
            stop_reason=reason,
            prompt_tokens=len(prompt_ids),
            latency_s=time.perf_counter() - start,
            # asked for alternatives: the sampled token is each position's only one
            top_logprobs=[[(t, -0.5)] for t in out] if params.top_logprobs else [],
        )

    async def update_weights(self, update: WeightUpdate) -> int:
        self._version = update.version if update.version is not None else self._version + 1
        return self._version

    async def pause(self) -> None:
        self._paused.clear()

    async def resume(self) -> None:
        self._paused.set()

    async def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self._paused.is_set() else "paused",
            "backend": "fake",
            "model": self.model_name,
            "version": self._version,
            "calls": self.calls,
        }

    async def close(self) -> None:
        self._paused.set()
