"""The judge's calibration (:mod:`areal_agents.trainer.calibration`) and its agreement with
the env's verifier: the AUC and the balanced accuracy against hand-computed values, a
judge below ``rewards.judge.min_auc`` stopping the run before its first step (and the
override letting it run), calibration episodes labelled by the env's own ``success``, too few
labels naming the fix, and ``reward/judge_agreement`` on a hand-built step.

The judges are fakes: in process (a ``Backend`` that reads its score from the answer) or an
OpenAI-compatible app on loopback that scores by rule."""

from __future__ import annotations

import asyncio
import json
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
from areal_agents.trainer.calibration import auc, balanced_accuracy, measure
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.judge import Answer, Judge, Reply, parse_labelled
from areal_agents.trajectory import Completion, Episode

RUBRIC = {"correct": "The answer is right."}


# ---------------------------------------------------------------------------- fakes
class ScoreInAnswer:
    """An in-process judge backend: ``correct: N`` where the answer reads ``score N``."""

    model = "score-in-answer"

    async def chat(self, messages, *, max_tokens, temperature, group, top_logprobs=0):
        prompt = messages[1]["content"]
        n = re.search(r"Answer to grade:\nscore (\d+)", prompt)
        return Reply(f"correct: {n.group(1) if n else 'none'}", 10, 3)


def _judge(**judge: Any) -> Judge:
    sets = [f"rewards.judge.{k}={json.dumps(v)}" for k, v in judge.items()]
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "rewards.judge.mode=rubric",
            "rewards.judge.self=true",
            f"rewards.judge.rubric={json.dumps(RUBRIC)}",
            *sets,
        ],
    )
    return Judge(cfg.rewards, ScoreInAnswer())


