"""The judge (``rewards.judge``, :mod:`areal_agents.trainer.judge`): scores read from replies,
the rubric's weighted mean and the reward combination against hand-computed values, ranking
mapped back through the shuffle, the cache (memory and JSONL), timeouts and unreadable replies
ending as ``judge_error``, and the run's own proxy as judge (non-trained sessions of group
``judge-*``). The HTTP judge is a real FastAPI app on loopback that scores deterministically.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request

from areal_agents.errors import ConfigError
from areal_agents.rollout.runner import EpisodeResult
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.config_rollout import RewardsConfig
from areal_agents.trainer.judge import (
    Criterion,
    HttpBackend,
    Judge,
    JudgeError,
    ProxyBackend,
    make_judge,
    parse_scores,
    rubric_score,
    trace_summary,
    yes_probability,
)
from areal_agents.trajectory import Completion, Episode

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- a fake judge
def _fake_judge_app(calls: list[dict[str, Any]]) -> FastAPI:
    """An OpenAI-compatible judge that reads the prompt and scores by rule:

    * rubric: ``correct: 9`` if the answer names Paris, else ``correct: 2``; always
      ``concise: 6``; an answer with GARBLE gets an unreadable reply, one with SLOW a reply
      after 2 s;
    * ranking: ``Answer k: n`` where the k-th shown answer reads ``quality n``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        calls.append(body)
        prompt = body["messages"][1]["content"]
        logprobs = None
        if body.get("logprobs"):  # a yes/no question: P(yes) 0.9 for Paris, else 0.2
            p = 0.9 if "Paris" in prompt.split("Answer:\n", 1)[1] else 0.2
            top = [("Yes", p), (" no", (1 - p) / 2), ("No", (1 - p) / 2)]
            alts = [{"token": t, "logprob": math.log(q), "bytes": None} for t, q in top]
            logprobs = {"content": [{**alts[0], "top_logprobs": alts}]}
            text = "Yes"
        elif "Answer to grade:" in prompt:
            answer = prompt.split("Answer to grade:\n", 1)[1].split("\n\nGrade", 1)[0]
            if "SLOW" in answer:
                await asyncio.sleep(2.0)
            if "GARBLE" in answer:
                text = "I think it is quite good overall."
            else:
                text = f"correct: {9 if 'Paris' in answer else 2}\nconcise: 6"
        else:
            shown = re.findall(r"Answer (\d+):\nquality (\d+)", prompt)
            text = "\n".join(f"Answer {k}: {n}" for k, n in shown)
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": 7, "total_tokens": 0},
        }

    return app


@pytest.fixture(scope="module")
def judge_server():
    """The fake judge on a free loopback port, in a thread: (base_url, the calls it got)."""
    calls: list[dict[str, Any]] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_fake_judge_app(calls), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "the fake judge did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", calls
    server.should_exit = True
    thread.join(10)


def _result(answer: str, *, env_final: float = 1.0, turn_reward: float = 0.5) -> EpisodeResult:
    """A two-turn episode: a search call (turn reward ``turn_reward``), then ``answer``."""
    question = {"role": "user", "content": "What is the capital of France?"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "capital France"}'},
            }
        ],
    }
    first = Completion("c-1", [question], [1, 2], [3, 4], [-0.1, -0.2], [0, 0], call, "tool_calls")
    first.reward = turn_reward
    second = Completion(
        "c-2",
        [question, call, {"role": "tool", "tool_call_id": "c1", "content": "Paris is..."}],
        [1, 2, 3, 4, 5],
        [6, 7],
        [-0.3, -0.4],
        [0, 0],
        {"role": "assistant", "content": answer},
        "stop",
    )
    ep = Episode("sess-" + answer[:8], [first, second], final_reward=env_final, ended=True)
    ep.end_reason = "terminated"
    return EpisodeResult(ep, env_final + turn_reward, True, 2, "terminated")


def _rewards(**judge: Any) -> RewardsConfig:
    sets = [f"rewards.judge.{k}={json.dumps(v)}" for k, v in judge.items()]
    cfg = load_config(None, ["env.id=areal/Search-v0", *sets])
    return cfg.rewards


RUBRIC = {
    "correct": {"description": "The answer states the right fact.", "weight": 2},
    "concise": "It is short.",
}


