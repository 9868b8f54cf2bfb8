"""areal/Tasks-v0: a JSONL of tasks plus a user's score function ("module:fn"), no env code."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

from areal_agents import envs
from areal_agents.envs import EpisodeEnded, check_env
from areal_agents.envs.tasks import (
    TasksEnv,
    exact_match,
    extract_answer,
    load_tasks,
    normalize,
    parse_tasks,
    read_outcome,
    resolve_score,
)
from areal_agents.errors import ConfigError, EnvError, UserError

HERE = Path(__file__).resolve().parent
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}
TASKS = [
    {"id": "t1", "prompt": "What is 2 + 3?", "answer": "5", "level": 1},
    {
        "id": 7,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "answer": "Paris",
        "tools": [LOOKUP],
        "meta": {"source": "geo"},
    },
    {"prompt": "What is 10 - 4?", "answer": "6"},
]


@pytest.fixture(autouse=True)
def _fixture_module_importable(monkeypatch):
    """Make ``tasks_score_fixture`` (next to this file) importable by its import string."""
    monkeypatch.syspath_prepend(str(HERE))
    import tasks_score_fixture

    tasks_score_fixture.CALLS.clear()


def write(tmp_path: Path, rows: list, name: str = "tasks.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def make(tmp_path: Path, rows: list | None = None, score: str = "score", **kwargs) -> TasksEnv:
    path = write(tmp_path, TASKS if rows is None else rows)
    env = envs.make(
        "areal/Tasks-v0", path=str(path), score=f"tasks_score_fixture:{score}", **kwargs
    )
    assert isinstance(env, TasksEnv)
    return env


def answer(content: str | None) -> dict:
    return {"role": "assistant", "content": content}


# ---------------------------------------------------------------------------- loading


def test_every_bad_line_is_reported_at_once_with_its_line_number(tmp_path):
    rows = [
        {"prompt": "fine", "answer": "1"},
        '{"prompt": "broken", ',
        {"answer": "no prompt"},
        {"prompt": 42},
        "",  # blank lines are skipped
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"prompt": "x", "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"prompt": "x", "system": ["not", "a", "string"]},
        {"id": "dup", "prompt": "a"},
        {"id": "dup", "prompt": "b"},
        ["not", "an", "object"],
        {"prompt": "x", "split": 3, "id": True},
    ]
    with pytest.raises(ConfigError) as caught:
        load_tasks(write(tmp_path, rows))
    problems = caught.value.problems
    text = "\n".join(problems)
    assert [p.split(":")[0] for p in problems] == [
        "line 2",
        "line 3",
        "line 4",
        "line 6",
        "line 7",
        "line 8",
        "line 9",
        "line 11",
        "line 12",
        "line 13",
        "line 13",
    ]
    assert "line 2: invalid JSON" in text
    assert "line 3: give either 'messages'" in text
    assert "line 4: 'prompt' must be a non-empty string" in text
    assert "line 6: messages[0]: expected role in" in text
    assert "line 7: has both 'messages' and 'prompt'" in text
    assert "line 8: tools[0]: tool name must match" in text
    assert "line 9: 'system' must be a string" in text
    assert "line 11: duplicate id 'dup' (first used on line 10)" in text
    assert "line 12: expected a JSON object, got an array" in text
    assert "'split' must be a non-empty string" in text and "'id' must be" in text
    assert "11 problem(s)" in str(caught.value) and "tasks.jsonl" in str(caught.value)


def test_empty_and_missing_files_are_config_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError, match="the task file is empty"):
        load_tasks(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="no task file at"):
        load_tasks(tmp_path / "nowhere.jsonl")


def test_many_problems_are_capped_in_the_message():
    with pytest.raises(ConfigError) as caught:
        parse_tasks(["{}"] * 60)
    assert len(caught.value.problems) == 51
    assert caught.value.problems[-1] == "... and 10 more problems"


def test_task_fields_ids_and_tool_schemas_are_kept():
    lines = [json.dumps(t) for t in TASKS]
    tasks = parse_tasks(lines)
    assert [t.task_id for t in tasks] == ["t1", "7", "line-3"]
    assert tasks[0].fields == {"answer": "5", "level": 1}
    assert tasks[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert tasks[1].tool_schemas == [LOOKUP]
    assert tasks[2].raw == {"prompt": "What is 10 - 4?", "answer": "6", "id": "line-3"}
    alias = parse_tasks(['{"task_id": "a1", "prompt": "p"}'])[0]
    assert alias.task_id == "a1" and alias.raw["id"] == "a1" and "task_id" not in alias.fields


# ---------------------------------------------------------------------------- score import


def test_score_import_errors_name_the_fix(tmp_path):
    path = write(tmp_path, TASKS)
    cases = {
        "tasks_score_fixture:scroe": "has no attribute 'scroe'. Did you mean 'score'",
        "tasks_score_fixtur:score": "no module named 'tasks_score_fixtur'. Did you mean "
        "'tasks_score_fixture'",
        "areal_agents.envs.tasks.scorin:exact_match": (
            "Did you mean 'areal_agents.envs.tasks.scoring'"
        ),
        "tasks_score_fixture:NOT_A_FUNCTION": "is a int, not a function",
        "tasks_score_fixture:too_few_args": "cannot be called as fn(task, final_answer, episode)",
        "tasks_score_fixture.score": "expected 'package.module:function'",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            envs.make("areal/Tasks-v0", path=str(path), score=spec)
        assert message in str(caught.value), (spec, str(caught.value))
    with pytest.raises(ConfigError, match="needs a score function"):
        envs.make("areal/Tasks-v0", path=str(path))


def test_score_may_be_a_callable():
    fn, name = resolve_score(exact_match)
    assert fn is exact_match and name == "areal_agents.envs.tasks.scoring:exact_match"
    with pytest.raises(ConfigError, match="async"):

        async def later(task, final_answer, episode):
            return 1.0

        resolve_score(later)


# ---------------------------------------------------------------------------- reset


def test_reset_by_seed_is_deterministic_and_task_index_picks_directly(tmp_path):
    env = make(tmp_path)
    assert env.num_tasks() == 3
    first = env.reset(seed=5)
    assert env.reset(seed=5) == first
    seen = {env.reset(seed=s)[1]["task_id"] for s in range(40)}
    assert seen == {"t1", "7", "line-3"}
    obs, info = env.reset(options={"task_index": 1})
    assert obs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert info["task_id"] == "7"
    assert info["tools"] == [LOOKUP]
    assert "answer" not in info and "meta" not in info, "the gold answer reaches no agent"
    assert env.task is not None and env.task.fields["meta"] == {"source": "geo"}
    assert [t.name for t in env.tools()] == ["lookup"]
    assert env.reset(options={"task_id": "t1"})[1]["task_id"] == "t1"
    with pytest.raises(UserError, match=r"task_index: expected an int in \[0, 3\)"):
        env.reset(options={"task_index": 3})
    with pytest.raises(UserError, match="no task with id 'nope'"):
        env.reset(options={"task_id": "nope"})


def test_system_prompt_is_added_to_tasks_without_one(tmp_path):
    env = make(tmp_path, system_prompt="Think step by step.")
    assert env.reset(options={"task_index": 0})[0][0]["content"] == "Think step by step."
    assert env.reset(options={"task_index": 1})[0][0]["content"] == "Be brief."


def test_splits_by_field_or_by_seeded_shuffle(tmp_path):
    rows = [
        {"prompt": f"q{i}", "answer": "1", "split": "test" if i < 2 else "train"} for i in range(6)
    ]
    assert make(tmp_path, rows).num_tasks() == 6  # split="all" by default
    assert make(tmp_path, rows, split="test").num_tasks() == 2
    with pytest.raises(ConfigError, match="split 'val' has no tasks; splits: test, train"):
        make(tmp_path, rows, split="val")
    plain = [{"prompt": f"q{i}", "answer": "1"} for i in range(10)]
    train = make(tmp_path, plain, split="train")
    test = make(tmp_path, plain, split="test")
    assert (train.num_tasks(), test.num_tasks()) == (8, 2)
    assert not {t.task_id for t in train.tasks} & {t.task_id for t in test.tasks}
    with pytest.raises(ConfigError, match="some tasks have a 'split' field and 1 do not"):
        make(tmp_path, [*rows, {"prompt": "stray"}], split="train")


# ---------------------------------------------------------------------------- env-driven


def test_env_driven_step_scores_a_correct_and_a_wrong_answer(tmp_path):
    import tasks_score_fixture

    env = make(tmp_path)
    env.reset(options={"task_index": 0})
    obs, reward, terminated, truncated, info = env.step(answer("5"))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["success"] is True and info["final_answer"] == "5"
    task, final_answer, episode = tasks_score_fixture.CALLS[-1]
    assert task == {**TASKS[0]}
    assert final_answer == "5"
    assert episode[-1] == {"role": "assistant", "content": "5"}
    assert [m["role"] for m in episode] == ["user", "assistant"]

    env.reset(options={"task_index": 0})
    _, reward, terminated, _, info = env.step("6")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    with pytest.raises(EpisodeEnded):
        env.step("5")


def test_tools_without_implementation_answer_with_an_error_message(tmp_path):
    env = make(tmp_path)
    env.reset(options={"task_index": 1})
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    call_ok = {**call, "id": "c2", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
    obs, reward, terminated, _, info = env.step(
        {"role": "assistant", "content": None, "tool_calls": [call, call_ok]}
    )
    assert (reward, terminated) == (0.0, False)
    assert obs[0]["content"].startswith("Error: missing required argument 'word'")
    assert obs[1]["tool_call_id"] == "c2"
    assert "'lookup' has no implementation in this environment" in obs[1]["content"]
    assert [r["error"] for r in info["tool_results"]] == ["bad_arguments", "tool_exception"]
    _, reward, terminated, _, info = env.step(answer("Paris"))
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_running_out_of_turns_truncates(tmp_path):
    env = make(tmp_path, max_turns=1)
    env.reset(options={"task_index": 1})
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    _, _, terminated, truncated, info = env.step(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_a_raising_or_unusable_score_function_is_an_env_error(tmp_path):
    env = make(tmp_path, score="boom")
    env.reset(seed=0)
    with pytest.raises(EnvError) as caught:
        env.step(answer("5"))
    assert caught.value.kind == "env_error"
    assert "tasks_score_fixture:boom raised RuntimeError: the verifier crashed" in str(caught.value)
    with pytest.raises(EpisodeEnded):  # the failed episode is over
        env.step(answer("5"))
    env.reset(seed=0)  # and the env starts the next one
    bad = make(tmp_path, score="not_a_number")
    bad.reset(seed=0)
    with pytest.raises(EnvError, match=r"must return a number.*got str 'yes'"):
        bad.step(answer("5"))


def test_score_functions_may_return_info_or_a_dict(tmp_path):
    env = make(tmp_path, score="with_info")
    env.reset(options={"task_index": 0})
    _, reward, _, _, info = env.step(answer("5"))
    assert (reward, info["success"], info["length"]) == (0.5, True, 1)
    env = make(tmp_path, score="as_dict")
    env.reset(options={"task_index": 0})
    _, reward, _, _, info = env.step(answer("5"))
    assert (reward, info["success"], info["turns"]) == (2.0, True, 2)


def test_read_outcome_rules():
    assert read_outcome(True, "f") == (1.0, {"success": True, "final_reward": 1.0})
    assert read_outcome(0, "f")[1]["success"] is False
    assert read_outcome(-1.0, "f")[1]["success"] is False
    assert read_outcome((1, {"success": False}), "f")[1]["success"] is False
    for bad, message in [
        (None, "got NoneType"),
        (float("nan"), "non-finite"),
        ({"success": True}, "without 'reward'"),
        ((1.0, {"success": "yes"}), "'success' must be a bool"),
    ]:
        with pytest.raises(EnvError, match=message):
            read_outcome(bad, "f")


# ---------------------------------------------------------------------------- agent-driven


def test_score_for_agent_driven_episodes_uses_the_last_assistant_message(tmp_path):
    env = make(tmp_path)
    env.reset(options={"task_index": 1})
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    conversation = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "France: capital Paris"},
        {"role": "assistant", "content": "Paris"},
    ]
    reward, out = env.score(conversation)
    assert (reward, out["success"], out["final_answer"]) == (1.0, True, "Paris")
    reward, out = env.score([*conversation, {"role": "assistant", "content": "Lyon"}])
    assert (reward, out["success"]) == (0.0, False)
    with pytest.raises(UserError, match="call reset"):
        make(tmp_path).score(conversation)
    env = make(tmp_path, score="boom")
    env.reset(seed=0)
    with pytest.raises(EnvError, match="the verifier crashed"):
        env.score(conversation)


# ---------------------------------------------------------------------------- defaults


def test_default_env_uses_the_example_tasks_and_exact_match():
    env = envs.make("areal/Tasks-v0")
    assert env.num_tasks() == 8
    assert envs.make("areal/Tasks-v0", split="test").num_tasks() == 2
    _, info = env.reset(options={"task_index": 0})
    assert info["task_id"] == "add-1" and env.unwrapped.task.fields["answer"] == "42"
    _, reward, terminated, _, info = env.step(answer("17 + 25 = 42.\nAnswer: 42"))
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert "areal/Tasks-v0" in dict(envs.list_envs())
    assert isinstance(gymnasium.make("areal/Tasks-v0").unwrapped, TasksEnv)


def test_exact_match_reads_and_normalizes_the_answer():
    assert extract_answer("so \\boxed{12} or \\boxed{13}") == "13"
    assert extract_answer("The answer is: 7.\nThanks") == "7."
    assert extract_answer("just 3") == "just 3"
    assert normalize(" 1,200.50 ") == "1200.5" and normalize('"Paris."') == "paris"
    task = {"id": "x", "answer": ["180", "180 km"]}
    assert exact_match(task, "It goes 180 km.", []) == 0.0
    assert exact_match(task, "Answer: 180 km", []) == 1.0
    assert exact_match({"answer": 1200}, "The answer is 1,200.", []) == 1.0
    with pytest.raises(ValueError, match="needs an 'answer' field"):
        exact_match({"id": "x"}, "1", [])


@pytest.mark.parametrize("seed", [0, 123])
def test_passes_the_env_conformance_check(tmp_path, seed):
    check_env(envs.make("areal/Tasks-v0"), seed=seed)
    tool_tasks = [
        {"id": f"q{i}", "prompt": f"q{i}", "answer": "0", "tools": [LOOKUP]} for i in range(3)
    ]
    check_env(make(tmp_path, tool_tasks), seed=seed)


# ---------------------------------------------------------------------------- through the runner


async def test_runner_records_scores_and_score_failures_without_crashing(tmp_path, tiny_model_dir):
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.testing.fake_engine import FakeEngine

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    end = tok.token_id("<|im_end|>")
    proxy = Proxy(FakeEngine(lambda prompt_ids, params: [*tok.encode("5"), end]), tok)
    runner = Runner(proxy, max_turns=4)
    path = str(write(tmp_path, TASKS[:1]))

    def env_with(score: str):
        return lambda: TasksEnv(path=path, score=f"tasks_score_fixture:{score}")

    good = await runner.run_episode(env_with("score"), seed=0)
    assert (good.end_reason, good.success, good.reward) == ("terminated", True, 1.0)
    assert good.info["task"]["task_id"] and "answer" not in good.info["task"]
    bad = await runner.run_episode(env_with("boom"), seed=0)
    assert bad.end_reason == "env_error" and "the verifier crashed" in bad.error
    assert bad.episode.errors[0]["kind"] == "env_error"
