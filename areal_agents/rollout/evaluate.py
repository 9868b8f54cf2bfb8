"""Evaluation: run an env's tasks k times each, report success, pass@k, pass^k and failures.

``episodes`` is the total number of episodes: ``episodes // k`` tasks, each sampled ``k``
times as one group; task t resets its env with seed ``seed + t``. When the env has a fixed
pool (``num_tasks()``), the tasks are distinct pool entries, a seeded permutation of the
pool (``options={"task_index": i}``), so 128 episodes are 128 different problems while the
pool lasts; otherwise the seed picks the task. Per task with ``c`` successes out of ``n``
samples:

    pass@k = 1 - C(n - c, k) / C(n, k)      (at least one of k samples succeeds)
    pass^k = C(c, k) / C(n, k)              (all k samples succeed; tau-bench's reliability)

both averaged over tasks (unbiased estimators; with n == k they are "any" and "all").
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.rollout.runner import EpisodeResult, Runner


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples include a success."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k): the chance that k of the n samples are all successes."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples")
    return math.comb(c, k) / math.comb(n, k)


@dataclass
class EvalReport:
    """The summary ``areal-agent eval`` prints and writes."""

    env_id: str
    tasks: int
    k: int
    episodes: int
    success_rate: float
    pass_at_k: float
    pass_hat_k: float
    mean_reward: float
    mean_turns: float
    mean_output_tokens: float
    end_reasons: dict[str, int]
    by_kind: dict[str, float] = field(default_factory=dict)
    """Success rate per task kind, when the env labels tasks (e.g. arithmetic / word)."""
    duration_s: float = 0.0
    distinct_tasks: int | None = None
    """How many of the tasks differ (None when the env has no fixed pool to draw from)."""
    mean_tool_calls: float | None = None
    """Tool calls per episode, over the episodes whose env ran the tools (else None)."""
    tool_call_validity: float | None = None
    """Share of those calls whose result was not an error (None without any call)."""
    grounded_success_rate: float | None = None
    """Share of the episodes whose final info has ``grounded`` true: a success that read
    every gold document (areal/Search-v0); None when no episode's env reports it."""

    def table(self) -> str:
        rows = [
            ("episodes", f"{self.episodes} ({self.tasks} tasks x {self.k})"),
            *(
                [("distinct tasks", f"{self.distinct_tasks}")]
                if self.distinct_tasks is not None
                else []
            ),
            ("success rate", f"{self.success_rate:.1%}"),
            (f"pass@{self.k}", f"{self.pass_at_k:.1%}"),
            (f"pass^{self.k}", f"{self.pass_hat_k:.1%}"),
            ("mean reward", f"{self.mean_reward:.3f}"),
            ("mean turns", f"{self.mean_turns:.2f}"),
            ("mean output tokens", f"{self.mean_output_tokens:.1f}"),
        ]
        if self.mean_tool_calls is not None:
            rows.append(("mean tool calls", f"{self.mean_tool_calls:.2f}"))
        if self.tool_call_validity is not None:
            rows.append(("valid tool calls", f"{self.tool_call_validity:.1%}"))
        if self.grounded_success_rate is not None:
            rows.append(("grounded success", f"{self.grounded_success_rate:.1%}"))
        rows += [
            (f"success ({kind})", f"{rate:.1%}") for kind, rate in sorted(self.by_kind.items())
        ]
        rows += [(f"ended: {r}", str(n)) for r, n in sorted(self.end_reasons.items())]
        rows.append(("wall time", f"{self.duration_s:.1f} s"))
        width = max(len(a) for a, _ in rows)
        return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def summarize(
    env_id: str, groups: Sequence[Sequence[EpisodeResult]], k: int, duration_s: float = 0.0
) -> EvalReport:
    flat = [r for g in groups for r in g]
    if not flat:
        raise ValueError("no episodes to summarize")
    succ = [bool(r.success) for r in flat]
    kinds: dict[str, list[bool]] = {}
    for r in flat:
        kind = r.info.get("task", {}).get("kind") or r.info.get("kind")
        if kind:
            kinds.setdefault(str(kind), []).append(bool(r.success))
    counted = [r for r in flat if r.tool_calls is not None]
    calls = sum(r.tool_calls or 0 for r in counted)
    errors = sum(r.tool_errors or 0 for r in counted)
    grounded = [r.info.get("grounded") for r in flat]
    return EvalReport(
        env_id=env_id,
        tasks=len(groups),
        k=k,
        episodes=len(flat),
        success_rate=sum(succ) / len(flat),
        pass_at_k=sum(pass_at_k(len(g), sum(bool(r.success) for r in g), k) for g in groups)
        / len(groups),
        pass_hat_k=sum(pass_hat_k(len(g), sum(bool(r.success) for r in g), k) for g in groups)
        / len(groups),
        mean_reward=sum(r.reward for r in flat) / len(flat),
        mean_turns=sum(r.turns for r in flat) / len(flat),
        mean_output_tokens=sum(r.output_tokens for r in flat) / len(flat),
        end_reasons=dict(Counter(r.end_reason for r in flat)),
        by_kind={kind: sum(v) / len(v) for kind, v in kinds.items()},
        duration_s=duration_s,
        mean_tool_calls=calls / len(counted) if counted else None,
        tool_call_validity=1.0 - errors / calls if calls else None,
        grounded_success_rate=sum(g is True for g in grounded) / len(flat)
        if any(g is not None for g in grounded)
        else None,
    )