def calibration_file(tmp_path: Path) -> Path:
    """64 labelled answers the fake judge tells apart: 32 naming Paris (right), 32 not (with
    the reference answer, which search_judge.yaml shows the judge)."""
    path = tmp_path / "calibration.jsonl"
    rows = [
        {
            "prompt": "What is the capital of France?",
            "answer": f"It is {city} ({i}).",
            "label": ok,
            "reference": ["Paris"],
        }
        for i in range(32)
        for city, ok in (("Paris", True), ("Lyon", False))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _with_weights(cfg: RewardsConfig, env: float, judge: float) -> RewardsConfig:
    import dataclasses

    return dataclasses.replace(cfg, env_weight=env, judge_weight=judge)


# ---------------------------------------------------------------------------- pure parts
def test_rubric_score_is_the_weighted_mean():
    crit = [Criterion("correct", "right", 2.0), Criterion("concise", "short", 1.0)]
    # (2 * 8 + 1 * 5) / (10 * 3) = 21 / 30
    assert rubric_score({"correct": 8, "concise": 5}, crit) == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("correct: 8\nconcise: 5", {"correct": 8, "concise": 5}),
        ('Sure. {"correct": 7, "concise": 3.5}', {"correct": 7, "concise": 3.5}),
        ("**Correct**: 9/10\n- concise = 12", {"correct": 9, "concise": 10}),  # clamped
    ],
)
def test_parse_scores(text, want):
    assert parse_scores(text, ["correct", "concise"]) == want


def test_parse_scores_names_what_is_missing():
    with pytest.raises(JudgeError, match="no score for concise"):
        parse_scores("correct: 3", ["correct", "concise"])


def test_yes_probability_adds_every_spelling():
    top = [("Yes", math.log(0.5)), (" yes", math.log(0.1)), ("No", math.log(0.2)), ("x", 0.0)]
    # (0.5 + 0.1) / (0.5 + 0.1 + 0.2)
    assert yes_probability(top) == pytest.approx(0.75)
    with pytest.raises(JudgeError, match="neither Yes nor No"):
        yes_probability([("Maybe", -0.1)])


def test_trace_summary_lists_the_tool_calls():
    ep = _result("x").episode
    assert trace_summary(ep, 500) == '- search({"query": "capital France"}) -> Paris is...'
    assert trace_summary(ep, 10) == "(1 earlier calls not shown)"


# ---------------------------------------------------------------------------- HTTP judge
async def _http_judge(url: str, out: Path | None, **judge: Any) -> Judge:
    cfg = _rewards(mode="rubric", base_url=url, rubric=RUBRIC, **judge)
    j = make_judge(cfg, None, out)
    assert j is not None
    await j.start()
    return j


async def test_rubric_rewards_combine_by_the_weights(judge_server, tmp_path):
    url, _ = judge_server
    j = await _http_judge(url, tmp_path)
    assert j.backend.model == "fake-judge"  # the first model the endpoint lists
    j.rewards = _with_weights(j.rewards, env=0.5, judge=2.0)
    good, bad = _result("It is Paris."), _result("It is Lyon.")
    await j.apply("g0", [good, bad])
    # correct 9 (w 2), concise 6 (w 1): (18 + 6) / 30 = 0.8; correct 2: (4 + 6) / 30 = 1/3
    assert good.episode.metadata["judge"]["score"] == pytest.approx(0.8)
    assert bad.episode.metadata["judge"]["score"] == pytest.approx(1 / 3)
    # every turn reward * 0.5; final 0.5 * 1.0 + 2 * score; reward 0.5 * 1.5 + 2 * score
    assert [c.reward for c in good.episode.completions] == [0.25, 0.0]
    assert good.episode.final_reward == pytest.approx(0.5 + 1.6)
    assert good.reward == pytest.approx(0.75 + 1.6)
    assert bad.reward == pytest.approx(0.75 + 2 / 3)
    assert good.ok and bad.ok
    m = j.metrics()
    assert m["judge/calls"] == 2 and m["judge/errors"] == 0 and m["judge/cache_hits"] == 0
    assert m["judge/prompt_tokens"] > 0 and m["judge/completion_tokens"] == 14
    assert m["judge/score_mean"] == pytest.approx((0.8 + 1 / 3) / 2)
    assert "judge/score_mean" not in j.metrics()  # per step: reset once reported
    await j.close()


