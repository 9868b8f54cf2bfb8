"""The GPU layouts of docs/scaling.md ("Training on GPUs") load as configs and say what they
claim; their CPU forms run in tests/engines/test_train_vllm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_agents.trainer.config_io import load_config

LAYOUTS = sorted((Path(__file__).resolve().parents[2] / "examples" / "gpu").glob("*.yaml"))


def test_every_layout_is_listed() -> None:
    assert [p.name for p in LAYOUTS] == [
        "inference_and_training_gpus.yaml",
        "one_gpu_shared.yaml",
        "ray_servers_and_ranks.yaml",
    ]
    doc = (LAYOUTS[0].parents[2] / "docs" / "scaling.md").read_text()
    for path in LAYOUTS:
        assert f"examples/gpu/{path.name}" in doc


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.stem)
def test_a_layout_puts_the_server_and_the_trainer_where_it_says(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.engine.backend == "vllm" and cfg.engine.launch.gpus == 1
    if cfg.scheduler == "ray":  # N servers and M trainer ranks, all Ray actors
        assert cfg.engine.launch.servers == cfg.train.nproc == 4 and not cfg.ray_rollout
        assert cfg.engine.weights_dir and cfg.engine.weights_dir.startswith("/shared/")
        return
    assert cfg.model.device in ("cuda:0", "cuda:1")
    shared = cfg.model.device == "cuda:0"
    assert ("--gpu-memory-utilization 0.4" in cfg.engine.launch.args) == shared
    cpu_form = load_config(
        path,
        ["engine.launch.gpus=0", "model.device=cpu", "rollout.engine_cpus=[0]", "train.cpus=[1]"],
    )
    assert cpu_form.engine.server and cpu_form.rollout.engine_cpus == (0,)
