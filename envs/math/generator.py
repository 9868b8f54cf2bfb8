"""Seeded generators for the calculator task: plain arithmetic and short word problems.

Every task carries the calculator ``expression`` whose value is the answer, so a correct
two-turn conversation (call the calculator, read the result, answer) can be written out for
supervised warm starts (:func:`demos`).

Candidate ``j`` of a stream comes from ``random.Random(f"{mode}:{j}")``: string seeds are
hashed with SHA-512 by :mod:`random`, so the stream is the same in every process.

- **arithmetic**: 2 or 3 integers (2 to 3 digits) joined by ``+``, ``-``, ``*``, with
  optional parentheses; division only when exact (``a * b / b``); in ``a - b * c`` (the
  shape of the word problems about change) ``a`` exceeds the product, so it may have 4;
- **word**: one- or two-step templates (buying, giving away, sharing equally, packs, pages,
  change), answers positive integers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from areal_agents.envs.math.tasks import MathTask
from areal_agents.tools.calculator import evaluate, format_number

__all__ = [
    "ARITHMETIC_PHRASES",
    "ARITHMETIC_SHAPES",
    "generate_task",
    "make_arithmetic",
    "make_word_problem",
]

ARITHMETIC_PHRASES = ("What is {e}?", "Calculate {e}.", "Compute {e}.", "Evaluate {e}.")
_NAMES = (
    "Ava",
    "Ben",
    "Chen",
    "Dana",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nora",
    "Omar",
    "Priya",
    "Ravi",
    "Sara",
    "Tom",
    "Yuki",
)
_ITEMS = (
    "apples",
    "stickers",
    "marbles",
    "books",
    "pencils",
    "cookies",
    "stamps",
    "shells",
    "cards",
    "oranges",
    "balloons",
    "coins",
)

Template = Callable[[random.Random, str, str], tuple[str, str]]


ARITHMETIC_SHAPES = (
    "a+b",
    "a-b",
    "a*b",
    "a/b",
    "a*b+c",
    "a*b-c",
    "a+b*c",
    "a-b*c",
    "(a+b)*c",
    "a+b-c",
    "(a-b)*c",
)
"""The solution shapes of the arithmetic questions (drawn uniformly by default)."""


def make_arithmetic(
    rng: random.Random, shape_weights: Mapping[str, float] | None = None
) -> tuple[str, str]:
    """A plain arithmetic question and its expression, e.g. ("What is 37 * 12 + 5?", ...).

    ``shape_weights`` reweights the shapes of :data:`ARITHMETIC_SHAPES` (those not named
    weigh 1), e.g. ``{"(a+b)*c": 3}`` for three times as many of that shape."""
    if shape_weights:
        weights = [float(shape_weights.get(s, 1.0)) for s in ARITHMETIC_SHAPES]
        shape = rng.choices(ARITHMETIC_SHAPES, weights)[0]
    else:
        shape = rng.choice(ARITHMETIC_SHAPES)
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 99)
    if "*" in shape:
        b = rng.randint(2, 99)
    if shape == "a/b":
        b = rng.randint(2, 40)
        a = b * rng.randint(2, 60)
    if shape == "(a-b)*c" and a < b:
        a, b = b, a
    if shape == "a-b*c":  # a positive result, like the word problems that subtract a product
        a = b * c + rng.randint(1, 400)
    expression = (
        shape.replace("a", str(a))
        .replace("b", str(b))
        .replace("c", str(c))
        .replace("+", " + ")
        .replace("-", " - ")
        .replace("*", " * ")
        .replace("/", " / ")
    )
    return rng.choice(ARITHMETIC_PHRASES).format(e=expression), expression


def _buy_more(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a, b = rng.randint(5, 120), rng.randint(3, 90)
    text = f"{name} has {a} {items}. {name} buys {b} more. How many {items} does {name} have now?"
    return text, f"{a} + {b}"


def _give_away(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a = rng.randint(20, 200)
    b = rng.randint(1, a - 1)
    return f"{name} had {a} {items} and gave away {b}. How many {items} are left?", f"{a} - {b}"


def _boxes(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a, b = rng.randint(3, 48), rng.randint(2, 25)
    text = f"A box holds {a} {items}. {name} has {b} full boxes. How many {items} is that?"
    return text, f"{a} * {b}"


def _share(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    b = rng.randint(2, 12)
    total = b * rng.randint(2, 30)
    text = (
        f"{name} shares {total} {items} equally among {b} friends. "
        f"How many {items} does each friend get?"
    )
    return text, f"{total} / {b}"


def _packs_minus(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a, b = rng.randint(2, 15), rng.randint(3, 24)
    c = rng.randint(1, a * b - 1)
    text = (
        f"{name} buys {a} packs of {items} with {b} {items} in each pack, then gives away "
        f"{c}. How many {items} does {name} have left?"
    )
    return text, f"{a} * {b} - {c}"


def _pages(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a, b, c = rng.randint(5, 60), rng.randint(2, 14), rng.randint(1, 50)
    text = (
        f"{name} reads {a} pages a day for {b} days and then {c} more pages. "
        f"How many pages does {name} read in total?"
    )
    return text, f"{a} * {b} + {c}"


def _change(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    a, b = rng.randint(2, 25), rng.randint(2, 9)
    paid = next(n for n in (10, 20, 50, 100, 200, 500) if n > a * b)
    text = (
        f"A ticket costs {a} dollars. {name} buys {b} tickets and pays with {paid} dollars. "
        f"How many dollars of change does {name} get?"
    )
    return text, f"{paid} - {a} * {b}"


def _spend(rng: random.Random, name: str, items: str) -> tuple[str, str]:
    b, c = rng.randint(2, 20), rng.randint(2, 9)
    a = b * c + rng.randint(1, 150)
    text = (
        f"{name} has {a} dollars and buys {c} bags of {items} at {b} dollars each. "
        f"How many dollars does {name} have left?"
    )
    return text, f"{a} - {b} * {c}"


_TEMPLATES: tuple[Template, ...] = (
    _buy_more,
    _give_away,
    _boxes,
    _share,
    _packs_minus,
    _pages,
    _change,
    _spend,
)


def make_word_problem(rng: random.Random) -> tuple[str, str]:
    """A one- or two-step word problem and the expression that solves it."""
    template = rng.choice(_TEMPLATES)
    return template(rng, rng.choice(_NAMES), rng.choice(_ITEMS))


def generate_task(
    mode: str,
    position: int,
    *,
    word_fraction: float = 0.5,
    shape_weights: Mapping[str, float] | None = None,
) -> MathTask:
    """Candidate ``position`` of the stream for ``mode`` (``"arithmetic"``, ``"word"`` or
    ``"mixed"``: word problems with probability ``word_fraction``); ``shape_weights``: see
    :func:`make_arithmetic`."""
    if mode not in ("arithmetic", "word", "mixed"):
        raise ValueError(f"kind must be 'arithmetic', 'word' or 'mixed', got {mode!r}")
    rng = random.Random(f"{mode}:{word_fraction}:{position}")
    word = mode == "word" or (mode == "mixed" and rng.random() < word_fraction)
    question, expression = make_word_problem(rng) if word else make_arithmetic(rng, shape_weights)
    return MathTask(
        task_id=f"calc-{mode}-{position}",
        question=question,
        answer=format_number(evaluate(expression)),
        kind="word" if word else "arithmetic",
        expression=expression,
    )
