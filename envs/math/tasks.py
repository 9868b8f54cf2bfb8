"""Math task pools: reasoning-gym generators, GSM8K-format JSONL files, and splits.

A pool is an indexable, finite sequence of :class:`MathTask`. Generated pools come from a
deterministic stream of candidate tasks (position ``j`` always gives the same task):

- the **split** of a task is a function of its question text alone: ``"test"`` when
  ``int(sha256(question)[:8], 16) % 100 < test_percent``, else ``"train"``. The same
  question can therefore never be in both splits, whatever the seeds or pool sizes;
- a split's pool is the stream filtered to that split, duplicates dropped, first
  ``num_tasks`` kept. Tasks are generated lazily and cached per process.

A JSONL file (``{"question": ..., "answer": "...#### 42"}`` per line, GSM8K format) gives
its tasks as they are; split the data into files yourself.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "MathTask",
    "TaskPool",
    "load_jsonl",
    "reasoning_gym_pool",
    "split_of",
]

Split = Literal["train", "test"]
DEFAULT_TEST_PERCENT = 20
STREAM_SIZE = 100_000
"""Candidates per reasoning-gym dataset stream; bounds the largest pool."""
_KINDS = {"basic_arithmetic": "arithmetic", "simple_equations": "arithmetic"}


@dataclass(frozen=True)
class MathTask:
    """One problem.

    Attributes:
        task_id: Stable id (``"gsm_symbolic-17"``, ``"calc-train-3"``, ``"data-12"``).
        question: The problem text shown to the agent.
        answer: The gold final answer (``"42"``).
        kind: ``"arithmetic"`` or ``"word"``, for success broken down by kind.
        expression: A calculator expression that evaluates to the answer, when known.
        solution: A worked solution, when known (GSM8K text before ``####``).
    """

    task_id: str
    question: str
    answer: str
    kind: str = "word"
    expression: str | None = None
    solution: str | None = None


def split_of(question: str, test_percent: int = DEFAULT_TEST_PERCENT) -> Split:
    """The split a question belongs to: a pure function of its text (see module doc)."""
    digest = hashlib.sha256(" ".join(question.split()).encode()).hexdigest()
    return "test" if int(digest[:8], 16) % 100 < test_percent else "train"


class TaskPool(Sequence[MathTask]):
    """The first ``num_tasks`` distinct tasks of ``split`` in a deterministic stream.

    Args:
        generate: ``generate(j)`` returns the candidate at stream position ``j``.
        split: ``"train"`` or ``"test"``.
        num_tasks: Size of the pool.
        test_percent: Share of questions (by hash) that belong to the test split.
        stream_size: Number of stream positions available.
    """

    def __init__(
        self,
        generate: Callable[[int], MathTask],
        split: Split,
        num_tasks: int,
        *,
        test_percent: int = DEFAULT_TEST_PERCENT,
        stream_size: int = STREAM_SIZE,
    ) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be positive, got {num_tasks}")
        self._generate = generate
        self.split = split
        self.num_tasks = num_tasks
        self.test_percent = test_percent
        self._stream_size = stream_size
        self._tasks: list[MathTask] = []
        self._seen: set[str] = set()
        self._position = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_tasks

    def __getitem__(self, index: int) -> MathTask:  # type: ignore[override]
        if not -self.num_tasks <= index < self.num_tasks:
            raise IndexError(f"task index {index} out of range for a pool of {self.num_tasks}")
        index %= self.num_tasks
        with self._lock:
            while len(self._tasks) <= index:
                self._advance()
        return self._tasks[index]

    def _advance(self) -> None:
        if self._position >= self._stream_size:
            raise ValueError(
                f"the task stream ran out after {len(self._tasks)} {self.split} tasks; "
                f"use num_tasks <= {len(self._tasks)}"
            )
        task = self._generate(self._position)
        self._position += 1
        key = " ".join(task.question.split())
        if key in self._seen or split_of(task.question, self.test_percent) != self.split:
            return
        self._seen.add(key)
        self._tasks.append(task)

    def find(self, task_id: str) -> int | None:
        """The index of the task with this id, or None."""
        for index in range(self.num_tasks):
            if self[index].task_id == task_id:
                return index
        return None


class ListPool(Sequence[MathTask]):
    """A fixed list of tasks (from a file)."""

    def __init__(self, tasks: Sequence[MathTask]) -> None:
        if not tasks:
            raise ValueError("the task list is empty")
        self._tasks = list(tasks)
        self.num_tasks = len(self._tasks)

    def __len__(self) -> int:
        return self.num_tasks

    def __getitem__(self, index: int) -> MathTask:  # type: ignore[override]
        return self._tasks[index]

    def find(self, task_id: str) -> int | None:
        """The index of the task with this id, or None."""
        return next((i for i, t in enumerate(self._tasks) if t.task_id == task_id), None)


# ---------------------------------------------------------------------------- sources

_POOLS: dict[tuple[object, ...], TaskPool] = {}
_POOLS_LOCK = threading.Lock()


def cached_pool(key: tuple[object, ...], build: Callable[[], TaskPool]) -> TaskPool:
    """Share one pool per key in the process (many envs, one generated task list)."""
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = build()
        return _POOLS[key]


def reasoning_gym_pool(
    datasets: Sequence[str], split: Split, num_tasks: int, *, seed: int = 0
) -> TaskPool:
    """A pool of reasoning-gym tasks; stream position ``j`` is item ``j // n`` of dataset
    ``datasets[j % n]`` (each dataset seeded with ``seed``)."""
    names = tuple(datasets)
    if not names:
        raise ValueError("datasets must name at least one reasoning-gym dataset")

    def build() -> TaskPool:
        try:
            import reasoning_gym  # noqa: PLC0415  reasoning-gym is an optional extra
        except ImportError as exc:
            raise ImportError(
                "reasoning-gym is needed for generated math tasks: "
                "pip install 'areal-agents[math]' (or pass data_path= a GSM8K-format JSONL)"
            ) from exc
        generators = [reasoning_gym.create_dataset(n, size=STREAM_SIZE, seed=seed) for n in names]

        def generate(j: int) -> MathTask:
            name = names[j % len(names)]
            item = generators[j % len(names)][j // len(names)]
            expression = item.get("metadata", {}).get("expression")
            return MathTask(
                task_id=f"{name}-{j // len(names)}",
                question=item["question"],
                answer=str(item["answer"]).strip(),
                kind=_KINDS.get(name, "word"),
                expression=expression,
                solution=item.get("metadata", {}).get("answer_cot"),
            )

        return TaskPool(generate, split, num_tasks, stream_size=STREAM_SIZE * len(names))

    return cached_pool(("reasoning_gym", names, split, num_tasks, seed), build)


def load_jsonl(path: str | Path) -> ListPool:
    """Read GSM8K-format tasks: one ``{"question": ..., "answer": "... #### 42"}`` per line.

    The gold answer is the text after the last ``####`` (commas dropped); the text before
    it is the worked solution. An optional ``"id"`` field gives the task id, otherwise
    ``"<file stem>-<line number>"``. An optional ``"kind"`` field sets the kind.
    """
    path = Path(path)
    tasks = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            question, answer_text = record["question"], str(record["answer"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{line_no}: expected a JSON object with 'question' and 'answer' "
                f"(GSM8K format), got {line[:80]!r} ({exc})"
            ) from None
        solution, _, final = answer_text.rpartition("####")
        tasks.append(
            MathTask(
                task_id=str(record.get("id", f"{path.stem}-{line_no}")),
                question=question,
                answer=(final if _ else answer_text).strip().replace(",", ""),
                kind=str(record.get("kind", "word")),
                solution=solution.strip() or None,
            )
        )
    return ListPool(tasks)
