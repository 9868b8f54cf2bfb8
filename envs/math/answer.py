"""Final-answer extraction and checking for math tasks.

:func:`extract_answer` finds the answer in a model's final message, trying in order:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the last ``#### X`` (GSM8K style);
3. the last "answer is X" / "answer: X" / "answer = X" (the first number after it, if any);
4. the last number in the text (``-1,234.5`` and ``3/4`` count as numbers).

:func:`answers_match` compares an extracted answer with the gold answer. Numbers are
compared first (fast and exact): both sides are read as fractions (thousands separators,
``$`` and ``%`` dropped, ``\\frac{a}{b}`` read as ``a/b``) and match when
``|p - g| <= 1e-6 * max(1, |g|)``. Anything else goes to ``math_verify`` (``parse`` then
``verify``: symbolic equality, e.g. ``\\sqrt{2}/2`` and ``\\frac{1}{\\sqrt{2}}``).

    >>> extract_answer("So she has 3 + 4 = 7 apples. \\\\boxed{7}")
    '7'
    >>> answers_match("\\\\frac{3}{4}", "0.75")
    True
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

__all__ = ["answers_match", "extract_answer", "parse_number"]

MAX_ANSWER_CHARS = 200
"""Longer extracted answers are cut before symbolic checking (bounds its run time)."""

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*([^\n]+)")
_PHRASE_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def extract_answer(text: str | None) -> str | None:
    """Return the final answer written in ``text``, or None when there is none."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES_RE, _PHRASE_RE):
        matches = pattern.findall(text)
        if matches and matches[-1].strip():
            tail = matches[-1].strip()
            number = _NUMBER_RE.search(tail)
            if number and "\\" not in tail[: number.start()]:
                return _clean_number(number.group(0))
            return tail.rstrip(" .").strip("$ ") or None
    numbers = _NUMBER_RE.findall(text)
    return _clean_number(numbers[-1]) if numbers else None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _clean_number(text: str) -> str:
    return re.sub(r"\s+", "", text).replace(",", "")


def parse_number(text: str) -> Fraction | None:
    """Read ``text`` as an exact number (``"1,200"``, ``"$3.50"``, ``"3/4"``,
    ``"\\frac{3}{4}"``, ``"12%"``), or return None."""
    cleaned = text.strip().strip("$ .").replace("\\$", "").replace("\\!", "").replace(",", "")
    cleaned = cleaned.replace("\\%", "").removesuffix("%").strip()
    frac = _FRAC_RE.match(cleaned)
    if frac:
        cleaned = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        return Fraction(cleaned.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _numbers_equal(predicted: str, gold: str) -> bool:
    p, g = parse_number(predicted), parse_number(gold)
    if p is None or g is None:
        return False
    return abs(p - g) <= Fraction(1, 10**6) * max(Fraction(1), abs(g))


class _NoTimeoutWarning(logging.Filter):
    """Drops math_verify's warning that its timeout is off: :func:`_verify` turns it off on
    purpose in worker threads (where ``signal.alarm`` cannot run), and every env thread would
    print it otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


def _verify(predicted: str, gold: str) -> bool:
    """Symbolic check with math_verify; False when it cannot parse either side."""
    from math_verify import parse, verify  # noqa: PLC0415  math_verify loads only when grading

    # math_verify's timeouts use signal.alarm, which works only in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)  # type: ignore[arg-type]
        pred_parsed = parse(f"${predicted}$", parsing_timeout=timeout)  # type: ignore[arg-type]
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:
        return False


def answers_match(predicted: str | None, gold: str) -> bool:
    """True when the extracted answer ``predicted`` equals the gold answer."""
    if predicted is None or not predicted.strip():
        return False
    predicted = predicted.strip()[:MAX_ANSWER_CHARS]
    return _numbers_equal(predicted, gold) or _verify(predicted, gold)
