"""What the engines backed by an inference server (vLLM, SGLang) share.

A subclass says how to send one generation request and how to pause, resume and load
weights on its server; :class:`RemoteEngine` turns that into the
:class:`~areal_agents.engines.protocol.Engine` protocol:

- **Interruptible generation.** A weight update pauses the server in *abort* mode: every
  request in flight returns at once with the tokens it has (finish reason "abort"), the
  weights are loaded, the server's version label is set, and the server resumes. Each
  interrupted request is then sent again as prompt + tokens so far, for the tokens it still
  may generate, so later tokens are sampled by the new weights from a freshly computed KV
  cache (as the embedded engine does). The caller sees one result with ``interruptions``
  counted.
- **Versions from the server.** The server labels the tokens it generates with its weight
  version (vLLM per token span, SGLang per response); the engine sets that label to its
  integer version at every update, so a request that reaches the server while it is paused
  is tagged with the version that actually ran it.
- **Stop strings across an interruption.** The server only sees the text generated after
  the resubmission, so a stop string spanning the boundary is checked here (when a
  ``decode`` function is given) and the output cut where it first appears.
- **Checked weight files.** In-memory updates are written as files first
  (:mod:`areal_agents.engines.weight_files`) and every directory is checked against the served
  checkpoint before the server loads it.
- **Clear errors.** The server rejecting a request (HTTP 4xx) raises ``ValueError`` with the
  server's message; an unreachable or failing server raises
  :class:`~areal_agents.errors.BackendError`, with the tail of its log when this process
  started it.
- **Restarts.** A server this process started that dies (``max_restarts`` > 0) is started
  again with the same command; before it takes requests it gets the current version label
  and reloads the weights last loaded (the newest directory of the staging area stays for
  that). Requests in flight when it died fail with ``BackendError`` (their episodes end as
  ``backend_error``); requests that arrive during the restart wait for it; a weight update
  that met the dead server is loaded again on the new one. After ``max_restarts`` restarts
  the next death is final: :attr:`RemoteEngine.failure` holds the error, and every call
  raises it.

The engine holds no state bound to one event loop: HTTP clients are made per loop, so the
same engine can serve the proxy's loop and be closed from another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import httpx

from areal_agents.engines.launch import Server, ServerProcess
from areal_agents.engines.protocol import FinishReason, GenerateResult, SamplingParams, WeightUpdate
from areal_agents.engines.weight_files import (
    StagingArea,
    check_adapter_dir,
    check_same_tensors,
    tied_embeddings,
)
from areal_agents.errors import BackendError, ContextOverflow, UserError

if TYPE_CHECKING:
    from areal_agents.engines.weights import LoraMerger  # it loads torch: not at import

log = logging.getLogger(__name__)

DecodeFn = Callable[[Sequence[int]], str]


@dataclass
class Segment:
    """One server response: what a single (possibly resumed) request produced."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int | None]
    """Per token, the version label the server reported (None: no label)."""
    finish: FinishReason
    stop_reason: int | str | None = None
    top: list[list[tuple[int, float]]] = field(default_factory=list)


class ServerRejected(ValueError):
    """The server answered a request with HTTP 4xx (the message is the server's)."""


