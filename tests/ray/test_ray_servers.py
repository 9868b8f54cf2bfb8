"""``scheduler: ray`` with a server backend: the launched servers are held by Ray actors
(areal_agents.rollout.ray_servers), here the fake SGLang server on CPU (the CPU form of N
inference servers on Ray, docs/scaling.md "Training on GPUs")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_agents.engines.protocol import SamplingParams
from areal_agents.errors import BackendError

FAKE = "areal_agents.testing.fake_sglang"


def test_a_server_on_a_ray_actor_is_restarted_there_after_a_kill(
    cluster: Any, tiny_model_dir: Path
) -> None:
    from areal_agents.engines.servers import Launch, LaunchConfig, start_server_engine
    from areal_agents.rollout.ray_servers import RayServer, ray_starter

    launch = Launch(
        LaunchConfig(python=sys.executable, module=FAKE, max_restarts=1, start_timeout_s=120),
        starter=ray_starter(cpus_per_server=0.5),
    )
    engine = start_server_engine("sglang", str(tiny_model_dir), launch=launch)
    server = engine.server
    assert isinstance(server, RayServer) and server.running
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)

    async def main() -> None:
        assert len((await engine.generate([1, 2, 3], params)).output_ids) >= 1
        pid = cluster.get(server.actor.pid.remote())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(BackendError, match="died while this request ran"):
            await engine.generate([1, 2, 3], params)
        assert server.running and (await engine.health())["restarts"] == 1
        assert len((await engine.generate([1, 2, 3], params)).output_ids) >= 1
        await engine.close()

    asyncio.run(main())
    assert not server.running


@pytest.mark.slow
def test_training_with_servers_held_by_ray_actors(
    cluster: Any, tiny_model_dir: Path, parity_env: str, tmp_path: Path
) -> None:
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import train

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "scheduler=ray",
            f"env.id={parity_env}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.device=cpu",
            "model.lora.enabled=true",
            "model.lora.r=8",
            "engine.backend=sglang",
            f"engine.launch.python={sys.executable}",
            f"engine.launch.module={FAKE}",
            "engine.launch.servers=2",
            "rollout.engine_cpus=[0, 1]",
            "rollout.group_size=4",
            "rollout.batch_size=2",
            "rollout.concurrency=8",
            "rollout.max_turns=1",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "optim.lr=5e-3",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and {r["engine"] for r in rows} == {"sglang"}
    # both servers answered (sessions spread over them) and took every weight update
    logs = sorted((out / "engine").glob("sglang-*.log"))
    assert [p.name for p in logs] == ["sglang-0.log", "sglang-1.log"]
    # two servers x (the initial weights + step 1's); step 2's metrics come before its sync
    assert rows[-1]["engine/updates"] == 2 * 2
    assert rows[-1]["engine/requests"] >= 2 * 2 * 4
    kl = [r["mismatch/kl"] for r in rows if "mismatch/kl" in r]
    assert kl and max(kl) < 1e-4