async def test_logprob_scoring_asks_one_yes_no_question_per_criterion(judge_server):
    url, calls = judge_server
    j = await _http_judge(url, None, scoring="logprobs")
    good, bad = _result("It is Paris (logprobs)."), _result("It is Lyon (logprobs).")
    before = len(calls)
    await j.apply("g0", [good, bad])
    asked = calls[before:]
    assert len(asked) == 4  # 2 episodes x 2 criteria
    assert all(c["max_tokens"] == 1 and c["top_logprobs"] == 20 for c in asked)
    # P(yes) 0.9 on both criteria: (2 * 9 + 1 * 9) / 30; 0.2: (2 * 2 + 2) / 30
    assert good.episode.metadata["judge"]["scores"] == pytest.approx({"correct": 9, "concise": 9})
    assert good.episode.metadata["judge"]["score"] == pytest.approx(0.9)
    assert bad.episode.metadata["judge"]["score"] == pytest.approx(0.2)
    await j.close()


async def test_the_cache_answers_the_same_content_again(judge_server, tmp_path):
    url, calls = judge_server
    j = await _http_judge(url, tmp_path)
    await j.apply("g0", [_result("Paris, cached")])
    n = len(calls)
    again = _result("Paris, cached")
    await j.apply("g1", [again])
    assert len(calls) == n and j.stats.cache_hits == 1
    assert again.episode.metadata["judge"]["score"] == pytest.approx(0.8)
    await j.close()
    # a resumed run: the JSONL cache is read back
    k = await _http_judge(url, tmp_path)
    await k.apply("g2", [_result("Paris, cached")])
    assert len(calls) == n and k.stats.cache_hits == 1 and k.stats.calls == 0
    await k.close()


async def test_an_unreadable_reply_is_asked_again_then_is_a_judge_error(judge_server):
    url, calls = judge_server
    j = await _http_judge(url, None, retries=2)
    r, fine = _result("GARBLE GARBLE"), _result("Paris")
    before = len(calls)
    await j.apply("g0", [r, fine])
    assert len(calls) - before == 3 + 1  # 1 + 2 retries, and the readable one
    retry = calls[-2] if "GARBLE" in json.dumps(calls[-2]) else calls[-1]
    assert retry["messages"][-1]["content"].startswith("That reply could not be read")
    assert r.end_reason == "judge_error" and not r.ok
    assert r.episode.end_reason == "judge_error"
    assert [e["kind"] for e in r.episode.errors] == ["judge_error"]  # recorded once
    assert "no score for correct" in r.episode.errors[0]["message"]
    assert r.reward == 1.5 and "judge" not in r.episode.metadata  # never a silent 0
    assert fine.ok and j.stats.errors == 1
    await j.close()


async def test_a_slow_judge_times_out_as_a_judge_error(judge_server):
    url, _ = judge_server
    j = await _http_judge(url, None, timeout_s=0.3, retries=0)
    r = _result("SLOW answer")
    await j.apply("g0", [r])
    assert r.end_reason == "judge_error"
    assert "did not answer within 0.3 s" in r.episode.errors[0]["message"]
    await j.close()


async def test_ranking_maps_scores_back_through_the_shuffle(judge_server):
    url, calls = judge_server
    cfg = _rewards(mode="ranking", base_url=url)
    j = make_judge(_with_weights(cfg, env=0.0, judge=1.0), None, None)
    assert j is not None
    group = [_result(f"quality {n}") for n in (3, 9, 5, 1)]
    await j.apply("g0", group)
    assert [r.reward for r in group] == pytest.approx([0.3, 0.9, 0.5, 0.1])
    prompt = calls[-1]["messages"][1]["content"]
    shown = [int(n) for n in re.findall(r"quality (\d+)", prompt)]
    assert sorted(shown) == [1, 3, 5, 9] and j.stats.calls == 1  # one call for the group
    await j.close()


async def test_an_unreachable_judge_is_a_config_error():
    cfg = _rewards(mode="rubric", base_url="http://127.0.0.1:9/v1", rubric=RUBRIC)
    backend = HttpBackend("http://127.0.0.1:9/v1", None, "none", 2.0)
    with pytest.raises(ConfigError, match="cannot reach the judge"):
        await Judge(cfg, backend).start()
    await backend.close()


