"""The SGLang engine: an SGLang server driven through its native HTTP API.

Example::

    engine = SGLangEngine.connect("http://127.0.0.1:30000")
    result = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))

SGLang needs CUDA; :mod:`areal_agents.testing.fake_sglang` serves the same API on CPU for tests.

Endpoints used, and why
-----------------------
``POST /generate``
    ``{"input_ids": [...], "sampling_params": {...}, "return_logprob": true,
    "top_logprobs_num": k, "lora_path": name, "rid": id}``: token ids in; the answer's
    ``output_ids`` are the sampled ids, ``meta_info.output_token_logprobs`` holds one
    ``[logprob, token_id, text]`` per output token, ``meta_info.output_top_logprobs`` the
    alternatives, ``meta_info.finish_reason`` a dict (``{"type": "stop", "matched": id or
    string}``, ``{"type": "length", ...}``, ``{"type": "abort", "message": ...}``) and
    ``meta_info.weight_version`` the server's version label when the answer was made.
    Sampling parameters sent: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``
    (-1 disables), ``stop_token_ids``, ``stop``, ``sampling_seed``,
    ``skip_special_tokens=false`` and ``no_stop_trim=true`` (text as generated).
``POST /pause_generation`` ``{"mode": "abort" | "in_place"}`` and ``POST /continue_generation``
    A weight update pauses in ``abort`` mode (requests in flight return with their tokens
    and finish reason "abort", and are resumed on the new weights; requests arriving while
    paused wait on the server). :meth:`~RemoteEngine.pause` uses ``in_place``: requests
    stay in the running batch and continue after ``/continue_generation``.
``POST /update_weights_from_disk`` ``{"model_path": DIR, "weight_version": "N"}``
    Full weight updates from a checkpoint directory (checked against the served one
    first); SGLang flushes its radix cache and sets the version label.
``POST /load_lora_adapter`` / ``/unload_lora_adapter``
    LoRA updates: each version loads as a new adapter ``areal-lora-vN-<id>`` (SGLang refuses
    to load a name twice), requests name it in ``lora_path``, and the previous adapter is
    unloaded. Needs ``--enable-lora`` with ``--max-lora-rank`` and
    ``--lora-target-modules``.
``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed``
    Full weights straight from the trainer's GPU to the server's over NCCL
    (:meth:`SGLangEngine.init_weight_group`, :meth:`SGLangEngine.update_weights_distributed`;
    :mod:`areal_agents.engines.weight_transfer`): the trainer hosts a process group that the
    server's GPU workers join (``rank_offset`` 1, ``world_size`` 1 + tp x dp), and each
    update lists the tensors' names, dtypes and shapes while the trainer broadcasts them in
    that order; SGLang flushes its cache and sets the version label.
``POST /update_weight_version``
    Sets the version label (at attach and after a LoRA update).
``GET /health``, ``GET /get_model_info``, ``GET /v1/models``
    Liveness; the model path and current label (an integer label is adopted when
    attaching); the served name and context length.

Logprobs
--------
SGLang reports ``log_softmax(logits / T)`` of the sampled token, before top-k / top-p /
min-p truncation (greedy decoding: T = 1) -- :mod:`areal_agents.engines.protocol`'s convention
exactly, truncation included. With ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` it reports the
values before temperature instead; ``connect`` detects that (two one-token requests at
temperatures 1 and 0.5) and refuses the server with the fix.

Seeds: ``sampling_seed`` is sent for seeded requests; SGLang documents reproducible
sampling under ``--enable-deterministic-inference`` (``benchmarks/gpu_check.sh`` starts it
so), since batching can otherwise change a draw.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from areal_agents.engines.launch import ServerProcess, find_server_python, free_port, local_url
from areal_agents.engines.protocol import SamplingParams
from areal_agents.engines.remote import (
    DecodeFn,
    RemoteEngine,
    Segment,
    ServerRejected,
    get_json,
    in_fresh_loop,
    int_label,
)
from areal_agents.errors import BackendError, UserError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class SGLangEngine(RemoteEngine):
    """One SGLang server behind the :class:`~areal_agents.engines.protocol.Engine` protocol."""

    backend = "sglang"
    context_margin = 1  # SGLang refuses input + max_new_tokens >= its context length

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._adapter: str | None = None
        self._weight_group: tuple[Any, str, str] | None = None  # (group, name, backend)

    # ------------------------------------------------------------------ construction
    @classmethod
    def launch(
        cls,
        model: str,
        *,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        dtype: str = "auto",
        context_length: int | None = None,
        lora_rank: int = 16,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        start_timeout_s: float = 900.0,
        decode: DecodeFn | None = None,
        server_module: str = "sglang.launch_server",
        cpus: Sequence[int] | None = None,
    ) -> SGLangEngine:
        """Start ``python -m sglang.launch_server`` for ``model`` and connect.

        ``python``: the interpreter of an SGLang environment (``$AREAL_SGLANG_PYTHON``, a
        ``.venv-sglang``, or this one). ``lora_rank`` 0 disables LoRA support.
        ``server_module`` runs another server with the same flags (tests use
        ``areal_agents.testing.fake_sglang``).
        """
        python = find_server_python(
            python,
            module=server_module.split(".")[0],
            env_var="AREAL_SGLANG_PYTHON",
            venv=".venv-sglang",
            how="install SGLang (CUDA only) in an environment of its own",
        )
        url = local_url(host, port)
        argv = [
            python, "-m", server_module,
            "--model-path", model,
            "--host", host,
            "--port", url.rsplit(":", 1)[1],
            "--served-model-name", served_model_name or Path(model).name,
            "--dtype", dtype,
        ]  # fmt: skip
        if context_length:
            argv += ["--context-length", str(context_length)]
        if lora_rank:
            argv += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
            argv += ["--lora-target-modules", "all"]
        argv += list(extra_args)
        return cls._start_and_connect(
            argv,
            url=url,
            log_path=log_path,
            env=env,
            timeout_s=start_timeout_s,
            name="SGLang server",
            model=model,
            decode=decode,
            cpus=cpus,
        )

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        model_dir: str | None = None,
        decode: DecodeFn | None = None,
        timeout_s: float = 60.0,
        _server: ServerProcess | None = None,
    ) -> SGLangEngine:
        """Attach to a running SGLang server and check its logprob convention."""
        url = url.rstrip("/")
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            info = get_json(http, "/get_model_info", "SGLang")
            card = get_json(http, "/v1/models", "SGLang")["data"][0]
        path = info.get("model_path")
        if model_dir is None and path and Path(path, "config.json").exists():
            model_dir = str(path)
        engine = cls(
            url,
            model_name=str(card["id"]),
            max_context=int(card.get("max_model_len") or 4096),
            model_dir=model_dir,
            server=_server,
            decode=decode,
        )
        version = int_label(info.get("weight_version"))
        if version is not None:
            engine._version = version
        in_fresh_loop(engine._setup, version is None)
        return engine

    async def _setup(self, set_label: bool) -> None:
        await self.check_logprob_convention(
            "start SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB (the temperature-scaled "
            "logprobs are the ones the trainer recomputes)"
        )
        if set_label:
            await self._set_label(self._version)

    def _forget_server_state(self) -> None:
        self._adapter = None  # the new process has no adapter to unload

    async def _after_restart(self) -> None:
        await self._setup(True)

    # ------------------------------------------------------------------ generation
    async def _submit(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int
    ) -> Segment:
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "stop_token_ids": list(params.stop_token_ids),
            "stop": list(params.stop),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body: dict[str, Any] = {
            "rid": self.new_request_id(),
            "input_ids": prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
        }
        if self._adapter is not None:
            body["lora_path"] = self._adapter
        out = await self._request("POST", "/generate", json=body)
        return _segment(out)

    # ------------------------------------------------------------------ control
    async def _pause_server(self, mode: Literal["abort", "hold"]) -> None:
        sglang_mode = "abort" if mode == "abort" else "in_place"
        await self._request("POST", "/pause_generation", json={"mode": sglang_mode})

    async def _resume_server(self) -> None:
        await self._request("POST", "/continue_generation", json={})

    async def _load_full(self, path: str, version: int) -> None:
        out = await self._request(
            "POST",
            "/update_weights_from_disk",
            json={"model_path": path, "weight_version": str(version), "flush_cache": True},
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise BackendError(f"SGLang could not load {path}: {out.get('message')}")

    async def _load_lora(self, path: str, version: int) -> None:
        name = f"areal-lora-v{version}-{uuid.uuid4().hex[:8]}"
        out = await self._request(
            "POST", "/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise BackendError(f"SGLang could not load the adapter {path}: {out}")
        previous, self._adapter = self._adapter, name
        if previous is not None and previous != name:
            await self._request("POST", "/unload_lora_adapter", json={"lora_name": previous})
        await self._set_label(version)

    # ------------------------------------------------------------------ weights over NCCL
    async def init_weight_group(
        self,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str | None = None,
        group_name: str = "areal-weights",
        timeout_s: float = 300.0,
    ) -> None:
        """Host the process group the server's workers join for
        :meth:`update_weights_distributed` (this process is its rank 0). ``master_address``
        must be reachable from the server; ``master_port`` 0 picks a free one; ``backend``
        defaults to NCCL on CUDA, else gloo."""
        import torch  # noqa: PLC0415  torch loads only for a weight group

        from areal_agents.engines import weight_transfer  # noqa: PLC0415  it loads torch

        self._check_open()
        if self._weight_group is not None:
            raise UserError("init_weight_group: this engine already has a weight group")
        info = await self._request("GET", "/get_server_info")
        workers = int(info.get("tp_size") or 1) * int(info.get("dp_size") or 1)
        port = master_port or free_port()
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        body = {
            "master_address": master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + workers,
            "group_name": group_name,
            "backend": backend,
        }
        joined, out = await asyncio.gather(
            asyncio.to_thread(
                weight_transfer.init_group,
                master_address,
                port,
                0,
                1 + workers,
                group_name,
                backend,
                timeout_s,
            ),
            self._request("POST", "/init_weights_update_group", json=body),
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise BackendError(f"SGLang could not join the weight group: {out.get('message')}")
        self._weight_group = (joined, group_name, backend)

    async def update_weights_distributed(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Send the whole model ``state_dict`` through the weight group
        (:meth:`init_weight_group` first; each tensor moves to the GPU for NCCL, one at a
        time) and return the new version. Requests
        in flight are interrupted and resumed on the new weights, as with
        :meth:`update_weights`."""
        from areal_agents.engines import weight_transfer  # noqa: PLC0415  it loads torch

        self._check_open()
        if self._weight_group is None:
            raise UserError("update_weights_distributed: call init_weight_group first")
        group, name, backend = self._weight_group
        device = "cuda" if backend == "nccl" else "cpu"
        new_version = self._version + 1 if version is None else version
        tensors = list(state_dict.values())
        body = {
            "names": list(state_dict),
            "dtypes": [weight_transfer.dtype_name(t) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": name,
            "flush_cache": True,
            "weight_version": str(new_version),
        }

        async def load() -> None:
            _, out = await asyncio.gather(
                asyncio.to_thread(weight_transfer.send, group, tensors, device),
                self._request("POST", "/update_weights_from_distributed", json=body),
            )
            if isinstance(out, dict) and out.get("success") is False:
                raise BackendError(f"SGLang could not take the weights: {out.get('message')}")

        while self._updating:  # one update at a time
            await asyncio.sleep(0.01)
        self._updating = True
        try:
            await self._swapped(load)
            self._version = new_version
            self._stats["updates"] += 1
            return new_version
        finally:
            self._updating = False

    async def close(self) -> None:
        if self._weight_group is not None:
            from areal_agents.engines import weight_transfer  # noqa: PLC0415  it loads torch

            weight_transfer.destroy(self._weight_group[0])
            self._weight_group = None
        await super().close()

    async def _set_label(self, version: int) -> None:
        try:
            await self._request(
                "POST", "/update_weight_version", json={"new_version": str(version)}
            )
        except ServerRejected as exc:  # an SGLang without version labels
            if "404" not in str(exc):
                raise
            log.warning("SGLang at %s has no /update_weight_version: versions are ours", self.url)


def _segment(out: dict[str, Any]) -> Segment:
    try:
        ids = [int(t) for t in out["output_ids"]]
        meta = out["meta_info"]
        finish_info = meta.get("finish_reason") or {}
        kind = finish_info.get("type")
        token_lps = meta.get("output_token_logprobs") or []
    except (KeyError, TypeError, AttributeError) as exc:
        raise BackendError(
            f"unexpected SGLang response ({exc!r}): {json.dumps(out)[:500]}"
        ) from None
    status = finish_info.get("status_code")
    if kind == "abort" and isinstance(status, int) and 400 <= status < 500:
        raise ValueError(f"the sglang server rejected the request: {finish_info.get('message')}")
    finish = _FINISH.get(str(kind))
    if finish is None:
        raise BackendError(f"SGLang finished a request with {finish_info!r}")
    if len(token_lps) != len(ids):
        raise BackendError(f"SGLang returned {len(ids)} tokens but {len(token_lps)} logprobs")
    if [int(e[1]) for e in token_lps] != ids:
        raise BackendError("SGLang's output_token_logprobs do not match its output_ids")
    top = [
        [(int(e[1]), float(e[0])) for e in (position or [])]
        for position in meta.get("output_top_logprobs") or []
    ]
    reason = finish_info.get("matched") if finish == "stop" else None
    if finish == "stop" and reason is None and ids:
        reason = ids[-1]
    label = int_label(meta.get("weight_version"))
    return Segment(
        ids=ids,
        logprobs=[float(e[0]) for e in token_lps],
        versions=[label] * len(ids),
        finish=finish,  # type: ignore[arg-type]
        stop_reason=reason,
        top=top,
    )
