"""examples/agents/search.yaml: the recipe as shipped but short on the tiny model (warm start
on demonstrations the env writes, 2 RL steps, the held-out evaluation on the test split),
and the recipe's env played by a scripted policy through the real proxy and runner, whose
tool calls, grounding and hop counts reach the episode and the evaluation summary."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from areal_agents.envs.search import SearchEnv
from areal_agents.trainer.config_io import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "agents" / "search.yaml"


@pytest.mark.slow
def test_the_search_recipe_warm_starts_trains_and_evaluates_on_the_test_split(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Untrained, the tiny model never calls a tool and every reward is 0; DAPO's dynamic
    sampling would then drop every group and sample others forever, so the short run trains
    with plain GRPO (the only change of substance; the rest is size)."""
    from areal_agents.trainer.loop import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        RECIPE,
        [
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "algorithm=grpo",
            "sft.generate=4",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "rollout.probe_size=0",
            "rollout.concurrency=4",
            "sampling.max_new_tokens=8",
            "eval.episodes=2",
            "train.steps=2",
            "train.save_every=0",
            "metrics.tensorboard=false",
            f"train.output_dir={run}",
        ],
    )
    assert cfg.env.kwargs["hops"] == [1, 2] and cfg.train.time_limit_min == 30
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    assert summary["reward_mean"] == 0.0
    # the warm start trained on solved episodes of the train split, with their tool calls
    env = SearchEnv(**cfg.env.kwargs)
    train = {t.question: t for t in env.tasks}
    demos = [json.loads(line)["messages"] for line in (run / "sft_demos.jsonl").open()]
    assert len(demos) == 4 and all(d[1]["content"] in train for d in demos)
    for demo in demos:
        calls = [c["function"]["name"] for m in demo for c in m.get("tool_calls") or []]
        assert calls == ["search", "open"] * train[demo[1]["content"]].hops
    # every training episode counted its tool calls, in the metrics and in episodes.db
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2 and all(r["tool_calls_mean"] == 0.0 for r in steps)
    db = sqlite3.connect(run / "episodes.db")
    ended = "select group_id, metadata from sessions where end_reason = 'terminated'"
    metas = {group: json.loads(m) for group, m in db.execute(ended)}  # not the cancelled
    assert any(g.startswith("g") for g in metas) and any(g.startswith("eval-") for g in metas)
    assert all(m["env"] == "areal/Search-v0" and m["tool_calls"] == 0 for m in metas.values())
    # held out: base, warm start and final, on test questions, success by hop count
    evals = json.loads((run / "eval.json").read_text())
    assert [e["label"] for e in evals] == ["base", "warm_start", "final"]
    assert all(e["episodes"] == 2 and e["mean_tool_calls"] == 0.0 for e in evals)
    assert all(set(e["by_kind"]) <= {"1-hop", "2-hop"} and e["by_kind"] for e in evals)
    assert "test split" in summary["held_out"]


async def test_a_scripted_policy_on_the_recipes_env_records_tool_calls_and_grounding(
    tiny_model_dir: Path,
) -> None:
    """A 1-hop and a 2-hop demonstration replayed as model replies through the real proxy:
    each episode counts its search and open calls and ends as a grounded success."""
    import yaml

    from areal_agents.rollout.evaluate import summarize
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.testing.fake_engine import FakeEngine

    kwargs = yaml.safe_load(RECIPE.read_text())["env"]["kwargs"]
    env = SearchEnv(**kwargs)
    demos = {(len(d) - 3) // 4: d for d in env.demos(20, seed=0)}
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    end = tok.token_id("<|im_end|>")
    assert end is not None
    results = []
    for hops in (1, 2):
        demo = demos[hops]
        task = next(t for t in env.tasks if t.question == demo[1]["content"])
        replies = iter([_as_text(m) for m in demo if m["role"] == "assistant"])

        def play(ids: list[int], params: Any, replies: Any = replies) -> list[int]:
            return [*tok.encode(next(replies)), end]

        proxy = Proxy(FakeEngine(play), tok)
        result = await Runner(proxy, max_turns=6).run_episode(
            lambda: SearchEnv(**kwargs), options={"task_id": task.id}
        )
        assert result.end_reason == "terminated", result.error
        assert (result.tool_calls, result.tool_errors) == (2 * hops, 0)
        assert result.episode.metadata["tool_calls"] == 2 * hops
        assert result.info["grounded"] is True and result.info["hops"] == hops
        assert result.info["opened_documents"] == list(task.chain)
        results.append(result)
    report = summarize("areal/Search-v0", [[r] for r in results], k=1)
    assert report.success_rate == report.grounded_success_rate == 1.0
    assert report.by_kind == {"1-hop": 1.0, "2-hop": 1.0} and report.mean_tool_calls == 3.0


def _as_text(message: dict[str, Any]) -> str:
    """An assistant message as the model writes it (the chat template's tool-call format)."""
    if not message.get("tool_calls"):
        return str(message["content"])
    [call] = message["tool_calls"]
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
