"""Several replicas of one model behind one engine, with session-sticky routing.

:class:`RoutedEngine` is itself an :class:`~areal_agents.engines.protocol.Engine`. A call with a
``route_key`` (the proxy passes the session id) goes to the replica that served that key
before, so a multi-turn session's growing prompt keeps hitting one prefix cache; a new key,
or a call without one, goes to the replica with the fewest requests in flight (ties:
round robin). Weight updates, pause, resume and close go to every replica; all replicas
carry the same policy version. A key is remembered until ``max_keys`` newer keys have been
seen (least recently used first).

Example::

    engine = RoutedEngine([VLLMEngine.connect(u) for u in urls])
    proxy = Proxy(engine, tokenizer)          # sessions stick to one server each
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from areal_agents.engines.protocol import (
    Engine,
    GenerateResult,
    SamplingParams,
    WeightUpdate,
    accepts_route_key,
)
from areal_agents.engines.weight_files import StagingArea
from areal_agents.errors import UserError

if TYPE_CHECKING:
    from areal_agents.engines.weights import LoraMerger  # it loads torch: not at import


class RoutedEngine:
    """Replicas of one model as one engine; see the module docstring."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_keys: int = 100_000,
        staging_dir: str | None = None,
    ) -> None:
        if not engines:
            raise UserError("RoutedEngine needs at least one engine")
        names = {e.model_name for e in engines}
        if len(names) > 1:
            raise UserError(f"the replicas serve different models: {sorted(names)}")
        self.engines = list(engines)
        self.model_name = self.engines[0].model_name
        contexts = [getattr(e, "max_context", None) for e in self.engines]
        known = [int(c) for c in contexts if c]
        self.max_context = min(known) if known else None
        self.max_keys = max_keys
        self.merger: LoraMerger | None = None
        """Set: LoRA updates are merged into full weights once and every replica loads
        them (see :class:`~areal_agents.engines.weights.LoraMerger`)."""
        self._keys: OrderedDict[str, int] = OrderedDict()
        self._load = [0] * len(self.engines)
        self._next = 0
        self._version = max(e.version for e in self.engines)
        self._forward_key = [accepts_route_key(e) for e in self.engines]
        self._staging = StagingArea(staging_dir, prefix="areal-routed-")

    @property
    def version(self) -> int:
        return self._version

    def replica_for(self, route_key: str | None) -> int:
        """The index of the replica that serves ``route_key`` (choosing one if new)."""
        if route_key is not None and route_key in self._keys:
            self._keys.move_to_end(route_key)
            return self._keys[route_key]
        n = len(self.engines)
        order = [(self._next + i) % n for i in range(n)]
        index = min(order, key=lambda i: self._load[i])
        self._next = (index + 1) % n
        if route_key is not None:
            self._keys[route_key] = index
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        return index

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        index = self.replica_for(route_key)
        engine = self.engines[index]
        self._load[index] += 1
        try:
            if self._forward_key[index]:
                return await engine.generate(prompt_ids, params, route_key=route_key)  # type: ignore[call-arg]
            return await engine.generate(prompt_ids, params)
        finally:
            self._load[index] -= 1

    async def update_weights(self, update: WeightUpdate) -> int:
        """Update every replica to the same version (an in-memory update is written to
        files once, then every replica loads the same directory)."""
        version = update.version if update.version is not None else self._version + 1
        staged = update
        if self.merger is not None and update.kind == "lora":  # merged once, for every replica
            staged = await asyncio.to_thread(self.merger.full_update, update)
        if staged.state_dict is not None and len(self.engines) > 1:
            staged = await asyncio.to_thread(self._staging.stage, staged)
        staged = dataclasses.replace(staged, version=version)
        try:
            await asyncio.gather(*[e.update_weights(staged) for e in self.engines])
        except BaseException:
            self._staging.discard(staged)
            raise
        self._staging.commit(staged)
        self._version = version
        return version

    @property
    def failure(self) -> Exception | None:
        """The first replica's error that ended it (a server that died too often), or None."""
        for e in self.engines:
            failed = getattr(e, "failure", None)
            if failed is not None:
                return failed  # type: ignore[no-any-return]
        return None

    async def pause(self) -> None:
        await asyncio.gather(*[e.pause() for e in self.engines])

    async def resume(self) -> None:
        await asyncio.gather(*[e.resume() for e in self.engines])

    async def health(self) -> dict[str, Any]:
        replicas = await asyncio.gather(*[e.health() for e in self.engines])
        statuses = {r.get("status") for r in replicas}
        status = next((s for s in ("error", "closed", "paused") if s in statuses), "ok")
        totals = {
            k: sum(r[k] for r in replicas)
            for k in ("requests", "output_tokens", "interruptions", "updates", "restarts")
            if all(isinstance(r.get(k), int | float) for r in replicas)
        }
        return {
            **totals,
            "status": status,
            "backend": "routed",
            "model": self.model_name,
            "version": self._version,
            "sessions": len(self._keys),
            "in_flight": list(self._load),
            "replicas": replicas,
        }

    async def close(self) -> None:
        await asyncio.gather(*[e.close() for e in self.engines])
        self._staging.close()