def _judge_app(calls: list[str]) -> FastAPI:
    """An OpenAI-compatible rubric judge: ``correct: 9`` when the answer to grade holds
    PASS-ME, ``correct: 1`` when it holds FAIL-ME; any other answer (the Odd env's below)
    by its own length: 9 when odd, else 1."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "rule-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        prompt = body["messages"][1]["content"]
        answer = prompt.split("Answer to grade:\n", 1)[1].rsplit("\n\nGrade the answer", 1)[0]
        calls.append(answer)
        if "PASS-ME" in answer or "FAIL-ME" in answer:
            odd = "PASS-ME" in answer
        else:
            odd = answer != "(empty)" and len(answer) % 2 == 1
        return {
            "id": "x",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"correct: {9 if odd else 1}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }

    return app


@pytest.fixture(scope="module")
def rule_judge():
    """The rule judge on a free loopback port: (base_url, the answers it was asked about)."""
    calls: list[str] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_judge_app(calls), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "the rule judge did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", calls
    server.should_exit = True
    thread.join(10)


def _labelled_file(path: Path, *, inverted: bool, right: int = 32, wrong: int = 32) -> Path:
    """``right`` answers the rule judge passes labelled true and ``wrong`` ones it fails
    labelled false, or (``inverted``) the same answers with the labels swapped."""
    rows = [
        {"prompt": "Compute 2 + 3.", "answer": f"PASS-ME {i}", "label": not inverted}
        for i in range(right)
    ] + [
        {"prompt": "Compute 2 + 3.", "answer": f"FAIL-ME {i}", "label": inverted}
        for i in range(wrong)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_overrides(tiny_model_dir: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "sampling.max_new_tokens=8",
        "train.steps=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
        "rewards.judge.mode=rubric",
        f"rewards.judge.base_url={url}",
        f"rewards.judge.rubric={json.dumps(RUBRIC)}",
        *extra,
    ]


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------- the measures
def test_auc_and_balanced_accuracy_by_hand():
    scores = [0.9, 0.5, 0.5, 0.5, 0.1]
    labels = [True, True, True, False, False]
    # pairs (right, wrong): (0.9, 0.5) 1, (0.9, 0.1) 1, twice (0.5, 0.5) 1/2, twice (0.5, 0.1)
    # 1: (1 + 1 + 0.5 + 1 + 0.5 + 1) / (3 * 2) = 5 / 6
    assert auc(scores, labels) == pytest.approx(5 / 6)
    # pass = score >= 0.5: TPR 3/3, TNR 1/2 -> (1 + 0.5) / 2
    assert balanced_accuracy(scores, labels) == pytest.approx(0.75)
    assert auc([0.2, 0.8], [True, False]) == 0.0  # the wrong one above the right one
    with pytest.raises(ValueError, match="both labels"):
        auc([0.3, 0.4], [True, True])


async def test_calibration_on_a_fake_judge_with_known_answers():
    """64 answers whose judge score is known (``score N`` -> N / 10): 24 right ones at 0.8
    and 8 at 0.3, 24 wrong ones at 0.2 and 8 at 0.8."""
    spec = [(8, True)] * 24 + [(3, True)] * 8 + [(2, False)] * 24 + [(8, False)] * 8
    groups = [
        [(Answer("Compute 2 + 3.", f"score {n}\n(answer {i})"), y)] for i, (n, y) in enumerate(spec)
    ]
    cal = await measure(_judge(), groups, "hand-built", "the labels", min_auc=0.9)
    assert (cal.answers, cal.right, cal.wrong, cal.judge_errors) == (64, 32, 32, 0)
    # right > wrong: 24 x 24 (0.8 > 0.2) + 8 x 24 (0.3 > 0.2) = 768 pairs; ties: 24 x 8
    # (0.8 = 0.8) = 192 pairs at 1/2; of 32 x 32: (768 + 96) / 1024
    assert cal.auc == pytest.approx(864 / 1024)
    # TPR 24/32 (0.3 fails), TNR 24/32 (0.8 passes)
    assert cal.balanced_accuracy == pytest.approx(0.75)
    assert cal.score_mean_right == pytest.approx((24 * 0.8 + 8 * 0.3) / 32)
    assert not cal.passed and cal.metrics() == {
        "judge/calib_auc": pytest.approx(0.84375),
        "judge/calib_balanced_accuracy": pytest.approx(0.75),
    }


async def test_answers_the_judge_cannot_score_are_left_out_and_counted():
    groups = [[(Answer("t", "score 9"), True)], [(Answer("t", "unreadable"), False)]]
    cal = await measure(_judge(retries=0), groups)
    assert (cal.answers, cal.judge_errors) == (1, 1)
    assert "no score for correct" in cal.rows[1]["error"]


def test_a_labelled_file_names_the_rows_to_fix():
    j = _judge(reference="answers").rewards.judge
    text = "\n".join(
        [
            json.dumps({"prompt": "q", "answer": "a", "label": True, "reference": ["a"]}),
            json.dumps({"prompt": "q", "answer": "a", "label": "yes", "reference": "a"}),
            json.dumps({"answer": "a", "label": False, "reference": "a"}),
            json.dumps({"prompt": "q", "answer": "a", "label": 0}),
            "{not json",
        ]
    )
    with pytest.raises(ConfigError) as exc:
        parse_labelled(text, j, "c.jsonl")
    assert "rewards.judge.calibration=c.jsonl" in str(exc.value)
    assert [p.split(":")[0] for p in exc.value.problems] == [
        "line 2",
        "line 3",
        "line 4",
        "line 5",
    ]
    assert 'give one of "prompt"' in exc.value.problems[1]
    assert 'no "reference"' in exc.value.problems[2]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "search", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Ada wrote it."},
    ]
    row = {"messages": messages, "answer": " Ada ", "label": 1, "reference": ["Ada", "A. L."]}
    j = _judge(reference="answers", include_trace=True).rewards.judge
    [(answer, label)] = parse_labelled(json.dumps(row), j, "c.jsonl")
    assert label is True
    assert answer == Answer(
        "Who?", "Ada", "- search({}) -> Ada wrote it.", "Ada (also accepted: A. L.)"
    )


# ---------------------------------------------------------------------------- the run
def test_a_judge_below_the_threshold_stops_the_run_before_the_first_step(
    rule_judge, tiny_model_dir, tmp_path
):
    """A judge that passes exactly the answers labelled wrong (AUC 0) stops the run before
    any step: the message names the AUC and the override; no step row is logged; the
    calibration is stored. Run again with ``min_auc=0`` in the same directory, the stored
    calibration is reused (no judge call about its answers) and the run trains."""
    from areal_agents.trainer.loop import Trainer

    url, calls = rule_judge
    run = tmp_path / "run"
    inverted = _labelled_file(tmp_path / "inverted.jsonl", inverted=True)
    cfg = load_config(
        None,
        _run_overrides(tiny_model_dir, run, url, f"rewards.judge.calibration={inverted}"),
    )
    with pytest.raises(ConfigError) as exc:
        asyncio.run(Trainer(cfg, quiet=True).run())
    message = str(exc.value)
    assert "calibration AUC is 0.000" in message and "balanced accuracy 0.000" in message
    assert "below rewards.judge.min_auc=0.7" in message
    assert "rewards.judge.min_auc=0 to train anyway" in message
    assert [r for r in _rows(run) if "held_out" not in r] == []  # no step
    stored = json.loads((run / "judge_calibration.json").read_text())
    assert (stored["auc"], stored["passed"], stored["right"], stored["wrong"]) == (
        0.0,
        False,
        32,
        32,
    )
    assert not (run / "checkpoints").exists()

    asked = len(calls)
    cfg = load_config(
        None,
        _run_overrides(
            tiny_model_dir,
            run,
            url,
            f"rewards.judge.calibration={inverted}",
            "rewards.judge.min_auc=0",
        ),
    )
    asyncio.run(Trainer(cfg, quiet=True).run())
    assert not any("PASS-ME" in c or "FAIL-ME" in c for c in calls[asked:])
    [row] = [r for r in _rows(run) if "held_out" not in r]
    assert row["step"] == 1 and row["judge/calib_auc"] == 0.0
    assert 0.0 <= row["reward/judge_agreement"] <= 1.0  # the env is the Calculator's checker


@pytest.fixture
def odd_env() -> str:
    """Registers ``test/Odd-v0``: one turn, a success when the reply (stripped) has an odd
    number of characters, which the rule judge checks too."""
    from areal_agents import envs
    from areal_agents.envs.base import AgentEnv

    class Odd(AgentEnv):
        def _start(self, options):
            return [{"role": "user", "content": "Say something."}], {"task_id": "odd"}

        def tools(self):
            return []

        def _respond(self, message):
            ok = len((message.get("content") or "").strip()) % 2 == 1
            return [], float(ok), True, {"success": ok}

    envs.register("test/Odd-v0", Odd, description="odd reply length", override=True)
    return "test/Odd-v0"


def test_calibration_episodes_are_labelled_by_the_envs_success(
    rule_judge, talking_model_dir, odd_env, tmp_path
):
    """Without a file, 64 calibration episodes run before the first step with the run's
    engine (groups ``eval-judge-calibration-*`` in the store, never trained), labelled by
    the env's success; the rule judge checks what the env checks: AUC 1."""
    import sqlite3

    from areal_agents.trainer.loop import Trainer

    url, _ = rule_judge
    run = tmp_path / "run"
    overrides = _run_overrides(talking_model_dir, run, url, "sampling.temperature=1.5")
    cfg = load_config(
        None, [o for o in overrides if not o.startswith("env.")] + [f"env.id={odd_env}"]
    )
    asyncio.run(Trainer(cfg, quiet=True).run())
    stored = json.loads((run / "judge_calibration.json").read_text())
    assert stored["answers"] == 64 and stored["source"] == "64 episodes"
    assert stored["right"] >= 16 and stored["wrong"] >= 16
    assert stored["auc"] == 1.0 and stored["labeller"] == "the env's success"
    [row] = [r for r in _rows(run) if "held_out" not in r]
    assert row["judge/calib_auc"] == 1.0 and row["reward/judge_agreement"] == 1.0
    db = sqlite3.connect(run / "episodes.db")
    groups = [g for (g,) in db.execute("select group_id from sessions")]
    assert sum(g.startswith("eval-judge-calibration-") for g in groups) == 64
    trained = db.execute(
        "select count(*) from train_tokens t join sessions s on s.id = t.session_id "
        "where s.group_id like 'eval-%'"
    ).fetchone()
    assert trained == (0,)


