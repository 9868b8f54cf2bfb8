"""Issue 48: the ``dropped/*`` accounting of a run, in episodes, across restarts.

*generated* = the sessions ``episodes.db`` recorded for training groups (group ids ``g<N>``;
not the held-out ``eval-*`` or judge ``judge-*`` sessions); *trained* = ``episodes_consumed``.
At the end of a run and at every resume, generated = trained + the ``dropped/*`` totals
(less ``group_incomplete``, sessions never opened). The totals are restored before the first
batch of a resumed run; the worker tasks of a killed run end with their sessions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents import ChatTokenizer, FakeEngine, Proxy, envs
from areal_agents.client import AgentWorker
from areal_agents.envs.base import AgentEnv
from areal_agents.rollout.runner import AgentTask, Runner
from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.server import LoopServer
from areal_agents.serve.store import EpisodeStore
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.rollout import EnvSource, ExternalSource, SourceSettings

TOKEN = "wtok-accounting-48"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Parity(AgentEnv):
    """One turn; even tasks pay 0.5 whatever the reply (their groups are uniform), odd ones
    the parity of the reply's length."""

    def _start(self, options):
        self.task = int(self.np_random.integers(1_000_000))
        return [{"role": "user", "content": f"Task {self.task}: say something."}], {
            "task_id": str(self.task)
        }

    def tools(self):
        return []

    def _reward(self, text: str) -> float:
        return 0.5 if self.task % 2 == 0 else float(len(text) % 2)

    def _respond(self, message):
        reward = self._reward(message.get("content") or "")
        return [], reward, True, {"success": reward > 0}

    def score(self, messages):
        reward = self._reward(messages[-1].get("content") or "")
        return reward, {"success": reward > 0}


envs.register("test/AccountingParity-v0", Parity, description="accounting", override=True)


def make_env() -> Any:
    return envs.make("test/AccountingParity-v0")


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def engine(tok: ChatTokenizer, delay_s: float = 0.01) -> FakeEngine:
    end, rng = tok.token_id("<|im_end|>"), random.Random(0)
    assert end is not None

    def script(prompt_ids: Any, params: Any) -> list[int]:
        return [
            *tok.encode(" ".join("ab"[: rng.randint(1, 2)] for _ in range(rng.randint(1, 6)))),
            end,
        ]

    return FakeEngine(script, delay_s=delay_s)


async def agent(task: AgentTask) -> str | None:
    async with task.openai_client() as client:
        reply = await client.chat.completions.create(
            model=task.model, messages=task.messages, max_tokens=8
        )
    return reply.choices[0].message.content


def generated(path: Path) -> int:
    """Sessions of training groups in the store at ``path`` (read with the store's own API)."""
    store = EpisodeStore(path)
    try:
        loaded = [store.load(sid) for sid in store.session_ids()]
        groups = [s.episode.group_id for s in loaded if s is not None]
    finally:
        store.close()
    return sum(1 for g in groups if g and re.fullmatch(r"g\d+", g))


def dropped_sum(dropped: dict[str, Any]) -> int:
    return int(sum(v for k, v in dropped.items() if k != "group_incomplete"))


@contextlib.asynccontextmanager
async def external(
    tok: ChatTokenizer, state: RunState, store: EpisodeStore, **kw: Any
) -> AsyncIterator[tuple[ExternalSource, LoopServer]]:
    """An external source over a store, built as ``build_rollout`` builds it (not started)."""
    proxy = Proxy(
        engine(tok), tok, self_rewarding=False, open_sessions=False, store=store, restore=False
    )
    hub = WorkerHub(proxy, TOKEN, heartbeat_timeout_s=kw.pop("heartbeat_timeout_s", 10.0))
    server = LoopServer(proxy)
    settings = SourceSettings.of(**{"batch_size": 2, "group_size": 2, "eta": 0, **kw})
    source = ExternalSource(
        settings, state, Runner(proxy, base_url=server.base_url), make_env, hub, server
    )
    source.store = store
    try:
        yield source, server
    finally:
        await source.close()


# ---------------------------------------------------------------------------- restored totals
async def test_restored_totals_reach_the_first_batch_of_a_resumed_run(tok):
    """The trainer builds the source, then restores the checkpoint into its state: the
    first batch must carry the restored totals on (the old code overwrote them with the
    totals of this process alone: a run lost 18 of 72 skipped groups from its counts)."""
    state = RunState()
    proxy = Proxy(engine(tok), tok)
    source = EnvSource(
        SourceSettings.of(batch_size=1, group_size=2, eta=0), state, Runner(proxy), make_env
    )
    restored = RunState(step=1, next_group=1, consumed_groups=[0], episodes_consumed=2)
    restored.dropped = {"uniform_group": 36, "agent_error": 3}
    state.__dict__.update(restored.__dict__)  # what Trainer._restore does, after _build
    await source.start(version=1)
    try:
        await asyncio.wait_for(source.next_batch(1), 30)
        assert source.dropped["uniform_group"] >= 36 and source.dropped["agent_error"] >= 3
        assert state.dropped["uniform_group"] >= 36 and state.dropped["agent_error"] >= 3
    finally:
        await source.close()


