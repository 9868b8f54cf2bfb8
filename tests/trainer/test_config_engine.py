"""The ``engine`` section: defaults, what combines with what, and what the servers get."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_agents.engines.servers import (
    Launch,
    LaunchConfig,
    server_env,
    split_cores,
    vllm_lora_rank,
)
from areal_agents.errors import ConfigError
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.engine_build import check_lora_targets, first_sync

BASE = ["env.id=areal/Calculator-v0"]


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, *overrides])
    return info.value.problems


def test_the_default_engine_is_embedded_and_todays_configs_do_not_change() -> None:
    cfg = load_config("examples/agents/quickstart.yaml")
    assert cfg.engine.backend == "embedded" and not cfg.engine.server
    assert cfg.engine.urls == () and cfg.engine.weights_dir is None


def test_a_server_backend_reads_its_launch_and_attach_keys() -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "engine.backend=vllm",
            "engine.launch.servers=2",
            "engine.launch.args=--max-model-len 2048",
            'engine.launch.env={"VLLM_CPU_KVCACHE_SPACE": "4"}',
            "rollout.engine_cpus=[0, 1]",
        ],
    )
    assert cfg.engine.launch.servers == 2 and cfg.engine.launch.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    attached = load_config(None, [*BASE, "engine.backend=sglang", 'engine.urls=["http://h:1"]'])
    assert attached.engine.urls == ("http://h:1",)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (['engine.urls=["http://h:1"]'], "engine.urls: only server backends use it"),
        (["engine.launch.servers=2"], "engine.launch: starts inference servers"),
        (["engine.weights_dir=/shared/w"], "engine.weights_dir: only server backends"),
        (["engine.lora_updates=merged"], "engine.lora_updates: only server backends"),
        (
            ["engine.backend=vllm", "engine.lora_updates=merged", "model.lora.enabled=false"],
            "engine.lora_updates: 'merged' merges LoRA updates, but model.lora is off",
        ),
        (["engine.backend=vllm", "engine.lora_updates=both"], "engine.lora_updates"),
        (
            ["engine.backend=vllm", 'engine.urls=["http://h:1"]', "engine.launch.servers=2"],
            "engine.launch: the run attaches to engine.urls",
        ),
        (["engine.backend=vllm", 'engine.urls=["h:1"]'], "engine.urls: must be http(s) URLs"),
        (
            ["engine.backend=vllm", "scheduler=ray", "rollout.idle_engine_cpus=[1]"],
            "rollout.idle_engine_cpus: an idle-priority replica is the embedded engine's",
        ),
        (
            ["engine.backend=vllm", 'engine.urls=["http://h:1"]', "rollout.engine_cpus=[0]"],
            "rollout.engine_cpus: places the servers this run launches",
        ),
        (
            ["engine.backend=vllm", "engine.launch.gpus=1", "rollout.engine_cpus=[0]"],
            "set one of the two",
        ),
        (
            ["engine.backend=vllm", "engine.launch.servers=3", "rollout.engine_cpus=[0, 1]"],
            "2 core(s) for engine.launch.servers=3",
        ),
        (
            ["engine.backend=vllm", "rollout.kv_on_update=keep"],
            "set rollout.kv_on_update=recompute",
        ),
        (["engine.backend=vllm", "sampling.top_k=20"], "renormalised over the tokens"),
        (["engine.backend=vllm", "sampling.top_p=0.9"], "renormalised over the tokens"),
        (
            ["engine.backend=vllm", 'sampling.by_kind={"word": {"top_p": 0.5}}'],
            "sampling.by_kind.word: sets top_k/top_p",
        ),
        (["engine.backend=sglang"], "SGLang runs on GPUs only"),
        (
            ["engine.backend=vllm", "scheduler=ray", 'engine.urls=["http://h:1"]'],
            "attaches to engine.urls instead",
        ),
        (["rollout.engine_cpus=[0]"], "which only scheduler=ray or a server backend"),
    ],
)
def test_bad_combinations_fail_before_the_run_with_the_fix(
    overrides: list[str], expected: str
) -> None:
    found = problems(*overrides)
    assert any(expected in p for p in found), found


def test_sglang_truncation_is_allowed_its_logprobs_are_untruncated() -> None:
    cfg = load_config(
        None, [*BASE, "engine.backend=sglang", "engine.launch.gpus=1", "sampling.top_k=20"]
    )
    assert cfg.sampling.top_k == 20


def test_vllm_lora_rank_is_the_smallest_it_accepts() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 512)] == [
        1, 8, 8, 16, 16, 32, 320, 512,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.lora\.r: 513"):
        vllm_lora_rank(513)


def test_cores_are_split_evenly_and_bound_for_vllm() -> None:
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    launch = Launch(LaunchConfig(servers=2), cpus=(4, 5, 6, 7))
    env, cores = server_env("vllm", launch, 1)
    assert cores == [6, 7] and env["VLLM_CPU_OMP_THREADS_BIND"] == "6,7"
    env, cores = server_env("sglang", Launch(LaunchConfig(servers=2, gpus=2)), 1)
    assert cores is None and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    given = Launch(LaunchConfig(env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"}), cpus=(0, 1))
    assert server_env("vllm", given, 0)[0]["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_the_backend_flags_are_overrides_of_the_engine_section() -> None:
    from areal_agents.cli.main import _build_parser
    from areal_agents.cli.train import engine_overrides

    parse = _build_parser().parse_args
    attach = parse(
        ["train", "--backend", "vllm", "--engine-url", "http://a:1", "--engine-url", "http://b:2"]
    )
    cfg = load_config(None, [*BASE, *engine_overrides(attach)])
    assert cfg.engine.backend == "vllm" and cfg.engine.urls == ("http://a:1", "http://b:2")
    launch = parse(
        [
            "train",
            "--backend",
            "vllm",
            "--engine-python",
            "/v/bin/python",
            "--engine-args=--enforce-eager",
        ]
    )
    cfg = load_config(None, [*BASE, *engine_overrides(launch)])
    assert cfg.engine.launch.python == "/v/bin/python"
    assert cfg.engine.launch.args == "--enforce-eager"
    none = _build_parser().parse_args(["train"])
    assert engine_overrides(none) == []


class _Conv2dLora(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = torch.nn.Conv2d(1, 1, 1)


class _LinearLora(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(2, 2)


def test_vllm_refuses_lora_targets_it_cannot_serve() -> None:
    model = torch.nn.ModuleDict({"q_proj": _LinearLora(), "patch_conv": _Conv2dLora()})
    cfg = load_config(None, [*BASE, "engine.backend=vllm", "model.lora.enabled=true"])
    with pytest.raises(ConfigError, match="patch_conv is not one"):
        check_lora_targets(model, cfg)
    check_lora_targets(torch.nn.ModuleDict({"q_proj": _LinearLora()}), cfg)
    embedded = load_config(None, [*BASE, "model.lora.enabled=true"])
    check_lora_targets(model, embedded)  # the embedded engine serves any peft layer


class _Unreadable:
    async def update_weights(self, update: Any) -> int:
        raise ValueError("the sglang server rejected POST /load_lora_adapter: No such file")


async def test_a_server_that_cannot_load_the_initial_weights_names_weights_dir(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        None,
        [*BASE, "engine.backend=sglang", 'engine.urls=["http://h:1"]', "engine.weights_dir=/w"],
    )
    with pytest.raises(ConfigError, match=r"engine.weights_dir: .* from /w: .*No such file"):
        await first_sync(cfg, _Unreadable(), object(), tmp_path)


def test_metrics_rows_carry_the_engine_tag(tmp_path: Path) -> None:
    from areal_agents.trainer.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=False, tags={"engine": "vllm"})
    writer.log(1, {"loss": 0.5})
    writer.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "engine": "vllm", "loss": 0.5}


def test_ray_holds_the_launched_servers_and_the_episodes_stay_here() -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "scheduler=ray",
            "engine.backend=vllm",
            "engine.launch.servers=2",
            "eval.episodes=8",
        ],
    )
    assert cfg.scheduler == "ray" and not cfg.ray_rollout  # eval.episodes: run here
    embedded = problems("scheduler=ray", "eval.episodes=8")
    assert any("eval.episodes" in p for p in embedded)
