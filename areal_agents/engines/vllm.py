"""The vLLM engine: a vLLM server (started here or already running) driven over HTTP.

Example::

    engine = VLLMEngine.launch("path/to/model", python=".venv-vllm/bin/python")
    # or: engine = VLLMEngine.connect("http://127.0.0.1:8001")
    result = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
    await engine.close()                     # stops the server if launch() started it

vLLM runs in a virtual environment of its own (its pins clash with ours); ``launch`` runs
``python -m vllm.entrypoints.openai.api_server`` with that environment's Python. Built for
vLLM 0.32 (``requirements/make_venv.sh vllm DIR``).

Endpoints used, and why
-----------------------
``POST /inference/v1/generate`` (needs ``--enable-scale-out``)
    vLLM's token-in/token-out endpoint: prompt token ids in, sampled token ids out, each
    logprob keyed by an integer token id (``/v1/completions`` keys them by token strings),
    and ``weight_versions``: spans of output tokens with the weight version label that
    sampled them. Token ids are never re-tokenized.
``POST /pause?mode=abort|keep`` and ``POST /resume`` (need ``VLLM_SERVER_DEV_MODE=1``)
    A weight update pauses with ``mode=abort`` (requests in flight return at once with
    their tokens and are resumed on the new weights; ``clear_cache`` drops KV and prefix
    caches computed with the old weights). :meth:`~RemoteEngine.pause` uses ``mode=keep``:
    requests stay frozen in the scheduler and continue after ``/resume``.
``POST /collective_rpc`` with ``reload_weights(weights_path=DIR)`` (dev mode)
    Full weight updates: every worker reloads the weights in place from a checkpoint
    directory. This works on CPU and GPU alike; vLLM's NCCL / CUDA-IPC weight-transfer
    engines (``/init_weight_transfer_engine``, ``/update_weights``) are GPU-only and need a
    process group shared with the trainer. A reload that meets unknown tensors leaves the
    server unusable, so the directory is checked against the served checkpoint first. For a
    model whose output layer is tied to its embeddings, vLLM's in-place reload loads the
    output layer as a layer of its own (a checkpoint without ``lm_head.weight`` leaves it
    with its old values), so every reload carries ``lm_head.weight``: when a checkpoint
    lacks it, a copy of the embedding matrix is added beside links to its files.
``POST /update_weight_version`` and ``POST /reset_prefix_cache`` (dev mode)
    Sets the label that vLLM attaches to the tokens it samples to our integer version,
    after every cached block is dropped (see :meth:`VLLMEngine._reset_prefix_cache`):
    blocks cached from requests aborted at the pause would otherwise give a request sent
    again the old weights' keys and values under the new version's label.
``POST /v1/load_lora_adapter`` (needs ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``)
    LoRA updates: the engine's adapter (``areal-lora-<id>``, one per engine object) is
    (re)loaded in place from a new directory each time; requests then name it as their
    ``model``.
``GET /v1/models``, ``GET /health``, ``GET /is_paused``, ``GET /weight_info``
    The served name and ``max_model_len``; liveness; whether dev endpoints exist; the
    current version label (an integer label is adopted when attaching).

vLLM's CPU build and seeded requests
------------------------------------
vLLM 0.32 splits a prompt that does not fit the step's token budget over several steps
(chunked prefill) and, for a seeded request, rewinds its random generator over the token
sampled and discarded after each partial step. A CPU generator cannot be rewound: the
server dies (``RuntimeError: CPU Generator does not use offset``) as soon as a seeded
request is prefilled in chunks, which a training run's concurrent, seeded episodes do
within minutes. ``launch`` therefore starts a CPU build (:func:`cpu_build`) with
``--no-enable-chunked-prefill`` and a token budget of at least the context
(``--max-num-batched-tokens``), so that every prompt is prefilled in one step (a prompt
waits for the next step rather than being split), unless ``extra_args`` sets one of
:data:`CHUNKED_PREFILL_FLAGS`. ``connect`` reads a dev-mode server's ``/server_info``; a
CPU server that chunks prefills gets requests without a seed (warned once), not a crash.

Without dev mode the engine still generates; ``pause`` and LoRA updates then drain (new
requests wait, those in flight finish) and full updates are refused with the fix.

Logprobs
--------
vLLM's default (``--logprobs-mode raw_logprobs``) reports ``log_softmax(logits)`` before
temperature, which is not the quantity the trainer recomputes. The server must run with
``--logprobs-mode processed_logprobs`` (``launch`` sets it; ``connect`` checks it with two
one-token requests at temperatures 1 and 0.5 and refuses a server in another mode). vLLM's
processed logprobs are ``log_softmax`` of the logits after temperature *and after top-k /
top-p truncation*, so they equal :mod:`areal_agents.engines.protocol`'s convention exactly when
``top_k = 0`` and ``top_p = 1`` (and for greedy decoding, where vLLM uses T = 1 and no
truncation; greedy requests are sent without top-k / top-p for that reason). With
truncation, the reported value is renormalised over the kept tokens: it is the probability
the token was actually sampled with, larger than the convention's by the log of the kept
mass. No vLLM mode reports the temperature-scaled, untruncated value.

``top_logprobs=k`` asks vLLM for k + 1 entries (it lists the sampled token first) and keeps
the k best by rank; ``launch`` raises ``--max-logprobs`` to 21 for that.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from areal_agents.engines.launch import ServerProcess, find_server_python, local_url
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
from areal_agents.engines.weight_files import with_output_layer
from areal_agents.errors import BackendError, UserError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
log = logging.getLogger(__name__)

CHUNKED_PREFILL_FLAGS = (
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
)
"""Flags that, given in ``extra_args``, leave the prefill schedule to the user."""


class VLLMEngine(RemoteEngine):
    """One vLLM server behind the :class:`~areal_agents.engines.protocol.Engine` protocol."""

    backend = "vllm"

    def __init__(self, url: str, *, dev_mode: bool, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.dev_mode = dev_mode
        self.lora_name = f"areal-lora-{uuid.uuid4().hex[:8]}"
        self._adapter: str | None = None
        self._tied_copy: Path | None = None
        self.send_seeds = True
        """False for a CPU server that chunks prefills (see the module docstring)."""

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
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        lora_rank: int = 16,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        start_timeout_s: float = 900.0,
        decode: DecodeFn | None = None,
        cpus: Sequence[int] | None = None,
        server_module: str = "vllm.entrypoints.openai.api_server",
    ) -> VLLMEngine:
        """Start ``python -m vllm.entrypoints.openai.api_server`` for ``model`` and connect.

        ``python``: the interpreter of a vLLM environment (default: :func:`find_python`); a
        CPU build is started without chunked prefill (see the module docstring).
        ``lora_rank``: the largest LoRA rank to accept (0: no LoRA support; vLLM takes only
        the values in ``areal_agents.engines.servers.VLLM_LORA_RANKS``). ``env`` adds
        variables (``VLLM_CPU_KVCACHE_SPACE`` defaults to 2 GiB); ``cpus``: the cores the
        server runs on. The server's output goes to ``log_path`` (a temporary file by
        default); a failed start shows its last lines. ``server_module`` runs another module
        with the same flags.
        """
        python = find_python(python)
        url = local_url(host, port)
        name = served_model_name or Path(model).name
        argv = [
            python, "-m", server_module,
            "--model", model,
            "--host", host,
            "--port", url.rsplit(":", 1)[1],
            "--served-model-name", name,
            "--dtype", dtype,
            "--max-num-seqs", str(max_num_seqs),
            "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "21",
        ]  # fmt: skip
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if cpu_build(python) and not any(
            a.split("=", 1)[0] in CHUNKED_PREFILL_FLAGS for a in extra_args
        ):
            context = max_model_len or _flag_value(extra_args, "--max-model-len")
            budget = max(2048, context or _model_context(model) or 0)
            argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
        server_env = {"VLLM_SERVER_DEV_MODE": "1", **dict(env or {})}
        server_env.setdefault(
            "VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
        )
        if lora_rank:
            argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
            server_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
        argv += list(extra_args)
        return cls._start_and_connect(
            argv,
            url=url,
            log_path=log_path,
            env=server_env,
            timeout_s=start_timeout_s,
            name="vLLM server",
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
    ) -> VLLMEngine:
        """Attach to a running vLLM server and check that it can serve this engine.

        ``model_dir``: the served checkpoint, when it is not the path the server reports
        (used to check full weight updates and token ids). Raises :class:`UserError` naming
        the flag to add when the server lacks one this engine needs.
        """
        url = url.rstrip("/")
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            card = get_json(http, "/v1/models", "vLLM")["data"][0]
            try:
                probe = http.post(
                    "/inference/v1/generate",
                    json={"token_ids": [0], "sampling_params": {"max_tokens": 1}},
                )
                dev_mode = http.get("/is_paused").status_code == 200
            except httpx.HTTPError as exc:
                raise BackendError(f"the vLLM server at {url} failed: {exc!r}") from None
            if probe.status_code in (403, 404):
                raise UserError(
                    f"the vLLM server at {url} does not serve /inference/v1/generate "
                    f"(HTTP {probe.status_code}); start it with --enable-scale-out "
                    "(vLLM >= 0.32)"
                )
            label = get_json(http, "/weight_info", "vLLM")["weight_version"] if dev_mode else None
            chunked_cpu = dev_mode and prefill_schedule(http) == ("cpu", True)
        root = card.get("root")
        if model_dir is None and root and Path(root, "config.json").exists():
            model_dir = str(root)
        engine = cls(
            url,
            dev_mode=dev_mode,
            model_name=str(card["id"]),
            max_context=int(card.get("max_model_len") or 4096),
            model_dir=model_dir,
            server=_server,
            decode=decode,
        )
        if chunked_cpu:
            engine.send_seeds = False
            log.warning(
                "the vLLM server at %s runs on CPU with chunked prefill: a seeded request "
                "prefilled in chunks kills it (vLLM 0.32), so requests go without their seed "
                "(sampling is not reproducible); start it with --no-enable-chunked-prefill "
                "--max-num-batched-tokens %d (at least --max-model-len)",
                url, max(2048, engine.max_context),
            )  # fmt: skip
        version = int_label(label)
        if version is not None:
            engine._version = version
        in_fresh_loop(engine._setup, version is None)
        return engine

    async def _setup(self, set_label: bool) -> None:
        await self.check_logprob_convention(
            "start vLLM with --logprobs-mode processed_logprobs (its default, raw_logprobs, "
            "ignores the temperature)"
        )
        if set_label and self.dev_mode:
            await self._set_label(self._version)

    async def _after_restart(self) -> None:
        await self._setup(True)

    # ------------------------------------------------------------------ generation
    async def _submit(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int
    ) -> Segment:
        greedy = params.temperature == 0
        sampling: dict[str, Any] = {
            "max_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": 1.0 if greedy else params.top_p,
            "top_k": 0 if greedy else params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
            "stop": list(params.stop),
            "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
            "skip_special_tokens": False,
        }
        if params.seed is not None and self.send_seeds:
            sampling["seed"] = params.seed
        body = {
            "request_id": self.new_request_id(),
            "token_ids": prompt,
            "model": self._adapter or self.model_name,
            "sampling_params": sampling,
        }
        out = await self._request("POST", "/inference/v1/generate", json=body)
        segment = _segment(out, params.top_logprobs)
        if not self.dev_mode:  # the label cannot be set without dev mode: it may be stale
            segment.versions = [None] * len(segment.ids)
        return segment

    # ------------------------------------------------------------------ control
    @property
    def can_pause(self) -> bool:
        return self.dev_mode

    async def _pause_server(self, mode: Literal["abort", "hold"]) -> None:
        if mode == "abort":
            query = {"mode": "abort", "clear_cache": "true"}
        else:
            query = {"mode": "keep"}
        await self._request("POST", "/pause", params=query)

    async def _resume_server(self) -> None:
        await self._request("POST", "/resume")

    async def _load_full(self, path: str, version: int) -> None:
        if not self.dev_mode:
            raise UserError(
                "full weight updates need the vLLM server started with VLLM_SERVER_DEV_MODE=1 "
                "(for /collective_rpc reload_weights and /pause); LoRA updates work without it"
            )
        tied_copy = None
        if self._tied:  # every reload must carry lm_head.weight (weight_files.with_output_layer)
            loaded = await asyncio.to_thread(with_output_layer, path, self._staging.root)
            tied_copy = loaded if str(loaded) != path else None
            path = str(loaded)
        try:
            await self._request(
                "POST",
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": path}},
            )
        except BaseException:
            if tied_copy is not None:
                shutil.rmtree(tied_copy, ignore_errors=True)
            raise
        if self._tied_copy is not None:
            shutil.rmtree(self._tied_copy, ignore_errors=True)
        self._tied_copy = tied_copy
        await self._set_label(version)

    async def _load_lora(self, path: str, version: int) -> None:
        body = {"lora_name": self.lora_name, "lora_path": path, "load_inplace": True}
        try:
            await self._request("POST", "/v1/load_lora_adapter", json=body)
        except ServerRejected as exc:
            if "Not Found" in str(exc) and "404" in str(exc):
                raise UserError(
                    "the vLLM server has no /v1/load_lora_adapter: start it with --enable-lora "
                    "(and --max-lora-rank >= the adapter's rank) and the environment variable "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
                ) from None
            raise
        self._adapter = self.lora_name
        if self.dev_mode:
            await self._set_label(version)

    async def _set_label(self, version: int) -> None:
        await self._reset_prefix_cache()
        await self._request("POST", "/update_weight_version", json={"new_version": str(version)})

    async def _reset_prefix_cache(self, attempts: int = 100) -> None:
        """Drop every cached block computed with the old weights, before the new version
        takes requests. ``/pause?clear_cache=true`` alone does not: blocks still held by the
        requests being aborted then are kept, and a request sent again as prompt + tokens so
        far would reuse them (keys and values of the old weights; with an adapter reloaded in
        place the cache key is the same). vLLM refuses the reset while blocks are held, so it
        is retried until it succeeds."""
        for _ in range(attempts):
            done = await self._request("POST", "/reset_prefix_cache")
            if not isinstance(done, dict) or done.get("success", True):
                return
            await asyncio.sleep(0.05)
        raise BackendError(
            f"the vLLM server at {self.url} kept refusing to reset its prefix cache after a "
            "weight update; the new version would reuse keys and values of the old weights"
        )


# ---------------------------------------------------------------------- helpers
def find_python(explicit: str | None = None) -> str:
    """The Python of a vLLM environment: ``explicit``, ``$AREAL_VLLM_PYTHON``, a
    ``.venv-vllm`` in the working directory or beside this package, or this interpreter
    when it has vLLM."""
    return find_server_python(
        explicit,
        module="vllm",
        env_var="AREAL_VLLM_PYTHON",
        venv=".venv-vllm",
        how="build one with `requirements/make_venv.sh vllm .venv-vllm` (vLLM cannot share "
        "areal-agents' environment)",
    )


@functools.cache
def cpu_build(python: str) -> bool:
    """Whether the vLLM installed for ``python`` is a CPU build: the ``vllm-cpu``
    distribution, or ``vllm`` with a ``+cpu`` version (a source build). Read from the
    package metadata, without importing vLLM."""
    probe = (
        "import importlib.metadata as m\n"
        "names = {d.metadata['Name'].lower(): d.version for d in m.distributions()}\n"
        "print('vllm-cpu' in names or 'cpu' in names.get('vllm', ''))"
    )
    try:
        out = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not read %s's vLLM build (%s); assuming a GPU build", python, exc)
        return False
    return out.stdout.strip() == "True"


def _flag_value(args: Sequence[str], flag: str) -> int | None:
    """The integer value of ``flag`` in ``args`` (``--flag N`` or ``--flag=N``), if any."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith(flag + "="):
            return int(a.split("=", 1)[1])
    return None