# ---------------------------------------------------------------------------- a killed run
async def test_a_resume_ends_the_killed_runs_worker_tasks_and_counts_its_episodes(tok, tmp_path):
    """A trainer killed with ``kill -9`` left open sessions and worker tasks running and
    queued. On ``--resume`` the tasks end with their sessions (``lost_at_restart``), every
    episode the store holds that the checkpoint does not account for is counted under
    ``dropped/lost_at_restart`` before the first batch, and at the end generated = trained +
    dropped over both processes."""
    path = tmp_path / "episodes.db"
    killed = EpisodeStore(path)
    proxy = Proxy(engine(tok), tok, store=killed, restore=False)

    def session(group: str, reason: str | None) -> str:
        s = proxy.sessions.create(group_id=group)
        if reason is not None:
            proxy.sessions.end(s, reason=reason)
        return s.id

    killed_run: dict[str, list[str | None]] = {
        "g0": ["terminated", "terminated"],  # consumed at step 1: 2 trained
        "g1": ["agent_error", "terminated"],  # skipped: agent_error + group_too_small
        "g2": ["terminated", None],  # in flight at the kill
        "g3": [None],  # in flight at the kill, one episode started
        "eval-base-0": ["terminated"],  # a held-out episode: not a training one
        "judge-g0": ["terminated"],  # the judge's call: not a training one
    }
    for group, reasons in killed_run.items():
        ids = [session(group, r) for r in reasons]
        if group == "g2":
            killed.put_task("wtask-running", state="running", session_id=ids[1], group_id=group)
        if group == "g3":
            killed.put_task("wtask-queued", state="queued", session_id=ids[0], group_id=group)
        if group == "g0":
            killed.put_task("wtask-done", state="done", session_id=ids[0], group_id=group)
    killed.close()  # its rows are committed; the process is gone
    assert generated(path) == 7

    store = EpisodeStore(path)
    store.close_open("lost_at_restart")  # what build_rollout does on every start
    tasks = {t["id"]: t for t in store.tasks()}
    assert tasks["wtask-running"]["state"] == tasks["wtask-queued"]["state"] == "lost"
    assert tasks["wtask-running"]["message"].startswith("lost_at_restart")
    assert tasks["wtask-done"]["state"] == "done"

    state = RunState()
    async with external(tok, state, store) as (source, server):
        checkpoint = RunState(
            step=1,
            next_group=4,
            consumed_groups=[0],
            skipped_groups=[1],
            episodes_consumed=2,
            dropped={"agent_error": 1, "group_too_small": 1},
        )
        state.__dict__.update(checkpoint.__dict__)  # Trainer._restore, after _build
        await source.start(version=1)
        assert source.dropped["lost_at_restart"] == 7 - 2 - 2  # before any batch
        assert state.dropped["lost_at_restart"] == 3
        worker = AgentWorker(server.url, TOKEN, concurrency=4, wait_s=1.0)
        serving = asyncio.create_task(worker.serve(agent))
        try:
            batch = await asyncio.wait_for(source.next_batch(2), 60)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        assert {g.number for g in batch} <= {2, 3, 4}  # the lost groups redone first
        trained = state.episodes_consumed + sum(len(g.episodes) for g in batch)
    assert generated(path) == trained + dropped_sum(state.dropped), state.dropped


# ---------------------------------------------------------------------------- a lost worker
async def test_episodes_thrown_away_with_a_regenerated_group_are_counted(tok, tmp_path):
    """``workers.on_lost: redo``: a worker takes a task and dies; its group is generated
    again from scratch. The lost episode counts as ``agent_lost`` and its finished sibling,
    thrown away too, as ``regenerated``; generated = trained + dropped."""
    path = tmp_path / "episodes.db"
    state = RunState()
    store = EpisodeStore(path)
    async with external(
        tok, state, store, batch_size=1, redo_lost=True, heartbeat_timeout_s=1.0
    ) as (source, server):
        await source.start(version=0)
        async with httpx.AsyncClient(base_url=server.url) as c:  # the worker that dies
            taken = await c.post("/workers/tasks/next", json={"wait_s": 10}, headers=AUTH)
            assert taken.status_code == 200, taken.text
        worker = AgentWorker(server.url, TOKEN, concurrency=4, wait_s=1.0)
        serving = asyncio.create_task(worker.serve(agent))
        try:
            (group,) = await asyncio.wait_for(source.next_batch(1), 60)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        assert group.number == 0 and len(group.episodes) == 2
        assert source.dropped["agent_lost"] == 1 and source.dropped["regenerated"] == 1
    assert generated(path) == 4 == len(group.episodes) + dropped_sum(state.dropped)


# ---------------------------------------------------------------------------- whole runs
def _rows(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]


@pytest.mark.slow
def test_totals_carry_over_two_resumes_and_every_episode_is_trained_or_dropped(
    tiny_model_dir, tmp_path
):
    """Three processes (steps 1, then 2, then 3, each resuming the last): the ``dropped/*``
    totals in metrics.jsonl never go back, and after each run the store's training episodes
    are the trained ones plus the dropped ones (held-out episodes are not counted)."""
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.loop import Trainer

    out = tmp_path / "run"
    overrides = [
        "env.id=test/AccountingParity-v0",
        "algorithm=dapo",  # dynamic sampling: the uniform groups of even tasks are dropped
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=1",
        "rollout.max_head_offpolicyness=1",
        "sampling.max_new_tokens=8",
        "eval.episodes=1",
        "train.save_every=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
    ]
    for steps in (1, 2, 3):
        cfg = load_config(None, [*overrides, f"train.steps={steps}"])
        trainer = Trainer(cfg, resume=steps > 1, quiet=True)
        asyncio.run(trainer.run())
        st = trainer.state
        assert st.step == steps
        assert generated(out / "episodes.db") == st.episodes_consumed + dropped_sum(st.dropped), (
            steps,
            st.dropped,
            st.episodes_consumed,
        )
    rows = _rows(out)
    assert len(rows) == 3
    reasons = {k for r in rows for k in r if k.startswith("dropped/")}
    assert rows[0].get("dropped/uniform_group", 0) > 0, "the first run dropped a uniform group"
    for reason in reasons:
        values = [r.get(reason, 0.0) for r in rows]
        assert values == sorted(values), (reason, values)  # totals, never restarted
