"""Starting and stopping server processes; choosing a server's Python; weight files."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from areal_agents.engines.launch import ServerProcess, find_server_python, local_url
from areal_agents.engines.weight_files import (
    check_same_tensors,
    safetensors_index,
    stage_update,
    with_output_layer,
)
from areal_agents.errors import BackendError, UserError

SERVER = """
import http.server, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_start_waits_for_health_and_stop_ends_the_process_group(tmp_path: Path) -> None:
    url = local_url("127.0.0.1", 0)
    port = url.rsplit(":", 1)[1]
    child_file = tmp_path / "child.pid"
    server = ServerProcess.start(
        [sys.executable, "-c", SERVER, port, str(child_file)],
        url=url,
        log_path=tmp_path / "server.log",
        timeout_s=30,
    )
    assert server.running and "serving" in server.tail()
    child = int(child_file.read_text())
    assert _alive(child)
    server.stop()
    assert not server.running
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "a child of the server survived stop()"


def test_a_server_that_exits_shows_its_log(tmp_path: Path) -> None:
    code = "print('no such flag: --bogus', flush=True); raise SystemExit(3)"
    with pytest.raises(BackendError, match=r"(?s)exited with code 3.*no such flag: --bogus"):
        ServerProcess.start(
            [sys.executable, "-c", code], url=local_url("127.0.0.1", 0), timeout_s=30
        )


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()));"
    code += "print('compiling...', flush=True); time.sleep(600)"
    with pytest.raises(BackendError, match=r"(?s)did not answer.*within 2 s.*compiling"):
        ServerProcess.start(
            [sys.executable, "-c", code], url=local_url("127.0.0.1", 0), timeout_s=2
        )
    assert not _alive(int(pid_file.read_text()))


def test_a_missing_program_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="cannot start"):
        ServerProcess.start(["/nonexistent/python"], url=local_url("127.0.0.1", 0))


def test_find_server_python_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AREAL_FAKE_PYTHON", raising=False)
    how = "build one with make_venv.sh"
    with pytest.raises(UserError, match=r"no Python with no_such_module found: build one"):
        find_server_python(
            None, module="no_such_module", env_var="AREAL_FAKE_PYTHON", venv=".v", how=how
        )
    with pytest.raises(UserError, match="is not a Python that can import no_such_module"):
        find_server_python(sys.executable, module="no_such_module", env_var="X", venv=".v", how=how)
    assert find_server_python(None, module="json", env_var="X", venv=".v", how=how)


def test_checkpoints_are_compared_by_tensor_names_and_shapes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    base, good, bad = (tmp_path / n for n in ("base", "good", "bad"))
    for d in (base, good, bad):
        d.mkdir()
    save_file(
        {"a": torch.zeros(2, 3), "lm_head.weight": torch.zeros(4)}, base / "model.safetensors"
    )
    save_file({"a": torch.ones(2, 3)}, good / "model.safetensors")
    save_file({"a": torch.ones(3, 3), "b": torch.ones(1)}, bad / "model.safetensors")
    assert safetensors_index(base)["a"] == ("F32", (2, 3))
    check_same_tensors(good, base, tied=True)  # a tied output layer may be left out
    with pytest.raises(UserError, match="1 missing tensors"):
        check_same_tensors(good, base, tied=False)
    with pytest.raises(UserError, match=r"unknown tensors \(e.g. \['b'\]\).*shape mismatches"):
        check_same_tensors(bad, base, tied=True)
    with pytest.raises(UserError, match=r"no \*\.safetensors"):
        safetensors_index(tmp_path)


