"""Final answers for the search env: extraction, normalization, exact match, F1, QA files.

Normalization follows the usual open-domain QA convention: lowercase, drop punctuation,
drop the articles ``a``, ``an`` and ``the``, collapse whitespace. Exact match and token F1
are taken against every accepted alias; the best one counts.

    >>> extract_answer("I looked it up.\\nAnswer: The Velo River.")
    'The Velo River.'
    >>> exact_match("the velo river", ["Velo River"])
    1.0
    >>> round(f1_score("Maren", ["Maren Tolvask"]), 3)
    0.667
"""

from __future__ import annotations

import json
import os
import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from areal_agents.envs.search.kb import QAExample

__all__ = [
    "exact_match",
    "extract_answer",
    "f1_score",
    "load_qa",
    "normalize_answer",
    "split_examples",
]

_BOXED_RE = re.compile(r"\\boxed\{")
_ANSWER_RE = re.compile(r"(?im)^\W*(?:final\s+)?answer\s*[:：]\s*(.+?)\s*$")
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation + "“”‘’«»")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, with nested braces balanced."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    start, depth = starts[-1], 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def extract_answer(content: str | None) -> str:
    """The final answer in a message: the last ``\\boxed{X}``, else the last
    ``Answer: X`` line, else the whole message (stripped)."""
    text = content or ""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_RE.findall(text)
    if lines:
        return str(lines[-1]).strip()
    return text.strip()


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals a normalized answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """The best token-level F1 between the prediction and an answer (normalized)."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold or common == 0:
            best = max(best, float(pred == gold))
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def load_qa(path: str | os.PathLike[str]) -> tuple[list[QAExample], list[str | None]]:
    """Read a QA file: JSONL ``{"question", "answer", "id"?, "chain"?, "split"?}``.

    ``answer`` is a string or a list of aliases (the first is canonical); ``chain`` an
    optional list of gold document ids; ``split`` an optional split name (``"train"``,
    ``"test"``...). Missing ids become ``q00000``, ``q00001``, ... (by line).

    Returns:
        The examples and, parallel to them, each one's explicit split (or None).

    Raises:
        ValueError: a line is not a JSON object with the fields above (with its number).
    """
    examples: list[QAExample] = []
    splits: list[str | None] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                example, split = _qa_from_line(line, f"{path}, line {number}", len(examples))
                examples.append(example)
                splits.append(split)
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: duplicate question id {duplicate!r}")
    return examples, splits


def _qa_from_line(line: str, where: str, index: int) -> tuple[QAExample, str | None]:
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: 'answer' must be a string or a non-empty list of strings")
    chain = row.get("chain", [])
    if not isinstance(chain, list) or not all(isinstance(c, (str, int)) for c in chain):
        raise ValueError(f"{where}: 'chain' must be a list of document ids")
    split = row.get("split")
    if split is not None and not isinstance(split, str):
        raise ValueError(f"{where}: 'split' must be a string")
    qid = str(row.get("id", f"q{index:05d}"))
    chain_ids = tuple(str(c) for c in chain)
    return QAExample(qid, question, tuple(answers), chain_ids, len(chain_ids)), split


def split_examples(
    examples: Sequence[QAExample],
    split: str,
    *,
    explicit: Sequence[str | None] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> list[QAExample]:
    """The examples of one split.

    With ``explicit`` split names (one per example, all given) the split is theirs.
    Otherwise a seeded shuffle sends ``test_fraction`` of the examples to ``"test"`` and
    the rest to ``"train"``. ``split="all"`` returns every example.
    """
    if split == "all":
        return list(examples)
    if explicit is not None and any(s is not None for s in explicit):
        if any(s is None for s in explicit):
            raise ValueError("either every QA row has a 'split' or none has")
        chosen = [e for e, s in zip(examples, explicit, strict=True) if s == split]
        names = sorted({s for s in explicit if s is not None})
    else:
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train', 'test' or 'all', got {split!r}")
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction: expected a number in [0, 1], got {test_fraction!r}")
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        n_test = round(len(examples) * test_fraction)
        test = set(order[:n_test])
        keep = (lambda i: i in test) if split == "test" else (lambda i: i not in test)
        chosen = [e for i, e in enumerate(examples) if keep(i)]
        names = ["train", "test"]
    if not chosen:
        raise ValueError(f"split {split!r} has no questions; available splits: {names}")
    return chosen
