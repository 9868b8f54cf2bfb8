"""``areal-agent serve --backend ...``: mistakes end with a message that names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_agents.cli.main import main
from areal_agents.engines.launch import free_port


def _serve(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["serve", *args]) == 2
    return capsys.readouterr().err


def test_a_python_without_vllm_is_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    err = _serve(
        capsys, "--backend", "vllm", "--model", str(tiny_model_dir), "--engine-python", "/no/py"
    )
    assert "/no/py is not a Python that can import vllm" in err
    assert "requirements/make_venv.sh vllm .venv-vllm" in err


def test_engine_url_needs_a_server_backend(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    err = _serve(capsys, "--model", str(tiny_model_dir), "--engine-url", "http://127.0.0.1:1")
    assert "--engine-url needs --backend vllm or --backend sglang" in err


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_an_unreachable_server_is_named(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, backend: str
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    err = _serve(capsys, "--backend", backend, "--model", str(tiny_model_dir), "--engine-url", url)
    assert f"server at {url} is unreachable" in err


def test_ray_is_for_the_embedded_engine(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    err = _serve(
        capsys, "--backend", "sglang", "--ray", "--model", str(tiny_model_dir), "--engine-url", url
    )
    assert "drop --ray" in err
