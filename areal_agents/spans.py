"""Where a run's time goes: spans recorded at run time, and the busy / idle accounting.

A *span* is ``(lane, name, start, end)`` on the process's ``time.perf_counter`` clock, plus
a few attributes. The embedded engine records its ``prefill`` and ``decode`` steps (a
prefill of requests interrupted by a weight update is a ``reprefill``) and the
``weight_update`` it applies; the trainer records ``logprobs`` (proximal and reference
passes), ``forward``, ``backward`` and ``optimizer``, the ``weight_sync`` to the engine and
the ``warm_start``; the rollout records each episode (lane ``episodes``), the time a new
group waits for the staleness gate (``gate_full``) and the time a group's finished episodes
wait for its slowest one (``group_tail``); a compute-lock holder's wait for the lock is a
``lock_wait`` on its own lane.

Recording is a list append (no I/O, no profiler); :meth:`SpanRecorder.flush` appends the
spans to ``spans.jsonl`` (the trainer calls it once per step). The first line is a header
``{"clock": "perf_counter", "t0": ..., "wall_t0": ...}``; each later line is one span
``{"lane", "name", "start", "end", ...attrs}`` with times in seconds since ``t0``.

Busy and idle (:func:`busy_idle`), over a window ``[a, b]`` of wall time ``W = b - a``::

    busy_L  = | U(compute spans of lane L) - U(lock waits of lane L) | / W
    busy    = | U_L (U(compute of L) - U(waits of L)) | / W        (some compute running)
    idle_s  = W * (1 - busy)
    idle_<cause>_s = | idle time  ∩  U(spans of the cause) |

where ``U`` is the union of intervals and ``|.|`` its length. On a CPU the compute passes
share one lock and each uses every core, so ``busy`` is the share of time the cores compute.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

COMPUTE = frozenset(
    {"prefill", "reprefill", "decode", "logprobs", "forward", "backward", "optimizer"}
)
"""Span names that count as computing."""

IDLE_CAUSES = ("gate_full", "group_tail", "weight_sync", "weight_update", "warm_start")
"""Span names that idle time is attributed to (``time/idle_<name>_s``)."""

Interval = tuple[float, float]


class SpanRecorder:
    """Collects spans in memory; ``flush`` appends them to a JSONL file (None: kept only
    for :meth:`window`, e.g. in tests). Thread-safe: the engine's worker thread, the
    trainer's thread and the event loop record into one recorder."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        keep_s: float = 3600.0,
        max_pending: int | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.max_pending = max_pending
        """At most this many spans wait for a flush or a drain (the oldest go first); None:
        no limit (a recorder with a file flushes every step)."""
        self.t0 = time.perf_counter()
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._recent: list[tuple[str, str, float, float]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            header = {"clock": "perf_counter", "t0": self.t0, "wall_t0": time.time()}
            with self.path.open("a") as f:
                f.write(json.dumps(header) + "\n")

    def add(self, lane: str, name: str, start: float, end: float, **attrs: Any) -> None:
        """Record one span (``start`` / ``end`` from ``time.perf_counter``)."""
        if end <= start:
            return
        row = {"lane": lane, "name": name, "start": start, "end": end, **attrs}
        with self._lock:
            self._pending.append(row)
            self._recent.append((lane, name, start, end))
            if self.max_pending is not None and len(self._pending) > self.max_pending:
                cut = len(self._pending) - self.max_pending
                del self._pending[:cut]
                del self._recent[: max(0, len(self._recent) - self.max_pending)]

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **attrs: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter(), **attrs)

    def window(self, start: float, end: float) -> list[tuple[str, str, float, float]]:
        """The recorded spans that overlap ``[start, end]`` (older ones than ``keep_s``
        before the newest window are forgotten)."""
        with self._lock:
            self._recent = [s for s in self._recent if s[3] >= end - self.keep_s]
            return [s for s in self._recent if s[3] > start and s[2] < end]

    def drain(self) -> list[dict[str, Any]]:
        """Hand over the spans recorded since the last drain, times on the wall clock
        (``time.time``), and forget them: how a process with no file of its own (an engine
        actor) passes its spans to the process that writes them (:meth:`merge`)."""
        shift = time.time() - time.perf_counter()
        with self._lock:
            rows, self._pending, self._recent = self._pending, [], []
        return [{**r, "start": r["start"] + shift, "end": r["end"] + shift} for r in rows]

    def merge(self, rows: Iterable[dict[str, Any]], **attrs: Any) -> None:
        """Record spans that another process drained (wall-clock times), on this process's
        clock, with ``attrs`` added (e.g. ``lane="engine1"``)."""
        shift = time.perf_counter() - time.time()
        for r in rows:
            r = {**r, **attrs}
            lane, name = r.pop("lane"), r.pop("name")
            start, end = r.pop("start") + shift, r.pop("end") + shift
            self.add(lane, name, start, end, **r)

    def flush(self) -> None:
        """Append the spans recorded since the last flush to the file."""
        with self._lock:
            rows, self._pending = self._pending, []
        if self.path is None or not rows:
            return
        lines = []
        for r in rows:
            r = {**r, "start": round(r["start"] - self.t0, 6), "end": round(r["end"] - self.t0, 6)}
            lines.append(json.dumps(r))
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")


