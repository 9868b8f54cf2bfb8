"""How often an LLM judge (``rewards.judge``, :mod:`areal_agents.trainer.judge`) agrees with
the gold answers of ``areal/Search-v0``'s knowledge base.

The model answers N held-out questions with search/open (greedy, through the proxy, as in a
training run). Each episode is judged twice with the rubric of
``examples/agents/search_judge.yaml``: as the model answered (labelled by the env's exact
match), and with its final answer replaced by ``Answer: <gold>`` (labelled correct), same
trace. The judge is the same model through the same proxy (sessions of groups ``judge-*``,
as in training) or, with ``--judge-url``, any OpenAI-compatible endpoint.

Reported: accuracy of the verdict (score >= 0.5) against the labels, balanced accuracy, the
area under the ROC curve of the score, the mean score of correct and of wrong answers, and
the same figures for the baseline in the same run, a judge that always says the majority
label (balanced accuracy 0.5, AUC 0.5), with the ratio of the judge's balanced accuracy to
it; then the judge's cost (calls, tokens, seconds, errors).

    python benchmarks/judge_agreement.py --episodes 32
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def auc(scores: list[float], labels: list[bool]) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def agreement(verdicts: list[bool], labels: list[bool]) -> tuple[float, float]:
    """(accuracy, balanced accuracy) of ``verdicts`` against ``labels``."""
    acc = sum(v == y for v, y in zip(verdicts, labels, strict=True)) / len(labels)
    rates = []
    for cls in (True, False):
        idx = [i for i, y in enumerate(labels) if y == cls]
        if idx:
            rates.append(sum(verdicts[i] == cls for i in idx) / len(idx))
    return acc, sum(rates) / len(rates)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out questions")
    p.add_argument("--model", default=None, help="the answering model (default: the default)")
    p.add_argument("--judge-url", default=None, help="an OpenAI-compatible judge endpoint")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()

    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.envs.registry import make
    from areal_agents.model import resolve_model
    from areal_agents.rollout.evaluate import evaluate
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.judge import make_judge

    overrides = [] if args.judge_url is None else [f"rewards.judge.base_url={args.judge_url}"]
    cfg = load_config(HERE.parent / "examples/agents/search_judge.yaml", overrides)
    path = resolve_model(args.model)
    tok = ChatTokenizer.from_dir(path)
    engine = EmbeddedEngine.from_pretrained(path, decode=tok.decode, max_batch_size=16)
    proxy = Proxy(engine, tok, default_max_tokens=args.max_tokens)
    runner = Runner(
        proxy,
        concurrency=16,
        max_turns=args.max_turns,
        sampling={"temperature": 0.0, "max_tokens": args.max_tokens},
    )
    t0 = time.perf_counter()
    report, groups = await evaluate(
        runner,
        lambda: make("areal/Search-v0", split="test", reward="em"),
        env_id="areal/Search-v0",
        episodes=args.episodes,
        seed=args.seed,
    )
    t_answer = time.perf_counter() - t0
    answered = [r for g in groups for r in g if r.ok and r.episode.completions]
    gold = []
    for r in answered:
        g = copy.deepcopy(r)
        g.episode.completions[-1].message = {
            "role": "assistant",
            "content": f"Answer: {r.info['answers'][0]}",
        }
        gold.append(g)
    labels = [bool(r.success) for r in answered] + [True] * len(gold)
    judge = make_judge(cfg.rewards, proxy, None)
    assert judge is not None
    await judge.start()
    t1 = time.perf_counter()
    items = answered + gold
    for k in range(0, len(items), 8):
        await judge.apply(f"bench{k}", items[k : k + 8])
    t_judge = time.perf_counter() - t1
    judged = [(r, y) for r, y in zip(items, labels, strict=True) if "judge" in r.episode.metadata]
    if not judged:
        errors = {str(r.error) for r in items}
        raise SystemExit(f"the judge scored no answer; its errors: {sorted(errors)[:3]}")
    scores = [r.episode.metadata["judge"]["score"] for r, _ in judged]
    ys = [y for _, y in judged]
    verdicts = [s >= 0.5 for s in scores]
    acc, bal = agreement(verdicts, ys)
    majority = sum(ys) * 2 >= len(ys)
    base_acc, base_bal = agreement([majority] * len(ys), ys)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    right = [s for s, y in zip(scores, ys, strict=True) if y]
    wrong = [s for s, y in zip(scores, ys, strict=True) if not y]
    m = judge.metrics()
    print(
        f"answers: {len(answered)} by the model ({sum(bool(r.success) for r in answered)} "
        f"correct by exact match, {report.success_rate:.0%} of {report.episodes}) + "
        f"{len(gold)} gold substitutes; answering {t_answer:.0f} s"
    )
    print(
        f"judged: {len(judged)} of {len(items)} ({int(m['judge/errors'])} judge_error); "
        f"{int(m['judge/calls'])} calls, {int(m['judge/prompt_tokens'])} prompt + "
        f"{int(m['judge/completion_tokens'])} completion tokens, {t_judge:.0f} s"
    )
    print(
        f"{'':>22} {'accuracy':>9} {'balanced':>9} {'AUC':>6} "
        f"{'score|right':>12} {'score|wrong':>12}"
    )
    print(
        f"{'judge (' + judge.backend.model[-12:] + ')':>22} {acc:9.1%} {bal:9.1%} "
        f"{auc(scores, ys):6.3f} {mean(right):12.3f} {mean(wrong):12.3f}"
    )
    print(f"{'majority baseline':>22} {base_acc:9.1%} {base_bal:9.1%} {0.5:6.3f}")
    print(f"ratio (balanced accuracy, judge / baseline): {bal / base_bal:.2f}x")
    if args.out is not None:
        rows = [
            {
                "label": y,
                "score": r.episode.metadata["judge"]["score"],
                "scores": r.episode.metadata["judge"]["scores"],
                "answer": r.episode.completions[-1].message.get("content"),
            }
            for r, y in judged
        ]
        args.out.write_text(json.dumps(rows, indent=1))
    await judge.close()
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