def test_too_few_labels_name_the_fix(rule_judge, tiny_model_dir, tmp_path):
    """The tiny model's empty answers never succeed: the calibration episodes cannot
    calibrate, and the error says so and names the fixes; a file with too few right
    answers, too."""
    from areal_agents.trainer.loop import Trainer

    url, calls = rule_judge
    cfg = load_config(None, _run_overrides(tiny_model_dir, tmp_path / "a", url))
    asked = len(calls)
    with pytest.raises(ConfigError) as exc:
        asyncio.run(Trainer(cfg, quiet=True).run())
    message = str(exc.value)
    assert "too few labelled answers" in message and "64 episodes gave 64 (0 right" in message
    assert "give a labelled file (rewards.judge.calibration=" in message
    assert "rewards.judge.min_auc=0" in message
    assert len(calls) == asked  # nothing was judged

    few = _labelled_file(tmp_path / "few.jsonl", inverted=False, right=8, wrong=56)
    cfg = load_config(
        None,
        _run_overrides(tiny_model_dir, tmp_path / "b", url, f"rewards.judge.calibration={few}"),
    )
    with pytest.raises(ConfigError, match=r"gave 64 \(8 right, 56 wrong by the file's labels"):
        asyncio.run(Trainer(cfg, quiet=True).run())


