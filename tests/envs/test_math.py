"""areal_agents.envs.math: answer checking, Math-v0 and Calculator-v0 episodes, splits, demos."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter

import pytest

from areal_agents import envs
from areal_agents.envs.math import (
    CalculatorEnv,
    MathEnv,
    answers_match,
    demos,
    extract_answer,
    load_jsonl,
    split_of,
)
from areal_agents.envs.math.generator import ARITHMETIC_SHAPES
from areal_agents.tools import function_tool


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("First 3 + 4 = 7, so \\boxed{7}.", "7"),
        ("So the share is \\boxed{\\frac{3}{4}} of the cake.", "\\frac{3}{4}"),
        ("Compute: 1,000 + 234 = 1,234\n#### 1,234", "1234"),
        ("The answer is 42 apples.", "42"),
        ("Final answer: $1,200.", "1200"),
        ("I think 5 + 6 = 11 and then 11 * 2 = 22", "22"),
        ("The answer is -3.5", "-3.5"),
        ("No idea.", None),
        ("", None),
    ],
)
def test_extract_answer_reads_boxed_hashes_phrases_then_last_number(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "gold", "same"),
    [
        ("\\frac{3}{4}", "0.75", True),
        ("3/4", "0.75", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("1,200", "1200", True),
        ("42.0", "42", True),
        ("$18", "18", True),
        ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}", True),
        ("41", "42", False),
        ("0.3333", "1/3", False),
        (None, "42", False),
    ],
)
def test_answers_match_fractions_decimals_and_symbolic_forms(predicted, gold, same):
    assert answers_match(predicted, gold) is same


def test_symbolic_checks_in_worker_threads_do_not_warn_about_the_disabled_timeout(
    caplog, monkeypatch
):
    # Off the main thread math_verify cannot use signal.alarm, so the timeout is off on
    # purpose; its warning about that is filtered out instead of printed by every env thread.
    from math_verify import grader, parser

    # math_verify warns once per process: make this call the first, whatever ran before
    monkeypatch.setattr(parser, "TIMEOUT_WARNING_SHOWN", False)
    monkeypatch.setattr(grader, "TIMEOUT_WARNING_SHOWN", False)
    results: list[bool] = []
    with caplog.at_level(logging.WARNING):
        worker = threading.Thread(
            target=lambda: results.append(answers_match("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"))
        )
        worker.start()
        worker.join()
    assert results == [True]
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]


def _answer_turn(text):
    return {"role": "assistant", "content": text}


def test_math_env_rewards_a_correct_boxed_answer_and_ends_the_episode():
    env = MathEnv()
    obs, info = env.reset(seed=3)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator"]
    answer = env.task.answer
    obs, reward, terminated, truncated, info = env.step(f"So it is \\boxed{{{answer}}}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["success"] and info["final_reward"] == 1.0 and info["attempts"] == 1


def test_wrong_answer_gets_feedback_and_a_retry_until_max_attempts():
    env = MathEnv(max_attempts=2, wrong_reward=-0.1, feedback="No, {predicted} is wrong.")
    env.reset(seed=5)
    wrong = str(int(env.task.answer) + 1)
    obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{wrong}}}")
    assert obs == [{"role": "user", "content": f"No, {wrong} is wrong."}]
    assert (reward, terminated, truncated) == (-0.1, False, False)
    obs, reward, terminated, truncated, info = env.step("I give up.")
    assert (obs, reward, terminated) == ([], -0.1, True)
    assert info["success"] is False and info["reason"] == "wrong_answer"


def test_retry_after_feedback_can_still_succeed_and_missing_answers_get_a_format_hint():
    env = MathEnv(max_attempts=3)
    env.reset(seed=7)
    obs = env.step("Let me think.")[0]
    assert obs[0]["content"].startswith("I could not find a final answer. Give the final answer")
    env.step("\\boxed{-1}")
    obs, reward, terminated, _truncated, info = env.step(f"#### {env.task.answer}")
    assert (reward, terminated, info["success"], info["attempts"]) == (1.0, True, True, 3)


def test_math_env_runs_calculator_calls_and_score_reads_the_last_answer():
    env = MathEnv(tool_call_reward=0.1)
    env.reset(seed=11)
    call = {"id": "k", "type": "function"}
    call["function"] = {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}
    obs, reward, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert obs == [{"role": "tool", "tool_call_id": "k", "content": "42"}]
    assert reward == 0.1
    transcript = [*env.messages, _answer_turn(f"The answer is {env.task.answer}.")]
    reward, info = env.score(transcript)
    assert reward == 1.0 and info["success"] is True
    assert info["tool_rewards"] == {"k": 0.1}  # what stepping the call earned
    assert env.score(transcript) == (reward, info)  # replaying twice gives the same
    assert env.score([_answer_turn("The answer is 0.5")])[1]["success"] is False


def test_same_seed_same_task_and_seeds_spread_over_tasks():
    env = MathEnv()
    first = env.reset(seed=21)
    assert env.reset(seed=21) == first
    task_ids = {env.reset(seed=s)[1]["task_id"] for s in range(20)}
    assert len(task_ids) >= 15


def test_options_pick_a_task_by_index_or_id():
    env = CalculatorEnv()
    _, info = env.reset(options={"task_index": 4})
    again = env.reset(seed=99, options={"task_id": info["task_id"]})[1]
    assert again["task_id"] == info["task_id"]
    with pytest.raises(ValueError, match="task_index must be in"):
        env.reset(options={"task_index": 10**9})


@pytest.mark.parametrize(
    "make_env",
    [
        lambda split: MathEnv(split=split, num_tasks=300),
        lambda split: MathEnv(split=split, num_tasks=300, datasets=["basic_arithmetic"]),
        lambda split: CalculatorEnv(split=split, num_tasks=300),
    ],
)
def test_train_and_test_splits_are_disjoint_by_question(make_env):
    train, test = make_env("train"), make_env("test")
    train_questions = {train.pool[i].question for i in range(300)}
    test_questions = {test.pool[i].question for i in range(300)}
    assert len(train_questions) == len(test_questions) == 300
    assert not train_questions & test_questions
    assert {split_of(q) for q in test_questions} == {"test"}


def test_jsonl_data_path_gives_gsm8k_tasks(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "Ann has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "What is 1000 + 200?", "answer": "#### 1,200", "id": "big"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = envs.make("areal/Math-v0", data_path=str(path))
    obs, _info = env.reset(options={"task_id": "big"})
    assert obs[-1]["content"] == "What is 1000 + 200?"
    assert env.step("\\boxed{1200}")[1] == 1.0
    assert load_jsonl(path)[0].solution == "2 + 3 = 5"
    path.write_text('{"question": "no answer field"}\n')
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: expected a JSON object with 'question'"):
        load_jsonl(path)


def test_python_tool_is_offered_when_injected_and_built_per_episode():
    built = []

    def make_python_tool():
        @function_tool
        def python(code: str) -> str:
            """Run Python code."""
            return "ran"

        built.append(python)
        return python

    env = MathEnv(python_tool=make_python_tool)
    names = [t["function"]["name"] for t in env.reset(seed=0)[1]["tools"]]
    env.reset(seed=1)
    assert names == ["calculator", "python"] and len(built) == 2
    assert env.tools()[1] is built[1]


def test_calculator_env_two_turn_episode_with_required_tool():
    env = CalculatorEnv(require_tool=True, kind="word")
    obs, info = env.reset(seed=2)
    assert info["kind"] == "word" and env.task.expression
    answer = env.task.answer
    _obs, reward, terminated, _truncated, info = env.step(f"The answer is {answer}.")
    assert (reward, terminated, info["success"], info["reason"]) == (
        0.0,
        True,
        False,
        "no_tool_call",
    )
    env.reset(seed=2)
    call = {"id": "x", "type": "function"}
    call["function"] = {
        "name": "calculator",
        "arguments": json.dumps({"expression": env.task.expression}),
    }
    obs = env.step({"role": "assistant", "content": "", "tool_calls": [call]})[0]
    assert obs[0]["content"] == answer
    obs, reward, terminated, _truncated, info = env.step(f"The answer is {answer}.")
    assert (reward, info["success"], info["tool_used"]) == (1.0, True, True)


def test_calculator_env_mixes_kinds_and_few_shot_adds_worked_examples():
    env = CalculatorEnv()
    kinds = {env.reset(seed=s)[1]["kind"] for s in range(30)}
    assert kinds == {"arithmetic", "word"}
    obs, _ = CalculatorEnv(few_shot=True).reset(seed=0)
    roles = [m["role"] for m in obs]
    assert roles == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert obs[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert all(split_of(m["content"]) == "train" for m in obs if m["role"] == "user")


def test_shape_weights_reweight_the_arithmetic_shapes_of_the_training_pool():
    def share_parenthesized(env: CalculatorEnv) -> float:
        tasks = [env.pool[i] for i in range(600)]
        return sum("(" in t.expression for t in tasks) / len(tasks)

    plain = CalculatorEnv(kind="arithmetic")
    weighted = CalculatorEnv(kind="arithmetic", shape_weights={"(a+b)*c": 3, "(a-b)*c": 3})
    assert 0.12 < share_parenthesized(plain) < 0.25  # 2 shapes of 11
    assert 0.33 < share_parenthesized(weighted) < 0.47  # 6 of 15
    assert all(split_of(weighted.pool[i].question) == "train" for i in range(600))
    only_sums = CalculatorEnv(
        kind="arithmetic", shape_weights=dict.fromkeys(ARITHMETIC_SHAPES, 0) | {"a+b": 1}
    )
    assert all(re.fullmatch(r"\d+ \+ \d+", only_sums.pool[i].expression) for i in range(50))
    # no weights: the stream the held-out numbers were measured on, unchanged
    env = CalculatorEnv(split="test")
    assert [env.reset(seed=s)[1]["task_id"] for s in range(3)] == [
        "calc-mixed-2020",
        "calc-mixed-1138",
        "calc-mixed-1998",
    ]
    assert env.task.question.startswith("Nora buys 8 packs of stickers with 7 stickers")
    with pytest.raises(
        ValueError, match=r"unknown shape '\(a\+b\)\*d'; did you mean '\(a\+b\)\*c'"
    ):
        CalculatorEnv(shape_weights={"(a+b)*d": 2})
    with pytest.raises(ValueError, match="at least one shape needs a weight > 0"):
        CalculatorEnv(shape_weights=dict.fromkeys(ARITHMETIC_SHAPES, 0))
    with pytest.raises(ValueError, match="must be a number >= 0"):
        CalculatorEnv(shape_weights={"a+b": -1})


def test_demos_are_correct_deterministic_train_only_conversations():
    conversations = demos(12, seed=3)
    assert conversations == demos(12, seed=3) and conversations != demos(12, seed=4)
    env = CalculatorEnv(require_tool=True)
    for conversation in conversations:
        assert [m["role"] for m in conversation] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert split_of(conversation[1]["content"]) == "train"
        task_id = conversation[2]["tool_calls"][0]["id"].removeprefix("call_")
        obs, _info = env.reset(options={"task_id": task_id})
        assert obs == conversation[:2]
        assert env.step(conversation[2])[0] == [conversation[3]]
        assert env.step(conversation[4])[1] == 1.0
    kinds = {
        env.reset(options={"task_id": c[2]["tool_calls"][0]["id"][5:]})[1]["kind"]
        for c in conversations
    }
    assert kinds == {"arithmetic", "word"}
    arithmetic = demos(5, seed=0, kind="arithmetic")
    assert all(
        c[1]["content"].split()[0] in {"What", "Calculate", "Compute", "Evaluate"}
        for c in arithmetic
    )


def _demo_shape(conversation: list[dict]) -> str:
    expression = json.loads(conversation[2]["tool_calls"][0]["function"]["arguments"])
    return re.sub(r"\d+", "n", expression["expression"])


def test_balanced_demos_cover_every_solution_shape_evenly():
    # 11 arithmetic shapes: 25 demos are 2 or 3 of each, every shape present.
    for seed in (0, 1):
        counts = Counter(_demo_shape(c) for c in demos(25, seed=seed, kind="arithmetic"))
        assert len(counts) == 11 and set(counts.values()) == {2, 3}
        assert counts["(n + n) * n"] >= 2 and counts["(n - n) * n"] >= 2
    balanced = demos(130, seed=1, kind="arithmetic")
    assert len({c[1]["content"] for c in balanced}) == 130
    assert set(Counter(_demo_shape(c) for c in balanced).values()) == {11, 12}
    assert balanced == demos(130, seed=1, kind="arithmetic")
    # The uniform draw is still there, and it is not balanced for this seed.
    uniform = demos(100, seed=1, kind="arithmetic", balanced=False)
    counts = Counter(_demo_shape(c) for c in uniform)
    assert counts["(n + n) * n"] + counts["(n - n) * n"] == 13 and counts["n + n"] == 17
    # Mixed: word shapes are shapes of their own; both kinds appear.
    mixed = demos(40, seed=0)
    assert {
        c[1]["content"].split()[0] in {"What", "Calculate", "Compute", "Evaluate"} for c in mixed
    } == {True, False}
    assert CalculatorEnv.demos(25, seed=0, kind="arithmetic") == demos(
        25, seed=0, kind="arithmetic"
    )


def test_compact_demos_write_the_same_calls_without_spaces():
    plain = demos(30, seed=2, kind="arithmetic")
    compact = demos(30, seed=2, kind="arithmetic", compact=True)
    env = CalculatorEnv(kind="arithmetic", require_tool=True)
    for a, b in zip(plain, compact, strict=True):
        args_a = a[2]["tool_calls"][0]["function"]["arguments"]
        args_b = b[2]["tool_calls"][0]["function"]["arguments"]
        expression = json.loads(args_a)["expression"]
        assert json.loads(args_b) == json.loads(args_a)
        assert args_b == '{"expression":"' + expression + '"}'
        assert [m for m in a if m["role"] != "assistant"] == [
            m for m in b if m["role"] != "assistant"
        ]
        env.reset(options={"task_id": b[2]["tool_calls"][0]["id"].removeprefix("call_")})
        assert env.step(b[2])[0] == [b[3]] and env.step(b[4])[1] == 1.0
    assert any(
        json.loads(c[2]["tool_calls"][0]["function"]["arguments"])["expression"][0] == "("
        for c in compact
    )


def _calculator_call(expression: str, call_id: str = "c1") -> dict:
    function = {"name": "calculator", "arguments": json.dumps({"expression": expression})}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def test_grounded_hand_computed():
    from areal_agents.envs.math.env import grounded

    question = "A box holds 18 cookies. Yuki has 19 full boxes. How many cookies is that?"
    assert grounded("18 * 19", question) and grounded("19 * 18", question)
    assert grounded("(18) * 19", question)
    assert not grounded("18", question)  # one number of two
    assert not grounded("18 * 12", question)  # 12 is not in the question
    assert not grounded("18 * 19 * 19", question)  # 19 appears once in the question
    assert not grounded("1 + 1", "No numbers here.")
    # with the solution: its operators too (a multiset; order and parentheses aside)
    change = "A ticket costs 8 dollars. Ann buys 4 tickets and pays with 50 dollars."
    assert grounded("50 - 8 * 4", change, "50 - 8 * 4")
    assert grounded("8 * 4 - 50", change, "50 - 8 * 4")  # right ingredients, wrong order
    assert grounded("50 - (8 * 4)", change, "50 - 8 * 4")
    assert not grounded("8 * 4 + 50", change, "50 - 8 * 4")  # the wrong operation
    assert not grounded("50 - 8 - 4", change, "50 - 8 * 4")
    assert not grounded("50 - 8 * 4 * 1", change, "50 - 8 * 4")  # an invented number


def test_calculator_grounded_ops_reward():
    """`grounded_ops_reward`: extra credit when the grounded call has the solution's
    operators; r = c [numbers] + c_ops [numbers and operators]."""
    env = CalculatorEnv(kind="word", grounded_call_reward=0.1, grounded_ops_reward=0.2)
    for seed in range(40):  # a task whose solution has two operators
        env.reset(seed=seed)
        if len(env.task.expression.split()) == 5:
            break
    a, op1, b, op2, c = env.task.expression.split()
    wrong = {"+": "-", "-": "+", "*": "+", "/": "*"}
    swapped = f"{a} {op1} {b} {wrong[op2]} {c}"
    assert env.step(_calculator_call(swapped))[1] == pytest.approx(0.1)  # numbers only
    env.reset(seed=seed)
    reordered = f"{c} {op2} {a} {op1} {b}"  # the right ingredients in another order
    assert env.step(_calculator_call(reordered))[1] == pytest.approx(0.1 + 0.2)
    env.reset(seed=seed)
    assert env.step(_calculator_call(f"{a} {op1} {b}"))[1] == 0.0  # a number missing
    ops_only = CalculatorEnv(kind="word", grounded_ops_reward=0.3)  # c = 0
    ops_only.reset(seed=seed)
    assert ops_only.step(_calculator_call(swapped))[1] == 0.0
    ops_only.reset(seed=seed)
    assert ops_only.step(_calculator_call(env.task.expression))[1] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="grounded_ops_reward"):
        CalculatorEnv(grounded_ops_reward=-0.1)


def test_calculator_grounded_call_reward_once_per_episode():
    env = CalculatorEnv(kind="word", grounded_call_reward=0.3)
    env.reset(seed=5)
    task = env.task
    operand = task.expression.split()[0]
    # a valid call with part of the numbers earns nothing; it uses up the first call
    assert env.step(_calculator_call(operand))[1] == 0.0
    assert env.step(_calculator_call(task.expression, "c2"))[1] == 0.0
    _obs, reward, terminated, _t, info = env.step(f"The answer is {task.answer}.")
    assert (reward, terminated, info["success"]) == (1.0, True, True)

    env.reset(seed=5)
    assert env.step(_calculator_call("apples"))[1] == 0.0  # an error earns nothing
    assert env.step(_calculator_call(task.expression, "c2"))[1] == pytest.approx(0.3)
    assert env.step(_calculator_call(task.expression, "c3"))[1] == 0.0  # only once
    _obs, reward, _term, _t, info = env.step("The answer is 0.")
    assert (reward, info["success"]) == (0.0, False)
    # off by default
    default = CalculatorEnv(kind="word")
    default.reset(seed=5)
    assert default.step(_calculator_call(default.task.expression))[1] == 0.0
    with pytest.raises(ValueError, match="grounded_call_reward"):
        CalculatorEnv(grounded_call_reward=-1)