class _Off:
    """The recorder when nothing records: every call is a no-op."""

    path = None

    def add(self, *args: Any, **kw: Any) -> None:
        return None

    @contextlib.contextmanager
    def span(self, *args: Any, **kw: Any) -> Iterator[None]:
        yield

    def window(self, start: float, end: float) -> list[tuple[str, str, float, float]]:
        return []

    def drain(self) -> list[dict[str, Any]]:
        return []

    def merge(self, rows: Iterable[dict[str, Any]], **attrs: Any) -> None:
        return None

    def flush(self) -> None:
        return None


_OFF = _Off()
_current: SpanRecorder | _Off = _OFF


def current() -> SpanRecorder | _Off:
    """The process's recorder (a no-op one unless :func:`record_to` started one)."""
    return _current


def record_to(path: str | Path | None, *, max_pending: int | None = None) -> SpanRecorder:
    """Start recording this process's spans (to ``path``; None: in memory only)."""
    global _current
    _current = SpanRecorder(path, max_pending=max_pending)
    return _current


def stop() -> None:
    """Flush and stop recording."""
    global _current
    _current.flush()
    _current = _OFF


def add(lane: str, name: str, start: float, end: float, **attrs: Any) -> None:
    _current.add(lane, name, start, end, **attrs)


def span(lane: str, name: str, **attrs: Any) -> contextlib.AbstractContextManager[None]:
    return _current.span(lane, name, **attrs)


class TimedLock:
    """A compute lock (or none) whose waits are recorded as ``lock_wait`` spans on the
    holder's lane: ``with gate("forward"):`` waits for the lock, then records the held
    time as a ``forward`` span (``name=None``: only the wait)."""

    def __init__(self, lock: Any, lane: str) -> None:
        self.lock = lock
        self.lane = lane

    @contextlib.contextmanager
    def __call__(self, name: str | None = None, **attrs: Any) -> Iterator[None]:
        t0 = time.perf_counter()
        with self.lock if self.lock is not None else contextlib.nullcontext():
            t1 = time.perf_counter()
            if t1 - t0 > 1e-4:
                add(self.lane, "lock_wait", t0, t1)
            try:
                yield
            finally:
                if name is not None:
                    add(self.lane, name, t1, time.perf_counter(), **attrs)