def test_staging_writes_full_and_lora_updates(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig

    from areal_agents.engines.protocol import WeightUpdate

    shared = torch.ones(2)
    full = stage_update(WeightUpdate(state_dict={"x": shared, "y": shared}, version=3), tmp_path)
    assert full.path and full.version == 3 and full.state_dict is None
    assert set(safetensors_index(full.path)) == {"x", "y"}  # tied tensors written apart
    config = LoraConfig(r=2, target_modules=["q_proj"])
    lora = stage_update(
        WeightUpdate(kind="lora", state_dict={"w": torch.ones(1)}, lora_config=config), tmp_path
    )
    saved = json.loads((Path(str(lora.path)) / "adapter_config.json").read_text())
    assert saved["r"] == 2 and saved["target_modules"] == ["q_proj"]
    with pytest.raises(UserError, match="needs lora_config"):
        stage_update(WeightUpdate(kind="lora", state_dict={"w": torch.ones(1)}), tmp_path)
    path_update = WeightUpdate(path="/somewhere")
    assert stage_update(path_update, tmp_path) is path_update


def test_a_tied_checkpoint_gets_its_output_layer_for_vllm(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "model"
    src.mkdir()
    embed = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    save_file({"model.embed_tokens.weight": embed, "x": torch.ones(2)}, src / "model.safetensors")
    out = with_output_layer(src, tmp_path)
    assert out != src and (out / "model.safetensors").is_symlink()
    assert torch.equal(load_file(out / "lm_head.safetensors")["lm_head.weight"], embed)
    assert set(safetensors_index(out)) == {"model.embed_tokens.weight", "x", "lm_head.weight"}
    assert with_output_layer(out, tmp_path) == out  # already has it
    (src / "model.safetensors").unlink()
    save_file({"x": torch.ones(2)}, src / "model.safetensors")
    with pytest.raises(UserError, match="no single embedding matrix"):
        with_output_layer(src, tmp_path)


def _vllm_argv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu: bool, **options: object
) -> list[str]:
    """The command line ``VLLMEngine.launch`` would run (nothing is started)."""
    from areal_agents.engines import vllm

    seen: list[list[str]] = []
    monkeypatch.setattr(vllm, "cpu_build", lambda python: cpu)
    monkeypatch.setattr(vllm, "find_python", lambda python: python)
    monkeypatch.setattr(
        vllm.VLLMEngine,
        "_start_and_connect",
        classmethod(lambda cls, argv, **kw: seen.append(argv)),
    )
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    vllm.VLLMEngine.launch(str(model), python=sys.executable, **options)  # type: ignore[arg-type]
    return seen[0]


def _budget(argv: list[str]) -> int | None:
    if "--no-enable-chunked-prefill" not in argv:
        return None
    return int(argv[argv.index("--max-num-batched-tokens") + 1])


def test_a_cpu_build_of_vllm_is_started_without_chunked_prefill(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Chunked prefill with a seeded request kills vLLM's CPU build (the module docstring of
    areal_agents.engines.vllm): launched on one, every prompt is prefilled in one step, with
    a token budget of at least the context (the model's, or the one given)."""
    assert _budget(_vllm_argv(monkeypatch, tmp_path, cpu=True)) == 8192
    assert _budget(_vllm_argv(monkeypatch, tmp_path, cpu=True, max_model_len=1024)) == 2048
    assert _budget(_vllm_argv(monkeypatch, tmp_path, cpu=True, max_model_len=4096)) == 4096
    argv = _vllm_argv(monkeypatch, tmp_path, cpu=True, extra_args=["--max-model-len", "3000"])
    assert _budget(argv) == 3000
    argv = _vllm_argv(monkeypatch, tmp_path, cpu=True, extra_args=["--max-model-len=5000"])
    assert _budget(argv) == 5000
    # The user's own schedule is left alone, and a GPU build keeps vLLM's default.
    for flags in (["--enable-chunked-prefill"], ["--max-num-batched-tokens=512"]):
        argv = _vllm_argv(monkeypatch, tmp_path, cpu=True, extra_args=flags)
        assert "--no-enable-chunked-prefill" not in argv and argv[-1] == flags[-1]
    assert "--no-enable-chunked-prefill" not in _vllm_argv(monkeypatch, tmp_path, cpu=False)


def test_a_python_without_vllm_is_not_a_cpu_build() -> None:
    from areal_agents.engines.vllm import cpu_build

    assert cpu_build(sys.executable) is False
    assert cpu_build("/nonexistent/python") is False


def test_the_prefill_schedule_is_read_from_server_info() -> None:
    """What ``connect`` reads to decide whether a CPU server may get seeded requests."""
    import httpx

    from areal_agents.engines.vllm import prefill_schedule

    def server(chunked: bool | None) -> httpx.Client:
        def answer(request: httpx.Request) -> httpx.Response:
            assert request.url.path == "/server_info"
            if chunked is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            config = {
                "device_config": {"device": "cpu", "device_type": "cpu"},
                "scheduler_config": {"enable_chunked_prefill": chunked},
            }
            return httpx.Response(200, json={"vllm_config": config})

        return httpx.Client(base_url="http://vllm", transport=httpx.MockTransport(answer))

    assert prefill_schedule(server(True)) == ("cpu", True)
    assert prefill_schedule(server(False)) == ("cpu", False)
    assert prefill_schedule(server(None)) is None


async def test_a_server_that_may_not_get_seeds_gets_none() -> None:
    from areal_agents.engines.protocol import SamplingParams
    from areal_agents.engines.vllm import VLLMEngine

    sent: list[dict[str, object]] = []

    class Recording(VLLMEngine):
        async def _request(
            self, method: str, path: str, *, json: object = None, params: object = None
        ) -> object:
            assert isinstance(json, dict)
            sent.append(json["sampling_params"])
            answer = {"token_ids": [5], "logprobs": {"content": [{"logprob": -0.5}]}}
            return {"choices": [{**answer, "finish_reason": "length"}]}

    engine = Recording("http://vllm", dev_mode=True, model_name="m", max_context=100)
    params = SamplingParams(max_new_tokens=1, seed=7)
    await engine.generate([1, 2], params)
    engine.send_seeds = False
    await engine.generate([1, 2], params)
    assert [s.get("seed") for s in sent] == [7, None]