def test_a_missing_api_key_is_a_config_error(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST", raising=False)
    cfg = _rewards(
        mode="rubric", base_url="http://x/v1", api_key_env="JUDGE_KEY_FOR_TEST", rubric=RUBRIC
    )
    with pytest.raises(ConfigError, match=r"\$JUDGE_KEY_FOR_TEST is not set"):
        make_judge(cfg, None, None)


# ---------------------------------------------------------------------------- own proxy
async def test_the_runs_own_proxy_judges_in_sessions_of_their_own(qwen_chat_tokenizer, tmp_path):
    from areal_agents import FakeEngine, Proxy
    from areal_agents.serve.store import EpisodeStore

    tok = qwen_chat_tokenizer
    end = tok.token_id("<|im_end|>")
    engine = FakeEngine(lambda ids, p: [*tok.encode("correct: 10\nconcise: 4"), end])
    store = EpisodeStore(tmp_path / "episodes.db")
    proxy = Proxy(engine, tok, store=store)
    j = make_judge(_rewards(mode="rubric", rubric=RUBRIC, self=True), proxy, tmp_path)
    assert isinstance(j.backend, ProxyBackend)
    r = _result("Paris")
    await j.apply("g7", [r])
    assert r.episode.metadata["judge"]["scores"] == {"correct": 10.0, "concise": 4.0}
    assert r.episode.metadata["judge"]["score"] == pytest.approx((20 + 4) / 30)
    store.flush_sync()
    judged = [store.load(sid) for sid in store.session_ids()]
    assert [s.episode.group_id for s in judged if s is not None] == ["judge-g7"]
    assert all(s is not None and s.episode.end_reason == "terminated" for s in judged)
    assert not proxy.sessions.open_sessions()
    # yes/no questions: the fake engine's sampled token is its only alternative
    engine._script = lambda ids, p: [*tok.encode("Yes"), end]
    j = make_judge(
        _rewards(mode="rubric", rubric=RUBRIC, scoring="logprobs", self=True), proxy, None
    )
    r = _result("Paris")
    await j.apply("g8", [r])
    assert r.episode.metadata["judge"]["score"] == pytest.approx(1.0)
    store.close()


# ---------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rewards.judge.mode=rubric"], "rewards.judge.rubric: must be at least one criterion"),
        (
            ["rewards.judge.mode=ranking"],
            "rewards.judge.base_url: must be the judge's OpenAI-compatible /v1 URL, or set "
            "rewards.judge.self=true",
        ),
        (
            ["rewards.judge.mode=ranking", "rewards.judge.self=true", "rewards.judge.base_url=u"],
            "rewards.judge.self: must be false with base_url",
        ),
        (
            ["rewards.judge.mode=ranking", "rewards.judge.self=true", "rewards.judge.min_auc=2"],
            "rewards.judge.min_auc: must be in [0, 1]",
        ),
        (
            [
                "rewards.judge.mode=ranking",
                "rewards.judge.self=true",
                "rewards.judge.calibration_episodes=16",
            ],
            "rewards.judge.calibration_episodes: must be >= 64",
        ),
        (
            [
                "rewards.judge.mode=ranking",
                "rewards.judge.self=true",
                "rewards.judge.calibration=c.jsonl",
                "rewards.judge.calibration_episodes=128",
            ],
            "rewards.judge.calibration_episodes: must be left at 64 with a calibration file",
        ),
        (
            ["rewards.judge.mode=ranking", "rewards.judge.base_url=u", "rollout.agents=external"],
            "rewards.judge.calibration: the judge's calibration episodes run in this process",
        ),
        (
            ['rewards.judge.rubric={"correct": "right"}'],
            "rewards.judge.mode: must be rubric or ranking: rubric set",
        ),
        (["rewards.env_weight=0"], "rewards.env_weight: must be left at 1 without a judge"),
        (
            ["rewards.judge.mode=ranking", "rewards.judge.self=true", "rewards.judge.model=x"],
            "rewards.judge.model: must be null without base_url",
        ),
        (
            ["rewards.judge.mode=rubric", 'rewards.judge.rubric={"ok": {"weight": -1}}'],
            "rewards.judge.rubric: must be {name: description}",
        ),
        (
            ["rewards.judge.mode=ranking", "rewards.judge.scoring=logprobs"],
            "rewards.judge.scoring: must be text with mode=ranking",
        ),
        (
            ["rewards.judge.mode=ranking", "scheduler=ray"],
            "rewards.judge.base_url: with scheduler=ray",
        ),
    ],
)
def test_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["env.id=areal/Search-v0", *overrides])
    assert any(message in p for p in exc.value.problems), exc.value.problems


