"""Engines under test: embedded, a real vLLM server, the fake SGLang server, a real SGLang.

One vLLM server serves the whole session. It is started the way a user starts one,
``areal-agent serve --backend vllm --model DIR`` (the proxy starts vLLM with the Python of
the vLLM environment), or, with ``AREAL_VLLM_URL``, the proxy attaches to a server already
running (``benchmarks/gpu_check.sh``). Without a vLLM environment the vLLM tests skip with
the command that builds one; with ``AREAL_REQUIRE_VLLM=1`` (CI) they fail instead. A real
SGLang is used when ``AREAL_SGLANG_URL`` is set (``AREAL_REQUIRE_SGLANG=1``: required).

``AREAL_ENGINE_MODEL`` names the model those external servers serve (default: the seeded
tiny Qwen3 of tests/conftest.py, which the local vLLM server loads in float32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.engines.launch import log_tail

REPO = Path(__file__).resolve().parents[2]


def _missing(what: str, how: str, required_by: str) -> None:
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {what}; {how}", pytrace=False)
    pytest.skip(f"{what}; {how}")


@pytest.fixture(scope="session")
def model_dir(request: pytest.FixtureRequest) -> Path:
    given = os.environ.get("AREAL_ENGINE_MODEL")
    if given:
        return Path(given)
    return Path(request.getfixturevalue("tiny_model_dir"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from areal_agents.serve.chat import ChatTokenizer

    return ChatTokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------------- vLLM
@dataclass
class VLLMService:
    url: str
    """The vLLM server."""
    proxy_url: str
    """``areal-agent serve --backend vllm`` in front of it."""
    proxy_log: Path


def _wait_for(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"areal-agent serve exited with {proc.returncode}:\n{log_tail(log, 60)}",
                pytrace=False,
            )
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    pytest.fail(f"areal-agent serve did not come up in {timeout_s} s:\n{log_tail(log, 60)}")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of the vLLM environment (skips, or fails under AREAL_REQUIRE_VLLM=1)."""
    from areal_agents.engines.vllm import find_python
    from areal_agents.errors import UserError

    try:
        return find_python(None)
    except UserError as exc:
        _missing("no vLLM environment was found", str(exc), "AREAL_REQUIRE_VLLM")
        raise


@pytest.fixture(scope="session")
def vllm_service(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Any]:
    from areal_agents.engines.launch import free_port

    external = os.environ.get("AREAL_VLLM_URL")
    logs = tmp_path_factory.mktemp("vllm")
    proxy_port = free_port()
    argv = [
        sys.executable, "-m", "areal_agents.cli.main", "serve", "--backend", "vllm",
        "--model", str(model_dir), "--port", str(proxy_port),
    ]  # fmt: skip
    if external:
        url = external.rstrip("/")
        argv += ["--engine-url", url]
    else:
        python = request.getfixturevalue("vllm_python")
        engine_port = free_port()
        url = f"http://127.0.0.1:{engine_port}"
        argv += [
            "--engine-python", python, "--engine-port", str(engine_port),
            "--engine-log", str(logs / "vllm.log"), "--dtype", "float32",
            "--max-batch-size", "8", "--lora-rank", "8",
            "--engine-args", "--max-model-len 2048",
        ]  # fmt: skip
    proxy_log = logs / "serve.log"
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    with open(proxy_log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        _wait_for(f"http://127.0.0.1:{proxy_port}/health", proc, proxy_log, timeout_s=1200)
        yield VLLMService(url, f"http://127.0.0.1:{proxy_port}", proxy_log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if not external:  # the proxy started vLLM, so stopping the proxy must stop vLLM
            try:
                alive = httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                alive = False
            assert not alive, f"vLLM at {url} still answers after areal-agent serve exited"


# ---------------------------------------------------------------------- SGLang
@pytest.fixture(scope="session")
def sglang_url() -> str:
    url = os.environ.get("AREAL_SGLANG_URL")
    if not url:
        _missing(
            "AREAL_SGLANG_URL is not set",
            "SGLang needs a GPU: start one and run benchmarks/gpu_check.sh",
            "AREAL_REQUIRE_SGLANG",
        )
    return str(url).rstrip("/")


@pytest.fixture(scope="session")
def fake_sglang_url(model_dir: Path) -> Iterator[str]:
    """The fake SGLang server (areal_agents.testing.fake_sglang) on loopback, in this process."""
    import asyncio

    import uvicorn

    from areal_agents.engines.launch import free_port
    from areal_agents.testing.fake_sglang import FakeSGLang

    fake = FakeSGLang(str(model_dir), enable_lora=True)
    port = free_port()
    config = uvicorn.Config(
        fake.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fake-sglang", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    asyncio.run(fake.close())


@pytest.fixture(scope="session")
def training_checks() -> Any:
    """tests/engines/server_training.py: a short training run's config on the tiny model and
    the checks of what the run left behind (for the train-on-servers tests)."""
    import importlib.util

    path = Path(__file__).with_name("server_training.py")
    spec = importlib.util.spec_from_file_location("server_training", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