class RemoteEngine:
    """Base of the server-backed engines; see the module docstring."""

    backend: ClassVar[str] = "remote"
    context_margin: ClassVar[int] = 0
    """Tokens to keep free: the server refuses prompt + max new tokens > context - margin."""

    def __init__(
        self,
        url: str,
        *,
        model_name: str,
        max_context: int,
        model_dir: str | None = None,
        server: Server | None = None,
        decode: DecodeFn | None = None,
        request_timeout_s: float = 3600.0,
        staging_dir: str | None = None,
        max_restarts: int = 0,
        restart_timeout_s: float = 900.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.max_context = int(max_context)
        self.model_dir = model_dir
        self.server: Server | None = server
        self.decode = decode
        self.request_timeout_s = request_timeout_s
        self._version = 0
        self._staging = StagingArea(staging_dir, prefix=f"areal-{self.backend}-")
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}
        # Bumped when an update or a pause starts: a request that then comes back
        # aborted was interrupted by us, and is sent again.
        self._interrupt_epoch = 0
        self._updating = False
        self._swapping = False  # paused for a weight load: requests wait to be sent
        self._loading = False  # a weight load (a swap) is under way: a restart waits
        self._user_paused = False
        self._hold_new = False  # drain mode (servers that cannot pause): new requests wait
        self._in_flight = 0
        self._closed = False
        self._stats = {
            "requests": 0,
            "output_tokens": 0,
            "interruptions": 0,
            "updates": 0,
            "restarts": 0,
        }
        self.max_restarts = max_restarts
        """Restarts of a dead server (one this process started) before the engine gives up."""
        self.restart_timeout_s = restart_timeout_s
        self._restart_lock = threading.Lock()
        self._failure: BackendError | None = None
        self._loaded: WeightUpdate | None = None  # the files last loaded, for a restart
        self.merger: LoraMerger | None = None
        """Set: LoRA updates are merged into full weights here and sent whole (see
        :class:`~areal_agents.engines.weights.LoraMerger`)."""
        self.vocab_size = _vocab_size(model_dir)
        self._tied = tied_embeddings(model_dir) if model_dir else False

    # ------------------------------------------------------------------ to implement
    async def _submit(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int
    ) -> Segment:
        raise NotImplementedError

    async def _pause_server(self, mode: Literal["abort", "hold"]) -> None:
        """Stop scheduling. "abort": return in-flight requests now; "hold": freeze them."""
        raise NotImplementedError

    async def _resume_server(self) -> None:
        raise NotImplementedError

    async def _load_full(self, path: str, version: int) -> None:
        """Load full weights from ``path`` and label the server with ``version``."""
        raise NotImplementedError

    async def _load_lora(self, path: str, version: int) -> None:
        """Load a LoRA adapter from ``path``, use it from now on, label with ``version``."""
        raise NotImplementedError

    @classmethod
    def _start_and_connect(
        cls,
        argv: list[str],
        *,
        url: str,
        log_path: Any,
        env: Mapping[str, str] | None,
        timeout_s: float,
        name: str,
        model: str,
        decode: DecodeFn | None,
        cpus: Sequence[int] | None = None,
    ) -> Self:
        """Start the server process (on ``cpus``), attach to it with the subclass's
        ``connect``, and stop the process again when attaching fails."""
        server = ServerProcess.start(
            argv, url=url, log_path=log_path, env=env, timeout_s=timeout_s, name=name, cpus=cpus
        )
        try:
            engine: Self = cls.connect(  # type: ignore[attr-defined]
                url, model_dir=model, decode=decode, _server=server
            )
            return engine
        except BaseException:
            server.stop()
            raise

    @property
    def can_pause(self) -> bool:
        """Whether the server can abort and hold requests (else updates drain first)."""
        return True

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        """Generate from ``prompt_ids``; ``route_key`` is ignored (one server)."""
        prompt = self._check_prompt(prompt_ids)
        start = time.perf_counter()
        await self._wait_restarted()
        while self._hold_new and not self._closed:
            await asyncio.sleep(0.01)
        self._in_flight += 1
        try:
            return await self._generate(prompt, params, start)
        except BackendError as exc:
            if not self._server_died():
                raise
            await self._recover()
            raise BackendError(
                f"the {self.backend} server at {self.url} died while this request ran "
                f"(restarted, restart {self._stats['restarts']} of {self.max_restarts}): {exc}"
            ) from None
        finally:
            self._in_flight -= 1

    async def update_weights(self, update: WeightUpdate) -> int:
        """Load new weights (full or LoRA) and return the new policy version.

        Requests in flight are interrupted and resumed on the new weights (see the module
        docstring); on a server that cannot pause, new requests wait and those in flight
        finish first.
        """
        self._check_open()
        await self._wait_restarted()
        while self._updating:  # one update at a time
            await asyncio.sleep(0.01)
        self._updating = True
        try:
            staged = await asyncio.to_thread(self._stage, update)
            new_version = update.version if update.version is not None else self._version + 1
            try:
                try:
                    await self._swapped(lambda: self._load_staged(staged, new_version))
                except BackendError:
                    if not self._server_died():
                        raise
                    await self._recover()  # the old weights again, then the new ones
                    await self._swapped(lambda: self._load_staged(staged, new_version))
            except BaseException:
                self._staging.discard(staged)
                raise
            self._staging.commit(staged)
            self._loaded = staged
            self._version = new_version
            self._stats["updates"] += 1
            return new_version
        finally:
            self._updating = False

    async def pause(self) -> None:
        """Stop generating: requests in flight wait (frozen on the server) until resume."""
        self._check_open()
        self._user_paused = True
        self._interrupt_epoch += 1  # a server that aborts instead of holding: resubmit
        if self.can_pause:
            await self._pause_server("hold")
        else:
            self._hold_new = True

    async def resume(self) -> None:
        self._check_open()
        self._user_paused = False
        if self.can_pause:
            await self._resume_server()
        else:
            self._hold_new = False

    @property
    def failure(self) -> BackendError | None:
        """The error that ended this engine: its server died more than ``max_restarts``
        times (None while it works)."""
        return self._failure

    async def health(self) -> dict[str, Any]:
        status = "paused" if self._user_paused else "ok"
        detail: dict[str, Any] = {}
        if self._closed:
            status = "closed"
        elif self._failure is not None:
            status, detail["error"] = "error", str(self._failure)
        elif self.server is not None and not self.server.running:
            status, detail["error"] = "error", f"the server exited; log: {self.server.log_path}"
        else:
            try:
                r = await self._client().get(f"{self.url}/health", timeout=10.0)
                if r.status_code != 200:
                    status, detail["error"] = "error", f"/health answered {r.status_code}"
            except httpx.HTTPError as exc:
                status, detail["error"] = "error", f"unreachable: {exc!r}"
        return {
            "status": status,
            "backend": self.backend,
            "url": self.url,
            "model": self.model_name,
            "version": self._version,
            "in_flight": self._in_flight,
            "max_context": self.max_context,
            **self._stats,
            **detail,
        }

    async def close(self) -> None:
        """Stop the server if this engine started it; forget staged weight files."""
        if self._closed:
            return
        self._closed = True
        for loop, client in list(self._clients.values()):
            if loop is _running_loop() and not client.is_closed:
                await client.aclose()
        self._clients.clear()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        self._staging.close()

    # ------------------------------------------------------------------ restarts
    def _server_died(self) -> bool:
        return self.server is not None and not self.server.running and not self._closed

    async def _until_sendable(self) -> None:
        """Wait until a request may be sent: no weight swap in progress (see
        :meth:`_swapped`) and no restart (a resubmission must not reach a half-restored
        server). Both are checked again after any wait, with no wait between the last check
        and the caller's send: a swap that began while the request waited for a restart
        would otherwise receive it and bind it to the old weights under the new label."""
        while True:
            while self._swapping and not self._closed:
                await asyncio.sleep(0.01)
            if self._restart_lock.locked() and not self._closed:
                await self._wait_restarted()
                continue  # a swap may have begun meanwhile
            if self._failure is not None:
                raise self._failure
            return

    async def _wait_restarted(self) -> None:
        while self._restart_lock.locked() and not self._closed:
            await asyncio.sleep(0.05)
        if self._failure is not None:
            raise self._failure

    async def _recover(self) -> None:
        """Restart the dead server, give it the version label and the weights last loaded;
        when another caller is already doing so, wait for it. Raises :attr:`failure` once
        ``max_restarts`` is spent."""
        if not self._restart_lock.acquire(blocking=False):
            await self._wait_restarted()
            return
        try:
            if not self._server_died():
                return  # restarted by an earlier caller
            assert self.server is not None
            while self._loading and not self._closed:  # a swap under way ends first
                await asyncio.sleep(0.01)
            code = self.server.exit_code
            if self._stats["restarts"] >= self.max_restarts:
                self._failure = BackendError(
                    f"the {self.backend} server at {self.url} exited (code {code}) after "
                    f"{self._stats['restarts']} restart(s) (limit: {self.max_restarts}); last "
                    f"lines of {self.server.log_path}:\n{self.server.tail(20)}"
                )
                raise self._failure
            self._stats["restarts"] += 1
            log.warning(
                "the %s server at %s exited (code %s); restarting it (%d of %d)",
                self.backend, self.url, code, self._stats["restarts"], self.max_restarts,
            )  # fmt: skip
            await asyncio.to_thread(self.server.restart, self.restart_timeout_s)
            self._forget_server_state()
            if self._loaded is not None:
                await self._load_staged(self._loaded, self._version)
            await self._after_restart()
            if self._user_paused and self.can_pause:
                await self._pause_server("hold")
        except BaseException as exc:
            if self._failure is None and isinstance(exc, Exception):
                self._failure = BackendError(
                    f"the {self.backend} server at {self.url} could not be restarted: {exc}"
                )
            raise
        finally:
            self._restart_lock.release()

    def _forget_server_state(self) -> None:
        """A new server process holds nothing this engine loaded into the old one (the
        subclass drops, e.g., its adapter's name)."""

    async def _after_restart(self) -> None:
        """A restarted server's checks and version label (after the weights are back)."""

    # ------------------------------------------------------------------ generation
    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        self._check_open()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if self.vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
        if len(prompt) >= self.max_context:
            raise ContextOverflow(
                f"the prompt has {len(prompt)} tokens but the model's context is "
                f"{self.max_context}; shorten the conversation"
            )
        return prompt

    async def _generate(
        self, prompt: list[int], params: SamplingParams, start: float
    ) -> GenerateResult:
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        top: list[list[tuple[int, float]]] = []
        interruptions = 0
        while True:
            context_room = self.max_context - self.context_margin - len(prompt)
            room = min(params.max_new_tokens, context_room) - len(ids)
            if room <= 0:
                finish, reason = "length", None
                break
            await self._until_sendable()
            epoch, fallback = self._interrupt_epoch, self._version
            try:
                seg = await self._submit(prompt + ids, params, room)
            except ServerRejected:
                if self._interrupt_epoch == epoch:
                    raise
                # A weight update began after this request was sent and the server refused
                # it once the update was done (SGLang: the adapter it named was unloaded):
                # sent again, it names the new weights.
                interruptions += 1
                continue
            ids += seg.ids
            logprobs += seg.logprobs
            versions += [fallback if v is None else v for v in seg.versions]
            top += seg.top
            if seg.finish == "abort" and (self._updating or self._interrupt_epoch != epoch):
                interruptions += 1
                while self._hold_new and not self._closed:
                    await asyncio.sleep(0.01)
                continue
            finish, reason = seg.finish, seg.stop_reason
            break
        result = GenerateResult(
            output_ids=ids,
            output_logprobs=logprobs,
            output_versions=versions,
            finish_reason=finish,  # type: ignore[arg-type]
            stop_reason=reason,
            top_logprobs=top if params.top_logprobs else [],
            prompt_tokens=len(prompt),
            latency_s=time.perf_counter() - start,
            interruptions=interruptions,
        )
        if interruptions and params.stop and self.decode is not None:
            _cut_at_stop_string(result, params.stop, self.decode)
        self._stats["requests"] += 1
        self._stats["output_tokens"] += len(result.output_ids)
        self._stats["interruptions"] += interruptions
        return result

    # ------------------------------------------------------------------ weights
    def _stage(self, update: WeightUpdate) -> WeightUpdate:
        if self.merger is not None and update.kind == "lora":
            update = self.merger.full_update(update)
        staged = self._staging.stage(update)
        try:
            self._check_weights_dir(staged)
        except BaseException:
            self._staging.discard(staged)
            raise
        return staged

    def _check_weights_dir(self, staged: WeightUpdate) -> None:
        path = Path(str(staged.path))
        if not path.is_dir():
            raise UserError(
                f"{path} is not a directory this process can read; weight updates need a "
                "directory shared with the server"
            )
        if staged.kind == "lora":
            check_adapter_dir(path)
        elif self.model_dir is not None and Path(self.model_dir).is_dir():
            check_same_tensors(path, self.model_dir, tied=self._tied)
        else:
            log.warning("cannot check %s against the served model: its directory is unknown", path)

    async def _swapped(self, load: Callable[[], Awaitable[None]]) -> None:
        """Run ``load`` (a weight load) with generation stopped: on a server that pauses,
        requests in flight are aborted and resumed on the new weights; otherwise new
        requests wait and those in flight finish first.

        While the server is paused nothing is sent to it (``_swapping``): a server binds a
        request to the weights it names when the request arrives (vLLM resolves the adapter's
        directory then), so a request sent during the swap would run on the old weights
        under the new version's label.

        A swap and a restart never overlap: the swap waits for a restart under way to end,
        and a restart waits for a swap under way (which fails fast on a dead server).
        Overlapping, the restart's reload of the previous weights could land after the new
        load but before its label: the old weights served under the new version."""
        await self._wait_restarted()  # returns with no await after its last check
        # No await between the check above and the flag: a restart that begins from here on
        # waits for the swap to end (see _recover).
        self._loading = True
        try:
            if self.can_pause:
                self._interrupt_epoch += 1
                self._swapping = True
                try:
                    await self._pause_server("abort")
                    try:
                        await load()
                    finally:
                        if not self._user_paused:
                            await self._resume_server()
                finally:
                    self._swapping = False
                return
            self._hold_new = True
            try:
                while self._in_flight:
                    await asyncio.sleep(0.01)
                await load()
            finally:
                self._hold_new = self._user_paused
        finally:
            self._loading = False

    async def _load_staged(self, staged: WeightUpdate, version: int) -> None:
        assert staged.path is not None
        if staged.kind == "full":
            await self._load_full(staged.path, version)
        else:
            await self._load_lora(staged.path, version)

    # ------------------------------------------------------------------ HTTP
    def _client(self) -> httpx.AsyncClient:
        loop = _running_loop()
        key = id(loop)
        entry = self._clients.get(key)
        if entry is None or entry[0] is not loop:
            entry = (loop, httpx.AsyncClient(timeout=self.request_timeout_s))
            self._clients[key] = entry
            for k, (other, _) in list(self._clients.items()):
                if other.is_closed():
                    del self._clients[k]
        return entry[1]

    async def _request(
        self, method: str, path: str, *, json: Any = None, params: Any = None
    ) -> Any:
        """Send a request; return the JSON body (or text) of a 2xx answer.

        4xx raises :class:`ServerRejected` with the server's message; anything else
        raises :class:`BackendError`.
        """
        self._check_open()
        try:
            r = await self._client().request(method, f"{self.url}{path}", json=json, params=params)
        except httpx.HTTPError as exc:
            raise BackendError(
                f"the {self.backend} server at {self.url} did not answer {method} {path}: "
                f"{exc!r}{self._log_hint()}"
            ) from None
        if 200 <= r.status_code < 300:
            if "application/json" in r.headers.get("content-type", ""):
                return r.json()
            return r.text
        message = _error_message(r)
        if 400 <= r.status_code < 500:
            raise ServerRejected(
                f"the {self.backend} server rejected {method} {path} "
                f"(HTTP {r.status_code}): {message}"
            )
        raise BackendError(
            f"the {self.backend} server failed on {method} {path} (HTTP {r.status_code}): "
            f"{message}{self._log_hint()}"
        )

    async def _close_loop_client(self) -> None:
        entry = self._clients.pop(id(_running_loop()), None)
        if entry is not None and not entry[1].is_closed:
            await entry[1].aclose()

    def _log_hint(self) -> str:
        if self.server is None:
            return ""
        return f"\nlast lines of {self.server.log_path}:\n{self.server.tail(20)}"

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"the {self.backend} engine is closed")

    @staticmethod
    def new_request_id() -> str:
        return "areal-" + uuid.uuid4().hex

    async def check_logprob_convention(self, fix: str) -> None:
        """Refuse a server whose logprobs ignore the temperature (or are raw logits).

        Two one-token requests at temperatures 1 and 0.5 report the logprob of the most
        likely token: under the convention they differ; raw logprobs would be equal, and
        logits scaled by 1/T would double.
        """
        probe = SamplingParams(temperature=1.0, seed=0, max_new_tokens=1, top_logprobs=1)
        a = await self._submit([0], probe, 1)
        b = await self._submit([0], probe.replace(temperature=0.5), 1)
        if not (a.top and a.top[0] and b.top and b.top[0]):
            raise BackendError(f"the {self.backend} server returned no top logprobs")
        la, lb = a.top[0][0][1], b.top[0][0][1]
        if abs(la - lb) < 1e-6:
            raise UserError(
                f"the {self.backend} server at {self.url} reports logprobs that ignore the "
                f"temperature; {fix}"
            )
        if la > 0 or abs(lb - 2 * la) < 1e-4 * max(1.0, abs(la)):
            raise UserError(
                f"the {self.backend} server at {self.url} reports logits, not logprobs; {fix}"
            )


