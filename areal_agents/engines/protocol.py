"""The inference-engine protocol: token ids in, token ids + logprobs + versions out.

Every backend (the embedded transformers engine, a vLLM server, an SGLang server, the fake
engine used in tests and benchmarks) implements :class:`Engine`. The proxy talks to nothing
else, so it never needs torch.

Logprob convention (shared with the trainer):

    logprob_t = log_softmax(logits_t / T)[token_t]         (T = temperature; T = 1 when T == 0)

computed in float32 over the full vocabulary, *before* top-k / top-p truncation, so that the
trainer recomputes exactly this quantity with one forward pass and the same temperature.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
KvOnUpdate = Literal["recompute", "keep"]
"""What a weight update does with the KV caches of requests in flight: recompute drops
them (each request is prefilled again with the new weights), keep decodes on from them
(the embedded engine only; see ``areal_agents.engines.embedded``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    max_new_tokens: int = 256
    """Upper bound on generated tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after sampling one of these (it is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Generation ends once the decoded output contains one of these strings."""
    seed: int | None = None
    """Seed of this request's private random generator (None: nondeterministic)."""
    top_logprobs: int = 0
    """How many most likely alternatives to report per output token (0-20)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclass
class GenerateResult:
    """The outcome of one generation request."""

    output_ids: list[int]
    """Sampled token ids, in order, including a final stop token when one ended generation."""
    output_logprobs: list[float]
    """Logprob of each sampled token (see the module docstring for the convention)."""
    output_versions: list[int]
    """Policy version of the weights that sampled each token."""
    finish_reason: FinishReason
    """"stop" (stop token or string), "length" (max_new_tokens), "abort" (engine shut down)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation, if any."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per output token, the most likely (token id, logprob) pairs when requested."""
    prompt_tokens: int = 0
    queue_s: float = 0.0
    """Seconds between submission and the first scheduled forward pass."""
    latency_s: float = 0.0
    """Seconds from submission to completion."""
    interruptions: int = 0
    """How many weight updates interrupted this request while it was generating."""


@dataclass(frozen=True)
class WeightUpdate:
    """New weights for the engine.

    Exactly one of ``state_dict`` (tensors in memory) or ``path`` (a HF model directory or a
    saved peft adapter directory) is given. ``kind="lora"`` loads adapter weights only; the
    first LoRA update also needs ``lora_config`` (a ``peft.LoraConfig``) unless ``path`` holds
    an ``adapter_config.json``.
    """

    kind: Literal["full", "lora"] = "full"
    state_dict: Any = None
    path: str | None = None
    lora_config: Any = None
    version: int | None = None
    """The policy version the new weights carry; default: current version + 1."""


@runtime_checkable
class Engine(Protocol):
    """What every inference backend provides. All methods are coroutine functions and safe
    to call from the proxy's event loop (they never block it).

    ``generate`` may take a keyword-only ``route_key`` (the proxy passes the session id):
    an engine with several replicas sends every call with the same key to the same replica,
    so a session's growing prompt keeps hitting that replica's prefix cache. Engines with
    one replica accept and ignore it. The proxy passes it only to engines whose ``generate``
    accepts it (see :func:`accepts_route_key`), so engines written without it keep working.
    """

    model_name: str

    @property
    def version(self) -> int: ...

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> GenerateResult: ...

    async def update_weights(self, update: WeightUpdate) -> int: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def accepts_route_key(engine: Any) -> bool:
    """Whether ``engine.generate`` takes the ``route_key`` keyword (or ``**kwargs``)."""
    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "route_key" or p.kind is p.VAR_KEYWORD for p in params)