# ------------------------------------------------------------------ interval arithmetic
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """``xs - ys`` for disjoint sorted lists (from :func:`union`)."""
    out: list[Interval] = []
    j = 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """``xs ∩ ys`` for disjoint sorted lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(xs: Iterable[Interval]) -> float:
    return sum(b - a for a, b in xs)


def pinned_lane_cores(
    engine_cpus: Sequence[int] | None,
    trainer_cpus: Sequence[int] | None,
    idle_engine_cpus: Sequence[int] | None = None,
) -> dict[str, int | str] | None:
    """The ``cores`` argument of :func:`busy_idle` for a run whose engine and trainer each
    have cores of their own (``rollout.engine_cpus``, ``train.cpus``): ``{"engine": n,
    "trainer": m}``; None unless both are pinned (they share the cores). An idle-priority
    engine replica (``rollout.idle_engine_cpus``, lane ``engine_idle``) on the trainer's or
    the engine's cores computes on that lane's cores (``"engine_idle": "trainer"``), else
    on cores of its own."""
    if not engine_cpus or not trainer_cpus:
        return None
    out: dict[str, int | str] = {"engine": len(engine_cpus), "trainer": len(trainer_cpus)}
    if idle_engine_cpus:
        idle = set(idle_engine_cpus)
        home = [
            lane
            for lane, cpus in (("trainer", trainer_cpus), ("engine", engine_cpus))
            if idle <= set(cpus)
        ]
        out["engine_idle"] = home[0] if home else len(idle)
    return out


def busy_idle(
    spans: Iterable[tuple[str, str, float, float]],
    start: float,
    end: float,
    *,
    cores: dict[str, int | str] | None = None,
) -> dict[str, float]:
    """The busy fractions and idle seconds of the window ``[start, end]`` (see the module
    docstring): ``time/busy``, ``time/busy_<lane>`` per lane that computed, ``time/idle_s``,
    ``time/idle_<cause>_s`` per :data:`IDLE_CAUSES`, ``time/lock_wait_s`` and
    ``time/reprefill_s`` (compute spent again on requests a weight update interrupted).

    ``cores``: when lanes run on cores of their own (``{"engine": 1, "trainer": 1}``), also
    ``time/busy_cores``, the share of those cores' time spent computing::

        busy_cores = sum_L |U(busy of L and of the lanes on L's cores)| / W * cores_L
                     / sum_L cores_L

    where a lane mapped to another lane's name (``{"engine_idle": "trainer"}``) computes on
    that lane's cores: their busy time counts once where both compute at once.
    """
    wall = end - start
    if wall <= 0:
        return {}
    clip = [(lane, name, max(a, start), min(b, end)) for lane, name, a, b in spans]
    clip = [s for s in clip if s[3] > s[2]]
    lanes = sorted({lane for lane, name, _, _ in clip if name in COMPUTE})
    busy_by_lane: dict[str, list[Interval]] = {}
    for lane in lanes:
        comp = union((a, b) for la, n, a, b in clip if la == lane and n in COMPUTE)
        waits = union((a, b) for la, n, a, b in clip if la == lane and n == "lock_wait")
        busy_by_lane[lane] = subtract(comp, waits)
    busy = union(i for xs in busy_by_lane.values() for i in xs)
    idle = subtract([(start, end)], busy)
    out = {"time/busy": length(busy) / wall, "time/idle_s": length(idle)}
    for lane, xs in busy_by_lane.items():
        out[f"time/busy_{lane}"] = length(xs) / wall
    for cause in IDLE_CAUSES:
        cover = union((a, b) for _, n, a, b in clip if n == cause)
        out[f"time/idle_{cause}_s"] = length(intersect(idle, cover))
    if cores:
        own = {lane: n for lane, n in cores.items() if isinstance(n, int)}
        core_seconds = 0.0
        for lane, n in own.items():
            guests = [g for g, host in cores.items() if host == lane]
            spans_on = [i for la in (lane, *guests) for i in busy_by_lane.get(la, [])]
            core_seconds += length(union(spans_on)) * n
        out["time/busy_cores"] = core_seconds / wall / sum(own.values())
    out["time/lock_wait_s"] = length(union((a, b) for _, n, a, b in clip if n == "lock_wait"))
    out["time/reprefill_s"] = length(union((a, b) for _, n, a, b in clip if n == "reprefill"))
    return out


def read(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``spans.jsonl``: its (last) header and its spans, times in seconds since that
    header's ``t0`` (a resumed run appends a new header; its spans are shifted by the wall
    clock difference so the timeline stays in order)."""
    header: dict[str, Any] = {}
    shift = 0.0
    rows: list[dict[str, Any]] = []
    first_wall: float | None = None
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed process
        if "clock" in row:
            header = row
            if first_wall is None:
                first_wall = float(row.get("wall_t0", 0.0))
            shift = float(row.get("wall_t0", 0.0)) - first_wall
            continue
        row["start"] = float(row["start"]) + shift
        row["end"] = float(row["end"]) + shift
        rows.append(row)
    return header, rows
