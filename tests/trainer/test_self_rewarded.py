"""Self-rewarded training (``rollout.agents: self_rewarded``): a service opens sessions in
groups with the worker token, its agent calls the model with the session key, the service
posts rewards and ends the sessions; the trainer trains on complete groups. Real proxy and
HTTP on loopback, a scripted engine (and the tiny model for the end-to-end run)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from areal_agents import ChatTokenizer, FakeEngine, Proxy
from areal_agents.client import TaskGone, TrainerSessions, WorkerError
from areal_agents.serve.server import LoopServer
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.rollout import SourceSettings
from areal_agents.trainer.session_source import SessionSource

G, B, TOKEN = 3, 2, "wk-test"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ChatTokenizer.from_dir(tiny_model_dir)


def fake_engine(tokenizer: ChatTokenizer) -> FakeEngine:
    end = tokenizer.token_id("<|im_end|>")
    rng = random.Random(0)

    def script(prompt_ids, params):
        words = " ".join("ab"[: rng.randint(1, 2)] for _ in range(rng.randint(1, 6)))
        return [*tokenizer.encode(words), end]

    return FakeEngine(script, delay_s=0.005)


@contextlib.asynccontextmanager
async def session_source(
    tokenizer, state: RunState, *, eta: int = 0, timeout_s: float | None = None, **kw: Any
) -> AsyncIterator[tuple[SessionSource, str]]:
    proxy = Proxy(fake_engine(tokenizer), tokenizer, self_rewarding=False, privileged_keys=[TOKEN])
    server = LoopServer(proxy)
    settings = SourceSettings.of(batch_size=B, group_size=G, eta=eta, **kw)
    src = SessionSource(
        settings,
        state,
        proxy,
        server,
        episode_timeout_s=timeout_s,
        sampling={"temperature": 0.6, "max_tokens": 8},
        retry_after_s=0.05,
    )
    await src.start(version=state.step)
    try:
        yield src, server.url
    finally:
        await src.close()


async def answer(session, prompt: str = "Say something.") -> str:
    """The service's agent: one model call with the session key, setting no sampling."""
    async with session.openai_client() as client:
        reply = await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}]
        )
    return reply.choices[0].message.content or ""


async def serve_group(sessions: TrainerSessions, name: str, rewards: list[float]) -> list[str]:
    opened = [await sessions.open(name, task_id=name) for _ in rewards]
    for s, r in zip(opened, rewards, strict=True):
        await answer(s)
        await sessions.reward(s, r)  # the latest completion
        await sessions.end(s)
    return [s.id for s in opened]


async def test_groups_of_ended_sessions_are_trained_on_with_their_rewards(tokenizer):
    state = RunState()
    async with session_source(tokenizer, state, eta=1) as (src, url):
        sessions = TrainerSessions(url, TOKEN)
        ids = {
            "req-a": await serve_group(sessions, "req-a", [1.0, 0.0, 0.5]),
            "req-b": await serve_group(sessions, "req-b", [0.0, 0.0, 2.0]),
        }
        groups = await asyncio.wait_for(src.next_batch(2), 10)
    by_name = {g.episodes[0].episode.group_id: g for g in groups}
    assert set(by_name) == {"req-a", "req-b"}
    assert sorted(g.number for g in groups) == [0, 1]
    for name, want in (("req-a", [1.0, 0.0, 0.5]), ("req-b", [0.0, 0.0, 2.0])):
        episodes = by_name[name].episodes
        assert [r.episode.session_id for r in episodes] == ids[name]
        assert [r.reward for r in episodes] == want
        for r in episodes:
            (call,) = r.episode.completions
            assert call.reward == r.reward  # on the completion the service rewarded
            assert call.sampling["temperature"] == 0.6  # the run's default: the call set none
            assert r.episode.task_id == name and r.ok
    assert len(src.proxy.sessions) == 0  # taken by the trainer