async def evaluate(
    runner: Runner,
    make_env: Callable[[], Any],
    *,
    env_id: str,
    episodes: int,
    k: int = 1,
    seed: int = 0,
    agent: Any = None,
    progress: Callable[[EpisodeResult], None] | None = None,
    group_prefix: str = "task",
) -> tuple[EvalReport, list[list[EpisodeResult]]]:
    """Run ``episodes // k`` tasks k times each (all concurrently, bounded by the runner);
    task t's episodes are the proxy's group ``{group_prefix}-{seed + t}``."""
    if k < 1 or episodes < k:
        raise ValueError(f"need episodes >= k >= 1, got episodes={episodes}, k={k}")
    loop = asyncio.get_running_loop()
    start = loop.time()

    indices = task_indices(make_env, episodes // k, seed)

    async def one_task(t: int) -> list[EpisodeResult]:
        results = []
        options = None if indices is None else {"task_index": indices[t]}
        coros = [
            runner.run_episode(
                make_env,
                seed=seed + t,
                options=options,
                agent=agent,
                group_id=f"{group_prefix}-{seed + t}",
            )
            for _ in range(k)
        ]
        for fut in asyncio.as_completed(coros):
            res = await fut
            if progress is not None:
                progress(res)
            results.append(res)
        return results

    groups = list(await asyncio.gather(*[one_task(t) for t in range(episodes // k)]))
    report = summarize(env_id, groups, k, loop.time() - start)
    report.distinct_tasks = None if indices is None else len(set(indices))
    return report, groups


def task_indices(make_env: Callable[[], Any], tasks: int, seed: int) -> list[int] | None:
    """Pool indices of ``tasks`` evaluation tasks: a permutation of the env's pool seeded by
    ``seed`` (repeated, each time reshuffled, when more tasks than the pool holds are asked
    for), or None when the env has no fixed pool (``num_tasks()`` missing or None)."""
    env = make_env()
    try:
        count_of = getattr(getattr(env, "unwrapped", env), "num_tasks", None)
        count = count_of() if callable(count_of) else None
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
    if not count:
        return None
    rng = random.Random(f"eval:{seed}")
    order: list[int] = []
    while len(order) < tasks:
        block = list(range(count))
        rng.shuffle(block)
        order += block
    return order[:tasks]


def write_outputs(
    out_dir: str | Path,
    report: EvalReport,
    groups: Sequence[Sequence[EpisodeResult]],
    gamma: float = 1.0,
) -> Path:
    """``episodes.jsonl`` (one recorded episode per line) and ``report.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "episodes.jsonl").open("w") as f:
        for g in groups:
            for r in g:
                row = r.episode.to_dict(gamma)
                row["result"] = {
                    "reward": r.reward,
                    "success": r.success,
                    "turns": r.turns,
                    "end_reason": r.end_reason,
                    "error": r.error,
                    "duration_s": r.duration_s,
                    "info": _jsonable(r.info),
                }
                f.write(json.dumps(row) + "\n")
    (out / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