def _model_context(model: str) -> int | None:
    """The context a checkpoint declares (``max_position_embeddings``), if it says."""
    try:
        config = json.loads(Path(model, "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    return int(value) if value else None


def prefill_schedule(http: httpx.Client) -> tuple[str, bool] | None:
    """A dev-mode vLLM server's device type and whether it chunks prefills, read from
    ``/server_info``; None when it cannot tell."""
    try:
        r = http.get("/server_info", params={"config_format": "json"}, timeout=60.0)
        config = r.json()["vllm_config"]
        device = config["device_config"].get("device_type") or config["device_config"]["device"]
        return str(device), bool(config["scheduler_config"]["enable_chunked_prefill"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("could not read the vLLM server's configuration: %r", exc)
        return None


def _segment(out: dict[str, Any], top_k: int) -> Segment:
    try:
        choice = out["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
    except (KeyError, IndexError, TypeError) as exc:
        raise BackendError(f"unexpected vLLM response ({exc!r}): {json.dumps(out)[:500]}") from None
    if len(content) != len(ids):
        raise BackendError(f"vLLM returned {len(ids)} tokens but {len(content)} logprobs")
    versions: list[int | None] = [None] * len(ids)
    for span in choice.get("weight_versions") or []:
        label = int_label(span.get("version"))
        for i in range(int(span["start"]), min(int(span["end"]), len(ids))):
            versions[i] = label
    top: list[list[tuple[int, float]]] = []
    if top_k:
        for entry in content:
            ranked = [
                t for t in entry.get("top_logprobs") or [] if t.get("rank") and t["rank"] <= top_k
            ]
            ranked.sort(key=lambda t: t["rank"])
            top.append([(int(t["token_id"]), float(t["logprob"])) for t in ranked[:top_k]])
    finish = _FINISH.get(str(choice.get("finish_reason")))
    if finish is None:
        raise BackendError(f"vLLM finished a request with {choice.get('finish_reason')!r}")
    reason = choice.get("stop_reason")
    if finish == "stop" and reason is None and ids:
        reason = ids[-1]  # an end-of-sequence token of the model
    return Segment(
        ids=ids,
        logprobs=[float(c["logprob"]) for c in content],
        versions=versions,
        finish=finish,  # type: ignore[arg-type]
        stop_reason=reason,
        top=top,
    )