async def test_the_gate_answers_429_for_a_new_group_and_admits_the_open_ones(tokenizer):
    state = RunState()
    async with session_source(tokenizer, state, eta=0) as (src, url):  # room: B groups
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            for name in ("g1", "g2"):
                assert (await http.post("/sessions", json={"group": name})).status_code == 200
            full = await http.post("/sessions", json={"group": "g3"})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "no_room"
            # a session of an admitted group still opens; the group's G + 1-th does not
            for _ in range(G - 1):
                assert (await http.post("/sessions", json={"group": "g1"})).status_code == 200
            over = await http.post("/sessions", json={"group": "g1"})
            assert (
                over.status_code == 409 and "already has its 3" in over.json()["error"]["message"]
            )
            nameless = await http.post("/sessions", json={})
            assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "group"
            both = await http.post("/sessions", json={"group": "x", "group_id": "y"})
            assert both.status_code == 400
        # once the step trains (version 1), the gate has room and open() goes through
        sessions = TrainerSessions(url, TOKEN)
        waiting = asyncio.create_task(sessions.open("g3"))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await src.set_version(1)
        assert (await asyncio.wait_for(waiting, 5)).group == "g3"


async def test_keys_group_reuse_and_late_rewards_are_refused(tokenizer):
    state = RunState()
    async with session_source(tokenizer, state, eta=1) as (src, url):
        async with httpx.AsyncClient(base_url=url) as http:
            # no token, a wrong token: 401; the open call names the fix
            r = await http.post("/sessions", json={"group": "g"})
            assert r.status_code == 401 and "worker token" in r.json()["error"]["message"]
        with pytest.raises(WorkerError, match="401"):
            await TrainerSessions(url, "wrong").open("g")
        sessions = TrainerSessions(url, TOKEN)
        s = await sessions.open("g")
        await answer(s)
        async with httpx.AsyncClient(base_url=url) as http:
            own = {"Authorization": f"Bearer {s.api_key}"}
            # the agent's own key may call the model but not reward or end its session
            r = await http.post(f"/sessions/{s.id}/rewards", json={"value": 1000}, headers=own)
            assert r.status_code == 403
            r = await http.post(f"/sessions/{s.id}/end", json={}, headers=own)
            assert r.status_code == 403
        await sessions.end(s)
        with pytest.raises(TaskGone, match="went to training"):
            await sessions.reward(s, 1.0)
        for _ in range(G - 1):
            other = await sessions.open("g")
            await answer(other)
            await sessions.end(other)
        (group,) = await asyncio.wait_for(src.next_batch(1), 10)
        assert group.episodes[0].episode.session_id == s.id
        assert all(r.reward == 0.0 for r in group.episodes)
        with pytest.raises(TaskGone, match="used once"):
            await sessions.open("g")


async def test_a_group_whose_sessions_never_end_times_out_and_trains_on_the_rest(tokenizer):
    state = RunState()
    async with session_source(tokenizer, state, eta=1, timeout_s=3.0) as (src, url):
        sessions = TrainerSessions(url, TOKEN)
        # a full group whose third session is never ended (its agent died)
        done = []
        for r in (1.0, 0.0):
            s = await sessions.open("slow")
            await answer(s)
            await sessions.reward(s, r)
            await sessions.end(s)
            done.append(s.id)
        lost = await sessions.open("slow")
        await answer(lost)
        # a group that got only one session and an end with a failure reason
        fail = await sessions.open("short")
        await answer(fail)
        await sessions.end(fail, reason="agent_error")
        (group,) = await asyncio.wait_for(src.next_batch(1), 10)
        for _ in range(100):  # "short" expires too: nothing usable, skipped
            if state.skipped_groups:
                break
            await asyncio.sleep(0.1)
    assert [r.episode.session_id for r in group.episodes] == done
    assert src.dropped["agent_lost"] == 1
    assert src.dropped["agent_error"] == 1
    assert src.dropped["group_incomplete"] == G - 1
    assert state.skipped_groups == [1]


async def test_dynamic_sampling_drops_uniform_groups(tokenizer):
    state = RunState()
    async with session_source(tokenizer, state, eta=1, dynamic_sampling=True) as (src, url):
        sessions = TrainerSessions(url, TOKEN)
        await serve_group(sessions, "same", [1.0, 1.0, 1.0])
        await serve_group(sessions, "mixed", [1.0, 0.0, 1.0])
        (group,) = await asyncio.wait_for(src.next_batch(1), 10)
    assert group.episodes[0].episode.group_id == "mixed"
    assert src.dropped["uniform_group"] == G and state.skipped_groups == [0]  # episodes


