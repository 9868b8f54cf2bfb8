"""The episode store's writer thread: queued writes, committed in batches, in order.

Writes go through one writer thread that batches whatever is queued into one transaction
(group commit): :meth:`StoreWriter.submit` queues a write and returns a future that is done
once the write is committed, and :meth:`StoreWriter.flush` waits for everything queued so
far. The proxy awaits that before it answers, so nothing whose answer reached a client is
lost on ``kill -9``. Writes are ordered: they commit in the order they were submitted. One
bad write does not take its batch with it: a batch that fails is retried one write at a
time, and only the failing write's future gets the error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection, Engine

Write = tuple[Any, dict[str, Any]]
"""A statement and its parameters; consecutive writes of one statement run as one
``executemany``."""
Op = Any
"""A :data:`Write`, a :class:`Lazy` write, or a callable run with the connection."""


class Lazy:
    """A write whose parameters are computed in the writer thread (off the event loop)."""

    def __init__(self, make: Callable[[], Write]) -> None:
        self.make = make


class StoreWriter:
    """The write side of a store: one thread committing what :meth:`submit` queues on
    ``engine``, up to ``batch_size`` writes per transaction."""

    def __init__(self, engine: Engine, batch_size: int) -> None:
        self.engine = engine
        self.batch_size = batch_size
        self.counters: dict[str, int] = {"writes": 0, "commits": 0, "write_errors": 0}
        self._queue: queue.SimpleQueue[tuple[Op, concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._last: concurrent.futures.Future[Any] | None = None
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="episode-store", daemon=True)
        self._writer.start()

    def submit(self, op: Op) -> concurrent.futures.Future[Any]:
        """Queue ``op(connection)`` to run in the writer's next transaction."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((op, fut))
        self._last = fut
        return fut

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (raises if it failed)."""
        last = self._last
        if last is None or (last.done() and last.exception() is None):
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake(fut: concurrent.futures.Future[Any]) -> None:  # in the writer's thread
            loop.call_soon_threadsafe(_copy_outcome, fut, done)

        last.add_done_callback(wake)  # a waiter that is cancelled never cancels the write
        await done

    def flush_sync(self, timeout: float | None = 60.0) -> None:
        last = self._last
        if last is not None:
            last.result(timeout)

    def close(self) -> None:
        """Commit what is queued and stop the writer; reads still work."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=60)
        self.engine.dispose()

    def _write_loop(self) -> None:
        self._conn: Connection | None = None  # the writer's own connection, kept open
        try:
            self._write_until_closed()
        finally:
            if self._conn is not None:
                self._conn.close()

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self.engine.connect()
        return self._conn

    def _write_until_closed(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < self.batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Op, concurrent.futures.Future[Any]]]) -> None:
        try:
            conn = self._connection()
            with conn.begin():
                results = _run(conn, [op for op, _ in batch])
        except Exception:  # one bad write must not take its batch with it: one by one
            for op, fut in batch:
                try:
                    conn = self._connection()
                    with conn.begin():
                        (result,) = _run(conn, [op])
                except Exception as exc:
                    self.counters["write_errors"] += 1
                    _settle(fut, exc=exc)
                else:
                    _settle(fut, result)
                self.counters["commits"] += 1
            return
        self.counters["commits"] += 1
        self.counters["writes"] += len(batch)
        for (_, fut), result in zip(batch, results, strict=True):
            _settle(fut, result)


def _run(conn: Connection, ops: list[Op]) -> list[Any]:
    """Run ``ops`` in order on ``conn``; consecutive writes of one statement as one
    ``executemany``."""
    results: list[Any] = [None] * len(ops)
    group: list[dict[str, Any]] = []
    stmt: Any = None
    for i, op in enumerate(ops):
        if isinstance(op, Lazy):
            op = op.make()
        if isinstance(op, tuple):
            # one executemany needs one statement and the same parameter names (an UPDATE
            # takes its SET clause from them)
            if stmt is not None and (op[0] is not stmt or op[1].keys() != group[0].keys()):
                conn.execute(stmt, group)
                group = []
            stmt = op[0]
            group.append(op[1])
            continue
        if stmt is not None:
            conn.execute(stmt, group)
            stmt, group = None, []
        results[i] = op(conn)
    if stmt is not None:
        conn.execute(stmt, group)
    return results


def _copy_outcome(source: concurrent.futures.Future[Any], target: asyncio.Future[None]) -> None:
    if target.done():  # its waiter was cancelled
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(None)


def _settle(
    fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None
) -> None:
    """Resolve a write's future; one whose waiter gave up (cancelled) is left alone."""
    if not fut.set_running_or_notify_cancel():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
