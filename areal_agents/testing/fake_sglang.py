"""A CPU stand-in for an SGLang server: SGLang's native HTTP API over the embedded engine.

SGLang needs CUDA. This server answers the endpoints :class:`~areal_agents.engines.sglang.
SGLangEngine` uses with SGLang's request and response shapes, on a real model (a
transformers checkpoint run by :class:`~areal_agents.engines.embedded.EmbeddedEngine`), so the
client is tested end to end on CPU; ``benchmarks/gpu_check.sh`` runs the same tests
against a real SGLang.

Served (shapes as in SGLang 0.5): ``POST /generate`` (one prompt: ``input_ids`` or
``text``; ``sampling_params`` checked with SGLang's rules and messages; ``return_logprob``,
``top_logprobs_num``, ``return_text_in_logprobs``, ``lora_path``, ``rid``), ``POST
/pause_generation`` (``abort``, ``retract``, ``in_place``), ``POST /continue_generation``,
``POST /update_weights_from_disk``, ``POST /load_lora_adapter``, ``POST
/unload_lora_adapter``, ``POST /update_weight_version``, ``GET|POST /flush_cache``, ``GET
/health``, ``GET /health_generate``, ``GET /get_model_info``, ``GET /get_server_info``
(``tp_size`` 1, ``dp_size`` 1), ``GET /get_weight_version``, ``GET /v1/models``, and the weight
group: ``POST /init_weights_update_group`` (the server joins the trainer's group over gloo,
as rank ``rank_offset``) and ``POST /update_weights_from_distributed`` (it receives the
listed tensors and loads them). ``GET /debug/received_weights`` (not SGLang's) lists the
SHA-256 of each tensor the last such update received, for tests.

Known differences, all refused with HTTP 400 and a message rather than imitated: batched
prompts, ``stream``, ``logprob_start_len`` other than -1 (no input logprobs are returned),
``n`` > 1, ``ignore_eos``, ``min_p``, penalties, grammars, and sampling parameters SGLang
does not know (SGLang itself fails those with HTTP 500). Each LoRA adapter runs as its own
model copy, so requests with and without an adapter never share a batch.

Stricter than SGLang, to catch a client that falls behind its own updates (HTTP 400 with a
message): a ``/generate`` whose ``lora_path`` names a loaded adapter other than the newest
one loaded (the fake serves one policy: an older adapter is a client that kept using it
after an update; the adapter is resolved when the request is admitted, after a pause, as
SGLang does), and an integer ``weight_version`` (``/update_weight_version``,
``update_weights_from_disk``, ``update_weights_from_distributed``) lower than the current
integer label (a version label never goes back; other labels are set as given). With
``--readable-root DIR`` (tests only) weights outside DIR (``update_weights_from_disk``,
``load_lora_adapter``) cannot be read, as on a server on another machine.

Printed on stdout (the server's log): ``fake SGLang server pid=N ...`` at start, and one line
per weight load (``fake SGLang: loaded LoRA adapter NAME from PATH``, ``fake SGLang: updated
weights from PATH``, ``fake SGLang: updated weights from distributed``).

Run it the way SGLang is run (LoRA is on with ``--enable-lora``; SGLang flags it has no use
for, such as ``--mem-fraction-static``, are accepted and ignored)::

    python -m areal_agents.testing.fake_sglang --model-path DIR --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from areal_agents.engines.protocol import GenerateResult, SamplingParams, WeightUpdate
from areal_agents.serve.chat import ChatTokenizer

TOP_K_ALL = 1 << 30
_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}  # fmt: skip


class _GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None


class _Rejected(Exception):
    """A request SGLang answers with HTTP 400 ``{"error": {"message": ...}}``."""


class FakeSGLang:
    """The app and its models; ``app`` is the FastAPI application to serve."""

    def __init__(
        self,
        model_dir: str,
        *,
        served_model_name: str | None = None,
        context_length: int | None = None,
        enable_lora: bool = True,
        dtype: str = "float32",
        max_batch_size: int = 16,
        readable_root: str | None = None,
    ) -> None:
        """``readable_root``: weight loads from paths outside it fail as unreadable (a
        server on another machine, for tests)."""
        from areal_agents.engines.embedded import EmbeddedEngine  # noqa: PLC0415  loads torch here

        self.model_dir = str(model_dir)
        self.tokenizer = ChatTokenizer.from_dir(model_dir)
        self.base = EmbeddedEngine.from_pretrained(
            model_dir,
            dtype=dtype,
            decode=self.tokenizer.decode,
            max_context=context_length,
            max_batch_size=max_batch_size,
        )
        self.context_len = self.base.max_context
        self.name = served_model_name or Path(model_dir).name
        self.enable_lora = enable_lora
        self.adapters: dict[str, tuple[str, Any]] = {}  # name -> (path, EmbeddedEngine)
        self.weight_version = "default"
        self.max_batch_size = max_batch_size
        self._paused = False
        self._in_flight = 0
        self._admin: asyncio.Lock | None = None
        self._groups: dict[str, Any] = {}  # weight groups by name
        self.received: dict[str, str] = {}  # name -> digest of the last distributed update
        self.readable_root = None if readable_root is None else Path(readable_root).resolve()
        self.loads: list[tuple[str, str]] = []
        """Every weight load, in order: ("lora", adapter path), ("full", path), or
        ("distributed", "")."""
        self.app = self._build_app()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="fake SGLang", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> Response:
            body = {
                "object": "error",
                "message": f"{exc} {exc.errors()}",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
            return JSONResponse(body, status_code=400)

        @app.exception_handler(_Rejected)
        async def _rejected(_: Request, exc: _Rejected) -> Response:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/health_generate", self.health, methods=["GET"])
        app.add_api_route("/get_model_info", self.get_model_info, methods=["GET"])
        app.add_api_route("/get_server_info", self.get_server_info, methods=["GET"])
        app.add_api_route(
            "/init_weights_update_group", self.init_weights_update_group, methods=["POST"]
        )
        app.add_api_route(
            "/update_weights_from_distributed", self.update_weights_distributed, methods=["POST"]
        )
        app.add_api_route("/debug/received_weights", self.received_weights, methods=["GET"])
        app.add_api_route("/get_weight_version", self.get_weight_version, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/generate", self.generate, methods=["POST", "PUT"])
        app.add_api_route("/pause_generation", self.pause_generation, methods=["POST"])
        app.add_api_route("/continue_generation", self.continue_generation, methods=["POST"])
        app.add_api_route("/flush_cache", self.flush_cache, methods=["GET", "POST"])
        app.add_api_route("/update_weights_from_disk", self.update_weights, methods=["POST"])
        app.add_api_route("/update_weight_version", self.update_weight_version, methods=["POST"])
        app.add_api_route("/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        return app

    def _engines(self) -> list[Any]:
        return [self.base] + [engine for _, engine in self.adapters.values()]

    def _lock(self) -> asyncio.Lock:
        if self._admin is None:
            self._admin = asyncio.Lock()
        return self._admin

    # ------------------------------------------------------------------ info
    async def health(self) -> Response:
        status = (await self.base.health())["status"]
        return Response(status_code=503 if status == "error" else 200)

    async def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }

    async def get_server_info(self) -> dict[str, Any]:
        return {"tp_size": 1, "dp_size": 1, "model_path": self.model_dir}

    async def init_weights_update_group(self, request: Request) -> dict[str, Any]:
        from areal_agents.engines.weight_transfer import (  # noqa: PLC0415  loads torch here
            init_group,
        )

        body = await _json(request)
        need = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
        if missing := [k for k in need if k not in body]:
            raise _Rejected(f"init_weights_update_group needs {', '.join(missing)}")
        if body.get("backend", "nccl") not in ("gloo", "nccl"):
            raise _Rejected(f"unknown backend {body.get('backend')!r}")
        try:
            self._groups[str(body["group_name"])] = await asyncio.to_thread(
                init_group,
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                str(body["group_name"]),
                "gloo",  # the CPU stand-in of NCCL
            )
        except Exception as exc:
            return {"success": False, "message": f"Failed to init group: {exc}"}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def update_weights_distributed(self, request: Request) -> Response:
        from areal_agents.engines.weight_transfer import (  # noqa: PLC0415  loads torch here
            digest,
            receive,
        )

        body = await _json(request)
        group = self._groups.get(str(body.get("group_name")))
        if group is None:
            raise _Rejected(f"no weight group {body.get('group_name')!r}: init it first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise _Rejected("update_weights_from_distributed needs names, dtypes and shapes")
        if not len(names) == len(dtypes) == len(shapes):
            raise _Rejected("names, dtypes and shapes must be as long as each other")
        async with self._lock():
            # Received first even when refused below: the trainer is broadcasting them.
            tensors = await asyncio.to_thread(receive, group, dtypes, shapes)
            state = dict(zip(names, tensors, strict=True))
            self.received = {k: digest(v) for k, v in state.items()}
            if backwards := self._backwards(body.get("weight_version")):
                return JSONResponse(
                    {"success": False, "message": f"Failed to update weights: {backwards}"},
                    status_code=400,
                )
            try:
                for engine in self._engines():
                    await engine.update_weights(WeightUpdate(kind="full", state_dict=state))
            except Exception as exc:
                return JSONResponse(
                    {"success": False, "message": f"Failed to update weights: {exc}"},
                    status_code=400,
                )
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            self._loaded("distributed", "", "updated weights from distributed")
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    async def received_weights(self) -> dict[str, str]:
        return self.received

    async def get_weight_version(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version}

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.name,
            "max_model_len": self.context_len,
        }
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------------ generate
    async def generate(self, body: _GenerateBody) -> dict[str, Any]:
        ids, engine, params, logprob, top_n = self._parse(body)
        if self._paused:  # SGLang holds new requests while generation is paused
            while self._paused:
                await asyncio.sleep(0.01)
            engine = self._engine_for(body.lora_path)  # and resolves the adapter after
        rid = body.rid if isinstance(body.rid, str) else uuid.uuid4().hex
        start = time.perf_counter()
        if params is None:  # max_new_tokens == 0: a prefill only
            result = GenerateResult([], [], [], "length", prompt_tokens=len(ids))
        else:
            self._in_flight += 1
            try:
                result = await engine.generate(ids, params)
            finally:
                self._in_flight -= 1
        return self._answer(rid, ids, body, result, logprob, top_n, time.perf_counter() - start)

    def _parse(
        self, body: _GenerateBody
    ) -> tuple[list[int], Any, SamplingParams | None, bool, int]:
        given = [x is not None for x in (body.text, body.input_ids, body.input_embeds)]
        if sum(given) == 0:
            raise _Rejected("Either text, input_ids or input_embeds should be provided.")
        if sum(given) > 1:
            raise _Rejected("Only one of text, input_ids or input_embeds should be provided.")
        if body.input_embeds is not None:
            raise _Rejected("the fake SGLang server does not take input_embeds")
        if isinstance(body.text, list) or (body.input_ids and isinstance(body.input_ids[0], list)):
            raise _Rejected("the fake SGLang server serves one prompt per request, not a batch")
        if body.stream:
            raise _Rejected("the fake SGLang server does not stream; send stream=false")
        if body.logprob_start_len not in (None, -1):
            raise _Rejected("the fake SGLang server supports logprob_start_len=-1 only")
        if body.input_ids is not None:
            ids = [int(t) for t in body.input_ids]  # type: ignore[arg-type]
        else:
            ids = self.tokenizer.encode(str(body.text))
        if not ids:
            raise _Rejected("The input_ids is empty.")
        bad = [t for t in ids if not 0 <= t < self.base.vocab_size]
        if bad:
            raise _Rejected(
                f"The input_ids {ids} contains values greater than the vocab size "
                f"({self.base.vocab_size})."
            )
        raw = body.sampling_params or {}
        if not isinstance(raw, dict):
            raise _Rejected("the fake SGLang server serves one prompt per request, not a batch")
        if len(ids) >= self.context_len:
            raise _Rejected(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        max_new = raw.get("max_new_tokens", 128)
        if max_new is not None and max_new + len(ids) >= self.context_len:
            raise _Rejected(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {max_new + len(ids)} "
                f"tokens: {len(ids)} tokens from the input messages and {max_new} tokens for "
                "the completion. Please reduce the number of tokens in the input messages or "
                "the completion to fit within the limit."
            )
        top_n = body.top_logprobs_num or 0
        if not isinstance(top_n, int):
            raise _Rejected("the fake SGLang server serves one prompt per request, not a batch")
        params = _sampling(raw, top_n)
        engine = self._engine_for(body.lora_path)
        return ids, engine, params, bool(body.return_logprob), top_n

    def _engine_for(self, lora_path: Any) -> Any:
        if lora_path is None:
            return self.base
        if not isinstance(lora_path, str):
            raise _Rejected("the fake SGLang server serves one prompt per request, not a batch")
        if not self.enable_lora:
            raise _Rejected(
                f"LoRA adapter '{lora_path}' was requested, but LoRA is not enabled. "
                "Please launch the server with --enable-lora flag."
            )
        if lora_path not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise _Rejected(
                f"The following requested LoRA adapters are not loaded: {lora_path}\n"
                f"Loaded adapters: {loaded}."
            )
        newest = next(reversed(self.adapters))
        if lora_path != newest:
            raise _Rejected(
                f"The requested LoRA adapter {lora_path} is not the newest one loaded: "
                f"{newest} was loaded after it (the fake SGLang server serves the newest "
                "adapter only)"
            )
        return self.adapters[lora_path][1]

    def _answer(
        self,
        rid: str,
        ids: list[int],
        body: _GenerateBody,
        result: GenerateResult,
        logprob: bool,
        top_n: int,
        latency_s: float,
    ) -> dict[str, Any]:
        out = result.output_ids
        raw = body.sampling_params if isinstance(body.sampling_params, dict) else {}
        if result.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": result.stop_reason}
        elif result.finish_reason == "length":
            finish = {"type": "length", "length": len(out)}
        else:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not out else "Abort"}
        text_ids = out
        if not raw.get("no_stop_trim", False) and isinstance(result.stop_reason, int) and out:
            text_ids = out[:-1]
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=bool(raw.get("skip_special_tokens", True))
        )
        if not raw.get("no_stop_trim", False) and isinstance(result.stop_reason, str):
            text = text[: text.find(result.stop_reason)] if result.stop_reason in text else text
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "e2e_latency": latency_s,
        }
        if logprob:
            names = body.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                [lp, tok, self.tokenizer.decode([tok]) if names else None]
                for lp, tok in zip(result.output_logprobs, out, strict=True)
            ]
            if top_n:
                meta["output_top_logprobs"] = [
                    [[lp, tok, self.tokenizer.decode([tok]) if names else None] for tok, lp in alt]
                    for alt in result.top_logprobs
                ]
        return {"text": text, "output_ids": out, "meta_info": meta}

    # ------------------------------------------------------------------ control
    async def pause_generation(self, request: Request) -> dict[str, Any]:
        body = await _json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _Rejected(
                f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place']."
            )
        self._paused = True
        if mode == "abort":
            for engine in self._engines():
                await engine.abort_all()
        else:
            for engine in self._engines():
                await engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self) -> dict[str, Any]:
        self._paused = False
        for engine in self._engines():
            await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def flush_cache(self) -> Response:
        busy = self._in_flight > 0
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n",
            status_code=400 if busy else 200,
        )

    async def update_weights(self, request: Request) -> Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise _Rejected("update_weights_from_disk needs model_path (a string)")
        async with self._lock():
            message = None
            if backwards := self._backwards(body.get("weight_version")):
                message = f"Failed to update weights: {backwards}"
            elif unreadable := self._unreadable(path):
                message = f"Failed to get weights iterator: {unreadable}."
            if message is not None:
                content = {"success": False, "message": message, "num_paused_requests": 0}
                return JSONResponse(content, status_code=400)
            if body.get("abort_all_requests"):
                for engine in self._engines():
                    await engine.abort_all()
            while self._in_flight and not self._paused:  # SGLang waits for running requests
                await asyncio.sleep(0.01)
            try:
                for engine in self._engines():
                    await engine.update_weights(WeightUpdate(kind="full", path=path))
            except Exception as exc:
                content = {"success": False, "message": f"Failed to update weights: {exc}"}
                return JSONResponse({**content, "num_paused_requests": 0}, status_code=400)
            message = "Succeeded to update model weights."
            self._loaded("full", path, f"updated weights from {path}")
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        body = await _json(request)
        if backwards := self._backwards(body.get("new_version")):
            raise _Rejected(backwards)
        if body.get("abort_all_requests"):
            for engine in self._engines():
                await engine.abort_all()
        self.weight_version = str(body.get("new_version", ""))
        return {
            "success": True,
            "message": f"Weight version updated to {self.weight_version}",
            "new_version": self.weight_version,
        }

    async def load_lora_adapter(self, request: Request) -> Response:
        from areal_agents.engines.embedded import EmbeddedEngine  # noqa: PLC0415  loads torch here
        from areal_agents.engines.weights import (  # noqa: PLC0415  loads torch here
            apply_weight_update,
        )

        body = await _json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not self.enable_lora:
            return _lora_error("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not isinstance(name, str) or not isinstance(path, str):
            return _lora_error("load_lora_adapter needs lora_name and lora_path (strings)")
        async with self._lock():
            if name in self.adapters:
                return _lora_error(f"Failed to load LoRA adapter {name}: the name is in use")
            if unreadable := self._unreadable(path):
                return _lora_error(f"Failed to load LoRA adapter {name} from {path}: {unreadable}")
            try:
                model = await asyncio.to_thread(
                    lambda: apply_weight_update(
                        copy.deepcopy(self.base.model), WeightUpdate(kind="lora", path=path)
                    )
                )
            except Exception as exc:
                return _lora_error(f"Failed to load LoRA adapter {name} from {path}: {exc}")
            engine = EmbeddedEngine(
                model,
                model_name=name,
                eos_token_ids=self.base.eos_token_ids,
                decode=self.tokenizer.decode,
                max_context=self.context_len,
                max_batch_size=self.max_batch_size,
            )
            if self._paused:
                await engine.pause()
            self.adapters[name] = (path, engine)
            self._loaded("lora", path, f"loaded LoRA adapter {name} from {path}")
        loaded = {n: p for n, (p, _) in self.adapters.items()}
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await _json(request)
        name = body.get("lora_name")
        async with self._lock():
            if name not in self.adapters:
                return _lora_error(f"LoRA adapter {name} is not loaded")
            _, engine = self.adapters.pop(name)
        await engine.close()
        loaded = {n: p for n, (p, _) in self.adapters.items()}
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": loaded})

    # ------------------------------------------------------------------ checks
    def _backwards(self, label: Any) -> str | None:
        """Why setting the version label to ``label`` is refused: an integer label lower than
        the current integer label (None: allowed)."""
        new, current = _int_label(label), _int_label(self.weight_version)
        if new is None or current is None or new >= current:
            return None
        return (
            f"the weight version cannot go back from {self.weight_version} to {label} "
            "(a version label never decreases)"
        )

    def _unreadable(self, path: str) -> str | None:
        """Why the weights at ``path`` cannot be read with ``--readable-root`` (None: they
        can be tried)."""
        if self.readable_root is None or Path(path).resolve().is_relative_to(self.readable_root):
            return None
        return f"[Errno 2] No such file or directory: '{path}'"

    def _loaded(self, kind: str, path: str, line: str) -> None:
        self.loads.append((kind, path))
        print(f"fake SGLang: {line}", flush=True)

    async def close(self) -> None:
        for engine in self._engines():
            await engine.close()


# ---------------------------------------------------------------------- helpers
def _sampling(raw: dict[str, Any], top_n: int) -> SamplingParams | None:
    """SGLang's SamplingParams rules (defaults, greedy, verify messages) -> ours."""
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise _Rejected(f"Unexpected keyword argument {unknown[0]!r} in sampling_params")

    def get(key: str, default: Any) -> Any:
        value = raw.get(key)
        return default if value is None else value

    temperature = float(get("temperature", 1.0))
    top_p, top_k = float(get("top_p", 1.0)), int(get("top_k", -1))
    max_new = raw.get("max_new_tokens", 128)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise _Rejected(f"temperature must be a non-negative finite number, got {temperature}.")
    greedy = temperature < 1e-6
    if greedy:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    if not 0.0 < top_p <= 1.0:
        raise _Rejected(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1:
        raise _Rejected(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new is not None and max_new < 0:
        raise _Rejected(f"max_new_tokens must be at least 0, got {max_new}.")
    for key, default in (("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if float(get(key, default)) != default:
            raise _Rejected(f"the fake SGLang server does not support {key}")
    if float(get("repetition_penalty", 1.0)) != 1.0 or int(get("n", 1)) != 1:
        raise _Rejected("the fake SGLang server does not support repetition_penalty or n > 1")
    if get("ignore_eos", False) or any(raw.get(k) for k in ("json_schema", "regex", "ebnf")):
        raise _Rejected("the fake SGLang server does not support ignore_eos or grammars")
    if max_new == 0:
        return None
    stop = get("stop", ())
    seed = raw.get("sampling_seed")
    try:
        return SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=top_p,
            top_k=0 if greedy or top_k == TOP_K_ALL else top_k,
            max_new_tokens=int(max_new if max_new is not None else 128),
            stop_token_ids=tuple(int(t) for t in get("stop_token_ids", ())),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            seed=None if seed is None else int(seed),
            top_logprobs=top_n,
        )
    except ValueError as exc:
        raise _Rejected(str(exc)) from None


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise _Rejected(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _Rejected("the request body must be a JSON object")
    return data


def _int_label(label: Any) -> int | None:
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and re.fullmatch(r"\s*-?\d+\s*", label):
        return int(label)
    return None


def _lora_error(message: str) -> Response:
    body = {"success": False, "error_message": message, "loaded_adapters": None}
    return JSONResponse(body, status_code=400)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)  # accepted, not needed
    parser.add_argument("--lora-target-modules", nargs="*", default=None)  # accepted
    parser.add_argument(
        "--readable-root",
        default=None,
        help="tests only: weights outside this directory cannot be read (a remote server)",
    )
    args, ignored = parser.parse_known_args(argv)  # other SGLang flags change nothing here
    if ignored:
        print(f"fake SGLang: ignoring {' '.join(ignored)}", flush=True)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    fake = FakeSGLang(
        args.model_path,
        served_model_name=args.served_model_name,
        context_length=args.context_length,
        enable_lora=args.enable_lora,
        dtype=dtype,
        readable_root=args.readable_root,
    )
    print(
        f"fake SGLang server pid={os.getpid()} on http://{args.host}:{args.port} "
        f"(model {args.model_path})",
        flush=True,
    )
    uvicorn.run(fake.app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
