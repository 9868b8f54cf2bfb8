"""The server-independent parts of the remote engines: the logprob check, stop strings
across an interruption, and SGLang's documented response shapes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from areal_agents.engines.protocol import GenerateResult, SamplingParams, WeightUpdate
from areal_agents.engines.remote import (
    RemoteEngine,
    Segment,
    ServerRejected,
    _cut_at_stop_string,
    int_label,
)
from areal_agents.engines.sglang import _segment as sglang_segment
from areal_agents.errors import BackendError, UserError


class Scripted(RemoteEngine):
    """A remote engine whose 'server' reports the logprob of the best token as ``report``."""

    def __init__(self, report: Any) -> None:
        super().__init__("http://unused", model_name="m", max_context=100)
        self.report = report

    async def _submit(self, prompt: list[int], params: SamplingParams, n: int) -> Segment:
        value = self.report(params.temperature)
        return Segment([5], [value], [None], "length", top=[[(5, value)]])


def _best_logprob(temperature: float) -> float:
    """log_softmax(logits / T) of the best of three logits."""
    logits = [2.0, 1.0, 0.0]
    return logits[0] / temperature - math.log(sum(math.exp(x / temperature) for x in logits))


async def test_the_logprob_check_accepts_temperature_scaled_logprobs() -> None:
    await Scripted(_best_logprob).check_logprob_convention("fix")


@pytest.mark.parametrize(
    ("report", "kind"),
    [
        (lambda t: _best_logprob(1.0), "ignore the temperature"),
        (lambda t: 2.0 / t, "logits, not logprobs"),
        (lambda t: -2.0 / t, "logits, not logprobs"),
    ],
)
async def test_the_logprob_check_refuses_other_quantities(report: Any, kind: str) -> None:
    with pytest.raises(UserError, match=f"{kind}; start it right"):
        await Scripted(report).check_logprob_convention("start it right")


def _result(ids: list[int]) -> GenerateResult:
    n = len(ids)
    return GenerateResult(ids, [-1.0] * n, [0] * (n // 2) + [1] * (n - n // 2), "length")


class RefusedOnceAfterAnUpdate(RemoteEngine):
    """A server that, while the request is on the wire, sees a weight update begin and then
    refuses the request for naming the weights the update replaced."""

    def __init__(self) -> None:
        super().__init__("http://unused", model_name="m", max_context=100)
        self.sent: list[list[int]] = []

    async def _submit(self, prompt: list[int], params: SamplingParams, n: int) -> Segment:
        self.sent.append(prompt)
        if len(self.sent) == 1:
            self._interrupt_epoch += 1  # an update started meanwhile
            raise ServerRejected("the adapter areal-lora-v1 is not loaded")
        return Segment([7, 8], [-0.1, -0.2], [2, 2], "length")


async def test_a_request_refused_after_an_update_began_is_sent_again() -> None:
    engine = RefusedOnceAfterAnUpdate()
    result = await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    assert result.output_ids == [7, 8] and result.output_versions == [2, 2]
    assert result.interruptions == 1 and engine.sent == [[1, 2], [1, 2]]


class Refused(RemoteEngine):
    def __init__(self) -> None:
        super().__init__("http://unused", model_name="m", max_context=100)

    async def _submit(self, prompt: list[int], params: SamplingParams, n: int) -> Segment:
        raise ServerRejected("max_tokens must be positive")


async def test_a_request_refused_without_an_update_is_the_callers_error() -> None:
    with pytest.raises(ServerRejected, match="must be positive"):
        await Refused().generate([1, 2], SamplingParams(max_new_tokens=2))


def test_a_stop_string_across_an_interruption_cuts_the_output() -> None:
    decode = "".join  # token ids are characters here
    res = _result(list("abcSTOPdef"))  # type: ignore[arg-type]
    _cut_at_stop_string(res, ["STOP", "zz"], decode)  # type: ignore[arg-type]
    assert "".join(res.output_ids) == "abcSTOP"  # type: ignore[arg-type]
    assert res.finish_reason == "stop" and res.stop_reason == "STOP"
    assert len(res.output_logprobs) == len(res.output_versions) == 7
    untouched = _result(list("abcdef"))  # type: ignore[arg-type]
    _cut_at_stop_string(untouched, ["STOP"], decode)  # type: ignore[arg-type]
    assert untouched.finish_reason == "length" and len(untouched.output_ids) == 6


def test_version_labels() -> None:
    assert int_label("12") == 12 and int_label(3) == 3
    assert int_label("default") is None and int_label(None) is None


SGLANG_STOP = {
    "text": "Paris",
    "output_ids": [12095, 151645],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 9,
        "weight_version": "4",
        "completion_tokens": 2,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25, 12095, None], [-0.5, 151645, None]],
        "output_top_logprobs": [[[-0.25, 12095, None]], [[-0.5, 151645, None]]],
    },
}


def test_sglang_answers_are_read_as_documented() -> None:
    seg = sglang_segment(SGLANG_STOP)
    assert seg.ids == [12095, 151645] and seg.logprobs == [-0.25, -0.5]
    assert seg.finish == "stop" and seg.stop_reason == 151645
    assert seg.versions == [4, 4] and seg.top == [[(12095, -0.25)], [(151645, -0.5)]]
    length = {
        **SGLANG_STOP,
        "meta_info": {**SGLANG_STOP["meta_info"], "finish_reason": {"type": "length", "length": 2}},
    }
    assert sglang_segment(length).finish == "length" and sglang_segment(length).stop_reason is None


def test_a_refusal_shows_the_servers_own_message() -> None:
    import httpx

    from areal_agents.engines.remote import _error_message

    sglang = {"success": False, "error_message": "LoRA adapter x is not loaded"}
    assert _error_message(httpx.Response(400, json=sglang)) == "LoRA adapter x is not loaded"
    openai = {"error": {"message": "bad max_tokens", "type": "BadRequestError"}}
    assert _error_message(httpx.Response(400, json=openai)) == "bad max_tokens"
    assert _error_message(httpx.Response(404, json={"detail": "Not Found"})) == "Not Found"


def test_sglang_errors_are_named() -> None:
    meta = SGLANG_STOP["meta_info"]
    rejected = {
        **SGLANG_STOP,
        "meta_info": {
            **meta,
            "finish_reason": {"type": "abort", "message": "bad input", "status_code": 400},
        },
    }
    with pytest.raises(ValueError, match="rejected the request: bad input"):
        sglang_segment(rejected)
    mismatch = {**SGLANG_STOP, "output_ids": [1, 2]}
    with pytest.raises(BackendError, match="do not match"):
        sglang_segment(mismatch)
    with pytest.raises(BackendError, match="unexpected SGLang response"):
        sglang_segment({"text": "x"})


class Recording(RemoteEngine):
    """Its first request is aborted by a weight update while the server dies (a restart
    begins); then it records whether a swap was in progress when each request was sent."""

    def __init__(self) -> None:
        super().__init__("http://unused", model_name="m", max_context=100)
        self.sent_while_swapping: list[bool] = []

    async def _submit(self, prompt: list[int], params: SamplingParams, n: int) -> Segment:
        if not self._restart_lock.locked() and not self.sent_while_swapping and n == 2:
            self._interrupt_epoch += 1  # an update began: the request is aborted ...
            self._restart_lock.acquire()  # ... and the server died: a restart is under way
            return Segment([5], [-0.2], [1], "abort")
        self.sent_while_swapping.append(self._swapping)
        return Segment([7], [-0.1], [2], "length")


async def test_a_request_waiting_for_a_restart_is_not_sent_into_a_swap() -> None:
    """An interrupted request waits while the server restarts; the restart ends and a weight
    swap begins before the request wakes up. It must wait for the swap too: sent during it,
    vLLM binds it to the old adapter and it runs on the old weights under the new version's
    label (seen as mismatch/kl 2.9e-3 on a restarted vLLM run)."""
    import asyncio

    engine = Recording()
    request = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.05)  # aborted, now waiting for the restart
    assert engine._restart_lock.locked() and engine.sent_while_swapping == []
    engine._swapping = True  # the restart is done and an update's swap begins at once
    engine._restart_lock.release()
    await asyncio.sleep(0.15)
    assert not request.done() and engine.sent_while_swapping == []
    engine._swapping = False
    result = await asyncio.wait_for(request, 5)
    assert result.output_ids == [5, 7] and engine.sent_while_swapping == [False]


class _NoStaging:
    def commit(self, staged: Any) -> None: ...
    def discard(self, staged: Any) -> None: ...
    def close(self) -> None: ...


class _DeadServer:
    """A server process that died; ``restart`` brings it back."""

    exit_code = -9
    log_path = "server.log"

    def __init__(self, events: list[str]) -> None:
        self.running = False
        self.events = events

    def restart(self, timeout_s: float) -> None:
        self.events.append("restart")
        self.running = True

    def tail(self, n: int) -> str:
        return ""


class Loading(RemoteEngine):
    """Records the server calls of weight loads and restarts, in order; a load can be held
    open (``gate``) to let a restart begin while it runs."""

    def __init__(self) -> None:
        super().__init__("http://unused", model_name="m", max_context=100, max_restarts=1)
        self._staging = _NoStaging()  # type: ignore[assignment]
        self.events: list[str] = []
        self.gate: Any = None
        self.restart_while_staging = False

    def _stage(self, update: WeightUpdate) -> WeightUpdate:
        if self.restart_while_staging:  # the server dies while the files are staged
            self._restart_lock.acquire()
        return update

    async def _pause_server(self, mode: str) -> None:  # type: ignore[override]
        self.events.append("pause")

    async def _resume_server(self) -> None:
        self.events.append("resume")

    async def _load_lora(self, path: str, version: int) -> None:
        self.events.append(f"load {path}")
        if self.gate is not None:
            await self.gate.wait()
        self.events.append(f"label {version}")


async def test_a_weight_swap_waits_for_a_restart_under_way() -> None:
    """An update reaches the engine while its dead server restarts. Its swap must wait for
    the restart, whose reload of the previous weights would otherwise land between the new
    load and its label: the old weights served under the new version (seen as
    mismatch/kl 2.9e-3 on a restarted vLLM run)."""
    import asyncio

    engine = Loading()
    engine._loaded = WeightUpdate(kind="lora", path="v1")
    engine._version = 1
    engine.restart_while_staging = True  # the update passed the restart check, then staged
    update = asyncio.create_task(engine.update_weights(WeightUpdate(kind="lora", path="v2")))
    await asyncio.sleep(0.2)
    assert engine._restart_lock.locked()
    assert not update.done() and engine.events == []
    engine._restart_lock.release()
    assert await asyncio.wait_for(update, 5) == 2
    assert engine.events == ["pause", "load v2", "label 2", "resume"]


async def test_a_restart_waits_for_a_weight_swap_under_way() -> None:
    """The other order: the server dies while a swap runs; the restart that a failed request
    begins waits for the swap to end before it reloads the weights it knows."""
    import asyncio

    engine = Loading()
    engine.server = _DeadServer(engine.events)  # type: ignore[assignment]
    engine._loaded = WeightUpdate(kind="lora", path="v1")
    engine._version = 1
    engine.gate = asyncio.Event()
    update = asyncio.create_task(engine.update_weights(WeightUpdate(kind="lora", path="v2")))
    await asyncio.sleep(0.05)  # the swap is loading v2
    recover = asyncio.create_task(engine._recover())
    await asyncio.sleep(0.2)
    assert "restart" not in engine.events
    engine.gate.set()
    await asyncio.wait_for(asyncio.gather(update, recover), 5)
    assert engine.events == [
        "pause", "load v2", "label 2", "resume", "restart", "load v2", "label 2",
    ]  # fmt: skip