# ---------------------------------------------------------------------------- agreement
def _result(answer: str, success: bool | None) -> EpisodeResult:
    question = {"role": "user", "content": "Compute 2 + 3."}
    c = Completion(
        "c", [question], [1], [2], [-0.1], [0], {"role": "assistant", "content": answer}, "stop"
    )
    ep = Episode("s-" + answer, [c], final_reward=0.0, ended=True)
    ep.end_reason = "terminated"
    return EpisodeResult(ep, 0.0, success, 1, "terminated")


async def test_the_agreement_metric_on_a_hand_built_step():
    """Pass = score >= 0.5. Judge pass / env success: 0.9 / yes agree, 0.9 / no disagree,
    0.2 / no agree, 0.5 / yes agree (0.5 passes); 0.3 / unknown is not counted: 3 of 4."""
    judge = _judge()
    step = [
        _result("score 9", True),
        _result("score 9\n(again)", False),
        _result("score 2", False),
        _result("score 5", True),
        _result("score 3", None),
    ]
    await judge.apply("g0", step)
    m = judge.metrics()
    assert m["reward/judge_agreement"] == pytest.approx(3 / 4)
    assert m["judge/score_mean"] == pytest.approx((0.9 + 0.9 + 0.2 + 0.5 + 0.3) / 5)
    assert "reward/judge_agreement" not in judge.metrics()  # per step
    judge.calibration = {"judge/calib_auc": 0.8}
    assert judge.metrics()["judge/calib_auc"] == 0.8  # in every step's metrics


async def test_the_reference_answer_comes_from_the_final_info():
    """``reference: answers``: the first accepted answer, the others after it; an episode
    without one is a judge_error naming the key, unless it was cut at max_turns (judged
    without it)."""
    judge = _judge(reference="answers")
    r = _result("score 9", True)
    r.info = {"answers": ["Five", "5"]}
    assert judge.answer_of(r).reference == "Five (also accepted: 5)"
    cut = _result("score 2", False)
    cut.end_reason = "truncated"
    assert judge.answer_of(cut).reference is None
    lost = _result("score 7", False)
    await judge.apply("g0", [r, cut, lost])
    assert r.episode.metadata["judge"]["score"] == pytest.approx(0.9)
    assert cut.episode.metadata["judge"]["score"] == pytest.approx(0.2)
    assert lost.end_reason == "judge_error"
    assert "final info has no 'answers'" in lost.episode.errors[0]["message"]