async def test_a_resumed_run_skips_the_groups_that_were_in_flight(tokenizer):
    """Their sessions lived in the stopped process: they cannot be redone."""
    state = RunState(next_group=3, consumed_groups=[0])  # groups 1 and 2 were in flight
    async with session_source(tokenizer, state, eta=1) as (src, url):
        await asyncio.sleep(0.1)
        sessions = TrainerSessions(url, TOKEN)
        await serve_group(sessions, "after", [0.0, 1.0, 0.0])
        (group,) = await asyncio.wait_for(src.next_batch(1), 10)
    assert group.number == 3
    # skipped; their episodes count as lost_at_restart from the run's store (none here)
    assert sorted(state.skipped_groups) == [1, 2]


async def test_a_training_proxy_opens_sessions_only_for_trusted_keys(tokenizer):
    """open_sessions=False (every training run): POST /sessions needs the worker token or
    the admin key, so nobody else who reaches the port gets a session on the model."""
    proxy = Proxy(fake_engine(tokenizer), tokenizer, open_sessions=False, privileged_keys=[TOKEN])
    server = LoopServer(proxy)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.post("/sessions", json={})).status_code == 401
            bad = {"Authorization": "Bearer nope"}
            assert (await http.post("/sessions", json={}, headers=bad)).status_code == 401
            ok = {"Authorization": f"Bearer {TOKEN}"}
            assert (await http.post("/sessions", json={}, headers=ok)).status_code == 200
    finally:
        await server.stop()


def test_config_checks_of_self_rewarded_runs():
    from areal_agents.errors import ConfigError

    cfg = load_config(None, ["rollout.agents=self_rewarded"])
    assert cfg.env.id is None
    with pytest.raises(ConfigError) as err:
        load_config(None, [])
    assert "env.id: required, but missing" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "rollout.agents=self_rewarded",
                "env.id=areal/Calculator-v0",
                "algorithm=dapo",
                "rollout.probe_size=2",
                "workers.on_lost=drop",
                "sft.enabled=true",
                "sft.generate=10",
            ],
        )
    text = str(err.value)
    for key in ("env.id", "rollout.probe_size", "workers.on_lost", "sft.generate"):
        assert f"{key}:" in text
    # agent.train picks among an agent's sub-agents: with the model driving the env, an error
    with pytest.raises(ConfigError, match=r"agent\.train: picks among"):
        load_config(None, ["env.id=areal/Calculator-v0", "agent.train=[solver]"])


@pytest.mark.slow
def test_areal_agent_train_learns_from_a_self_rewarded_service(
    tiny_model_dir, tmp_path, engine_overrides
):
    """The whole loop: `Trainer` serves sessions, a service thread answers groups and posts
    rewards with the worker token, two steps train on them."""
    import threading

    from areal_agents.trainer.loop import Trainer

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "rollout.agents=self_rewarded",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=3",
            "rollout.batch_size=2",
            "rollout.max_head_offpolicyness=1",
            "sampling.max_new_tokens=6",
            "train.steps=2",
            "optim.lr=1e-3",
            "metrics.tensorboard=false",
            "workers.token=wk-e2e",
            f"train.output_dir={out}",
            *engine_overrides,
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    stop = threading.Event()
    opened: list[str] = []

    async def service() -> None:
        while not (out / "workers.json").exists():
            await asyncio.sleep(0.05)
        port = json.loads((out / "workers.json").read_text())["port"]
        sessions = TrainerSessions(f"http://127.0.0.1:{port}", "wk-e2e")
        n = 0
        while not stop.is_set():
            name = f"req-{n}"
            try:
                group = [await sessions.open(name, wait_s=2.0) for _ in range(3)]
            except (httpx.HTTPError, WorkerError, TaskGone):
                await asyncio.sleep(0.2)
                continue
            n += 1
            for i, s in enumerate(group):
                text = await answer(s, f"Request {name}")
                opened.append(s.id)
                await sessions.reward(s, float(len(text) % 2 + i), final=True)
                await sessions.end(s)

    thread = threading.Thread(target=lambda: asyncio.run(_until(service(), stop)), daemon=True)
    thread.start()
    try:
        asyncio.run(trainer.run())
    finally:
        stop.set()
        thread.join(10)
    assert type(trainer.source).__name__ == "SessionSource"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)
    ledger = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    trained = {sid for row in ledger for sid in row["sessions"]}
    assert trained and trained <= set(opened)


async def _until(work: Any, stop: Any) -> None:
    task = asyncio.ensure_future(work)
    while not stop.is_set() and not task.done():
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