# ---------------------------------------------------------------------- helpers
def get_json(http: httpx.Client, path: str, backend: str) -> Any:
    try:
        r = http.get(path)
    except httpx.HTTPError as exc:
        raise BackendError(
            f"the {backend} server at {str(http.base_url).rstrip('/')} is unreachable: {exc!r}"
        ) from None
    if r.status_code != 200:
        raise BackendError(
            f"{backend} server: GET {path} answered HTTP {r.status_code}: {r.text[:500]}"
        )
    return r.json()


def int_label(label: Any) -> int | None:
    if isinstance(label, int):
        return label
    if isinstance(label, str) and re.fullmatch(r"-?\d+", label.strip()):
        return int(label)
    return None


def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:2000] or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("error_message"):  # SGLang's adapter and weight endpoints
            return str(body["error_message"])
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:2000]


def _vocab_size(model_dir: str | None) -> int | None:
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def _cut_at_stop_string(result: GenerateResult, stops: Sequence[str], decode: DecodeFn) -> None:
    """Cut ``result`` after the first token whose decoded prefix contains a stop string.

    A decoded prefix only grows with more tokens, so the first such token is found by
    bisection. Only needed after an interruption (the server checked each part alone).
    """
    ids = result.output_ids

    def hit(n: int) -> str | None:
        text = decode(ids[:n])
        found = [(text.index(s), s) for s in stops if s and s in text]
        return min(found)[1] if found else None

    if not ids or hit(len(ids)) is None:
        return
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    if lo == len(ids) and result.finish_reason == "stop":
        return  # the server already stopped there
    stop = hit(lo)
    result.output_ids = ids[:lo]
    result.output_logprobs = result.output_logprobs[:lo]
    result.output_versions = result.output_versions[:lo]
    result.top_logprobs = result.top_logprobs[:lo]
    result.finish_reason = "stop"
    result.stop_reason = stop


def in_fresh_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``await fn(*args)`` to completion on a new event loop in a helper thread (usable
    whether or not the calling thread runs a loop); its HTTP client is closed after."""
    outcome: dict[str, Any] = {}

    async def main() -> None:
        try:
            outcome["value"] = await fn(*args)
        finally:
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, RemoteEngine):
                await owner._close_loop_client()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="areal-engine-setup")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