async def test_a_judge_that_never_scores_ends_the_run(judge_server):
    from areal_agents.trainer.judge import FAIL_FAST

    url, _ = judge_server
    j = await _http_judge(url, None, retries=0)
    with pytest.raises(ConfigError, match="failed on each of the first 16 episodes"):
        for g in range(FAIL_FAST):
            await j.apply(f"g{g}", [_result(f"GARBLE {g}")])
    await j.close()


# ---------------------------------------------------------------------------- a run
def test_the_judge_example_trains_on_judged_rewards(judge_server, tiny_model_dir, tmp_path):
    """examples/agents/search_judge.yaml, as shipped but short, on the tiny model, its judge
    the fake one over HTTP, calibrated on a labelled file: every trained episode's reward is
    0.2 * EM + 1.0 * score (the fake judge's P(yes) is 0.2 for an answer without Paris:
    score 0.2), the store holds the rescored episodes, and the step's metrics carry the
    judge's cost, its calibration and its agreement with the env's exact match."""
    import sqlite3

    from areal_agents.trainer.loop import Trainer

    url, _ = judge_server
    run = tmp_path / "run"
    cfg = load_config(
        ROOT / "examples/agents/search_judge.yaml",
        [
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            f"rewards.judge.base_url={url}",
            "rewards.judge.self=false",
            f"rewards.judge.calibration={calibration_file(tmp_path)}",
            "env.kwargs={reward: em, kb_questions: 40}",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=1",
            "metrics.tensorboard=false",
            f"train.output_dir={run}",
        ],
    )
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    assert summary["reward_mean"] == pytest.approx(0.2)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["judge/calls"] >= 4 and row["judge/errors"] == 0  # 2 criteria x 2 episodes
    assert row["judge/prompt_tokens"] > 0 and row["judge/score_mean"] == pytest.approx(0.2)
    # the file's Paris answers score 0.9, the others 0.2: every pair ordered
    assert row["judge/calib_auc"] == 1.0 and row["judge/calib_balanced_accuracy"] == 1.0
    assert json.loads((run / "judge_calibration.json").read_text())["answers"] == 64
    assert row["reward/judge_agreement"] == 1.0  # score 0.2: a fail, and no EM success
    db = sqlite3.connect(run / "episodes.db")
    trained = db.execute(
        "select distinct s.final_reward, s.metadata from train_tokens t "
        "join sessions s on s.id = t.session_id"
    ).fetchall()
    assert trained and all(f == pytest.approx(0.2) for f, _ in trained)
    assert all(json.loads(m)["judge"]["score"] == pytest.approx(0.2) for _, m in trained)


def test_the_research_example_runs_warm_start_and_step_groups(tiny_model_dir, tmp_path):
    """examples/agents/research.yaml, as shipped but short, on the tiny model: the warm start
    on demonstrations the env writes, step-level groups and the summarize policy, with the
    env's grounded reward alone (no judge). Untrained, the model never opens a document:
    every episode's reward is 0 (no evidence, no grounded fact)."""
    from areal_agents.trainer.loop import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        ROOT / "examples/agents/research.yaml",
        [
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "sft.generate=2",
            "rollout.group_size=2",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=1",
            "metrics.tensorboard=false",
            f"train.output_dir={run}",
        ],
    )
    assert cfg.context.policy == "summarize" and cfg.advantage.estimator == "step_group"
    assert cfg.rewards.judge.mode == "none" and cfg.env.kwargs["evidence_reward"] == 0.1
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    assert summary["reward_mean"] == pytest.approx(0.0)
    demos = (run / "sft_demos.jsonl").read_text().splitlines()
    assert len(demos) == 2 and all('"name": "open"' in row for row in demos)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert not any(k.startswith("judge/") for k in row)
