"""tau² trains with no code: the run's own model plays the simulated customer by default
(``ProxyUserSimulator`` over the run's proxy, recorded in no session), so the customer's
calls are never trained, never part of the agent's episodes and never counted as episodes;
``env.kwargs.user_base_url`` names another customer."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest

from areal_agents.envs.tau2 import ProxyUserSimulator, Tau2Env
from areal_agents.envs.tau2.user import GREETING
from areal_agents.errors import ConfigError, EnvError
from areal_agents.serve.store import EpisodeStore
from areal_agents.trainer.config_io import load_config

TASK = type("Task", (), {"persona": None, "instructions": "Cancel order #W1."})()


class FakeProxy:
    """Records each ``complete`` call: its session, request and the thread it ran on."""

    model_name = "fake"

    def __init__(self, reply: Any = "I want to cancel an order.") -> None:
        self.reply = reply
        self.calls: list[tuple[Any, dict[str, Any], str]] = []

    async def complete(self, session: Any, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((session, request, threading.current_thread().name))
        if isinstance(self.reply, Exception):
            raise self.reply
        return {"choices": [{"message": {"role": "assistant", "content": self.reply}}]}


def test_the_proxy_customer_calls_the_model_in_no_session_with_the_dialogue_flipped():
    proxy = FakeProxy()
    user = ProxyUserSimulator(proxy, max_tokens=32)
    dialogue = [{"role": "assistant", "content": GREETING}]
    assert asyncio.run(user.respond(TASK, dialogue)) == "I want to cancel an order."
    ((session, request, _),) = proxy.calls
    assert session is None  # recorded in no session
    assert request["max_tokens"] == 32 and request["temperature"] == 0.0
    assert [m["role"] for m in request["messages"]] == ["system", "user"]
    assert "Cancel order #W1." in request["messages"][0]["content"]
    assert request["messages"][1]["content"] == GREETING


def test_the_proxy_customer_runs_its_calls_on_the_loop_it_is_bound_to():
    """The env steps on worker threads (each with a loop of its own); bound to the run's
    loop, the customer's calls run there."""
    proxy = FakeProxy()

    async def main() -> str:
        user = ProxyUserSimulator(proxy, loop=asyncio.get_running_loop())
        env_thread = asyncio.to_thread(
            asyncio.run, user.respond(TASK, [{"role": "assistant", "content": GREETING}])
        )
        return await env_thread

    name = threading.current_thread().name
    assert asyncio.run(main()) == "I want to cancel an order."
    assert proxy.calls[0][2] == name  # the bound loop's thread, not the worker's


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ("  ", "empty message"),
        (RuntimeError("engine down"), "proxy's model failed: RuntimeError: engine down"),
    ],
)
def test_a_proxy_customer_that_cannot_answer_raises_env_error(reply, match):
    user = ProxyUserSimulator(FakeProxy(reply))
    with pytest.raises(EnvError, match=match):
        asyncio.run(user.respond(TASK, [{"role": "assistant", "content": GREETING}]))


def test_endpoint_settings_without_an_endpoint_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="user_model without user_base_url"):
        Tau2Env("retail", user_model="m")
    with pytest.raises(ConfigError, match="max_tokens="):
        Tau2Env("retail", user_simulator=ProxyUserSimulator(FakeProxy()), user_max_tokens=8)


def _cfg(model_dir: Any, out: Any, *extra: str) -> Any:
    return load_config(
        None,
        [
            "env.id=areal/Tau2Retail-v0",
            f"model.path={model_dir}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=1",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
            *extra,
        ],
    )


def test_the_customer_settings_are_checked_before_the_model_loads(tmp_path):
    from areal_agents.trainer.rollout_build import _own_model_customer

    what = "env areal/Tau2Retail-v0 (env.kwargs)"
    with pytest.raises(ConfigError, match=r"scheduler: ray.*env\.kwargs\.user_base_url"):
        _own_model_customer(_cfg("m", tmp_path, "scheduler=ray"), {}, what)
    cfg = _cfg("m", tmp_path)
    with pytest.raises(ConfigError, match="user_max_tokens must be an int"):
        _own_model_customer(cfg, {"user_max_tokens": "8"}, what)
    kwargs: dict[str, Any] = {"user_max_tokens": 16}
    assert _own_model_customer(cfg, kwargs, what) == {"max_tokens": 16}
    assert kwargs == {}  # the cap goes to the customer, not to the env
    assert _own_model_customer(cfg, {}, what) == {"max_tokens": 8}  # sampling.max_new_tokens


def test_a_customer_that_cannot_answer_fails_the_run_before_any_episode(tiny_model_dir, tmp_path):
    """The tied tiny model answers the customer's prompt with an empty message."""
    from areal_agents.trainer.loop import Trainer

    cfg = _cfg(tiny_model_dir, tmp_path / "run", "env.kwargs={user_max_tokens: 8}")
    with pytest.raises(ConfigError) as err:
        asyncio.run(Trainer(cfg, quiet=True).run())
    message = str(err.value)
    assert "the run's own model as the customer" in message and "empty message" in message
    assert "set env.kwargs.user_base_url" in message
    assert not (tmp_path / "run" / "groups.jsonl").exists()


@pytest.mark.slow
def test_tau2_trains_two_steps_with_the_runs_own_model_as_the_customer(talking_model_dir, tmp_path):
    """On the tiny model with an output head of its own and an 8192-token context (tau²'s
    prompts are ~4.6K tokens; the tied tiny model answers the customer's prompt with an
    empty message, which fails the run up front)."""
    from areal_agents.trainer.loop import Trainer

    run = tmp_path / "run"
    cfg = _cfg(talking_model_dir, run, "eval.episodes=2")
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    assert summary["turns_mean"] > 0
    # the held-out episodes ran with the same customer (no endpoint configured)
    evals = json.loads((run / "eval.json").read_text())
    assert [e["label"] for e in evals] == ["base", "final"] and evals[0]["episodes"] == 2
    assert not any(e["end_reasons"].get("env_error") for e in evals), evals
    rows = [json.loads(x) for x in (run / "groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    store = EpisodeStore(run / "episodes.db")
    try:
        ids = store.session_ids()
        episodes = [store.load(i) for i in ids]
        trained = {i for i in ids if store.train_tokens(i)}
    finally:
        store.close()
    # every session is a training or held-out episode: the customer's calls opened none
    groups = {s.episode.group_id for s in episodes if s is not None}
    pattern = r"g\d+|eval-(base|final)-\d+"  # training and held-out episodes only
    assert groups and all(re.fullmatch(pattern, g or "") for g in groups), groups
    assert trained and trained <= set(ids)
    # the trained groups hold the agent's sessions and completions only
    by_id = {s.id: s.episode for s in episodes if s is not None}
    for row in rows:
        assert row["episodes"] == 2 and set(row["sessions"]) <= trained
        listed = [c.id for sid in row["sessions"] for c in by_id[sid].completions]
        assert listed == row["completions"]
        assert all(len(by_id[sid].completions) <= 2 for sid in row["sessions"])  # max_turns
    completions = [c for s in episodes if s is not None for c in s.episode.completions]
    assert completions
    for c in completions:
        assert "customer contacting" not in json.dumps(c.messages)  # the customer's prompt
        assert [m["role"] for m in c.messages[:3]] == ["system", "assistant", "user"]
        assert c.messages[1]["content"] == GREETING
        assert str(c.messages[2]["content"]).strip()  # the customer's first message
