"""One episode store for a Ray run: the rollout workers' proxies write through a store-writer actor.

A local run's proxy writes every session, completion, reward and end to its
:class:`~areal_agents.serve.store.EpisodeStore`. On Ray each rollout worker holds a proxy of
its own (:mod:`areal_agents.rollout.ray_runner`), on any node, while the run's store is one
SQLite file in the run directory (or one PostgreSQL database). So:

* :class:`StoreHost`, the body of the **store-writer actor**, owns the run's
  :class:`EpisodeStore`. It runs on the driver's node (the run directory is there), takes no
  CPU slot, and commits what it is sent through the store's own writer thread (group commit).
* Every rollout worker's proxy gets a :class:`StoreLink` as its store. A link *is* an
  :class:`EpisodeStore` as far as the proxy can tell: its ``put_*`` methods are
  EpisodeStore's own, so the rows are exactly a local run's; only :meth:`StoreLink.submit`
  differs, queueing each write for the actor instead of a local database. A sender thread
  sends the queue in batches (every ``linger_s``, or at once when someone waits), **one
  call in flight per link**, so the actor applies each link's writes in the order they were
  made; the completion rows are built in that thread, off the event loop, as the local
  store builds them in its writer thread.
* Nothing in an episode waits for the store: a model call only queues its record (a
  worker's link does not wait in :meth:`StoreLink.flush`, which the proxy awaits before each
  HTTP answer; it only hurries the sender along). A worker waits once per episode, before
  it returns the episode (:meth:`StoreLink.drain`): the episode is then committed before the
  trainer sees it, so the trainer's own writes about it (a judge's rescoring, the step's
  ``train_tokens``) come after it. A store that fails or stops answering costs its records
  (counted, logged in the Ray logs), never the episode.
* The driver (trainer or ``eval``) holds a :class:`RayStore`: it starts the actor, is a link
  itself (the trainer's ``put_rescored`` and ``put_train_tokens`` go through it, in order,
  and its :meth:`~StoreLink.flush` waits for their commit, as a local store's does), ends
  the open sessions of a rollout worker that died (:meth:`RayStore.end_link`, as
  ``worker_lost``), reads the store directly (the actor is on the driver's node), and
  closes it.

A PostgreSQL store works the same way: the actor opens the URL, so every record still goes
through one writer. ``areal-agent view`` reads the store as it reads a local run's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from areal_agents.rollout.cluster import ray, wait_ready
from areal_agents.serve.session import Session
from areal_agents.serve.store import (
    INSERT_COMPLETION,
    INSERT_RESPONSE,
    INSERT_SESSION,
    UPDATE_REWARD,
    UPDATE_SESSION,
    EpisodeStore,
)
from areal_agents.serve.store_rows import checked_train_row
from areal_agents.serve.store_schema import make_engine, sessions, store_url
from areal_agents.serve.store_writer import Lazy

log = logging.getLogger(__name__)

_STATEMENTS: dict[str, Any] = {
    "INSERT_SESSION": INSERT_SESSION,
    "UPDATE_SESSION": UPDATE_SESSION,
    "INSERT_COMPLETION": INSERT_COMPLETION,
    "UPDATE_REWARD": UPDATE_REWARD,
    "INSERT_RESPONSE": INSERT_RESPONSE,
}
"""The store's statements a link sends, by name (the statements themselves stay here)."""
_NAMES = {id(stmt): name for name, stmt in _STATEMENTS.items()}
_READS = frozenset({"load", "session_id_for_key", "response"})
"""What a rollout worker's proxy may read from the store (through the actor)."""

Op = tuple[str, Any]
"""A write as it travels to the actor: a statement's name and its parameters, or one of
``train_tokens`` (checked rows), ``task`` ((id, values)) and ``end_link`` ({link, reason})."""
_Pending = tuple[Op | Lazy, concurrent.futures.Future[Any], Any]
"""A queued write, its future, and the value the future gets once the write is committed."""


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------- the actor
class StoreHost:
    """The body of the store-writer actor: the run's :class:`EpisodeStore`, written in the
    order each link sends, and the sessions each link holds open (to end them when its
    worker dies)."""

    def __init__(self, url: str) -> None:
        self.store = EpisodeStore(url)
        self._open: dict[str, set[str]] = {}
        self.failed = 0

    async def describe(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def write(self, link: str, ops: list[Op]) -> list[str | None]:
        """Queue ``ops`` (all of them before any other call's) and wait for their commit;
        per op, None or the error that kept it out of the store."""
        opened = self._open.setdefault(link, set())
        queued: list[list[concurrent.futures.Future[Any]] | str] = []
        for name, params in ops:
            try:
                queued.append(self._submit(name, params, opened))
            except Exception as exc:  # a bad row: that op fails, the others go on
                queued.append(_text(exc))
        out: list[str | None] = []
        for item in queued:
            error = item if isinstance(item, str) else None
            if not isinstance(item, str):
                for fut in item:
                    try:
                        await asyncio.wrap_future(fut)
                    except Exception as exc:
                        error = error or _text(exc)
            if error is not None:
                self.failed += 1
                if self.failed <= 5:
                    log.warning("episode store: a write from %s failed: %s", link, error)
            out.append(error)
        return out

    def _submit(
        self, name: str, params: Any, opened: set[str]
    ) -> list[concurrent.futures.Future[Any]]:
        if name == "train_tokens":
            return [self.store.put_train_tokens(params)]
        if name == "task":
            task_id, values = params
            return [self.store.put_task(task_id, **values)]
        if name == "end_link":
            return [self._end_link(params["link"], params["reason"])]
        stmt = _STATEMENTS[name]  # a KeyError: a link of another version
        if name == "INSERT_SESSION" and not params["ended"]:
            opened.add(params["id"])
        elif name == "UPDATE_SESSION" and (params.get("ended") or params.get("deleted_at")):
            opened.discard(params["w_id"])
        return [self.store.submit((stmt, params))]

    def _end_link(self, link: str, reason: str) -> concurrent.futures.Future[Any]:
        """End the sessions that ``link`` opened and did not end (its worker died)."""
        ids = sorted(self._open.pop(link, set()))

        def op(conn: Any) -> int:
            if not ids:
                return 0
            done = conn.execute(
                sessions.update()
                .where(sessions.c.id.in_(ids), sessions.c.ended.is_(False))
                .values(ended=True, end_reason=reason, ended_at=time.time())
            )
            return int(done.rowcount or 0)

        return self.store.submit(op)

    async def read(self, name: str, args: tuple[Any, ...]) -> Any:
        if name not in _READS:
            raise ValueError(f"the store-writer actor has no read {name!r}")
        return await asyncio.to_thread(getattr(self.store, name), *args)

    async def stats(self) -> dict[str, int]:
        return {**self.store.counters, "failed_writes": self.failed}

    async def close(self) -> None:
        await asyncio.to_thread(self.store.close)


# ---------------------------------------------------------------------------- the links
class StoreLink(EpisodeStore):
    """An :class:`EpisodeStore` whose writes go to the store-writer actor (see the module
    docstring), from any thread. :meth:`drain` and :meth:`flush_sync` wait until everything
    queued before them is committed (or failed: counted, logged); :meth:`flush` too, unless
    ``wait_on_flush`` is False (a rollout worker's link: it only hurries the sender). A
    worker's link reads what a proxy reads (a session, a response) from the actor.

    It builds its rows with EpisodeStore's ``put_*`` methods but has no database of its
    own, so it does not call EpisodeStore's constructor.
    """

    def __init__(
        self,
        host: Any,
        link_id: str,
        url: str,
        *,
        wait_on_flush: bool = True,
        linger_s: float = 0.05,
        batch_size: int = 1024,
        call_timeout_s: float = 120.0,
    ) -> None:
        self.host = host
        self.link_id = link_id
        self.url = url
        """The store's URL, without its password."""
        self.wait_on_flush = wait_on_flush
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.call_timeout_s = call_timeout_s
        self.counters = {"writes": 0, "batches": 0, "write_errors": 0, "send_errors": 0}
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._queued = 0  # writes queued so far
        self._acked = 0  # of them, answered by the actor
        self._waiters: list[tuple[int, concurrent.futures.Future[None]]] = []
        self._urgent = False
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="episode-store-link")
        self._sender.daemon = True
        self._sender.start()

    @classmethod
    def find(cls, info: dict[str, Any], link_id: str) -> StoreLink:
        """A rollout worker's link to the actor that ``info`` (:attr:`RayStore.info`) names."""
        return cls(ray.get_actor(info["name"]), link_id, info["url"], wait_on_flush=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, link {self.link_id})"

    # ------------------------------------------------------------------ writes
    def submit(self, op: Any) -> concurrent.futures.Future[Any]:
        """Queue one of EpisodeStore's writes for the actor (a Lazy one is built in the
        sender thread)."""
        if isinstance(op, tuple):
            name = _NAMES.get(id(op[0]))
            if name is None:
                raise TypeError(f"{self!r} cannot send the statement {op[0]}")
            op = (name, op[1])
        elif not isinstance(op, Lazy):
            raise TypeError(f"{self!r} sends rows, not code: {op!r}")
        return self._enqueue(op)

    def put_train_tokens(self, rows: list[dict[str, Any]]) -> concurrent.futures.Future[Any]:
        checked = [checked_train_row(i, row) for i, row in enumerate(rows)]
        return self._enqueue(("train_tokens", checked), result=len(checked))

    def put_task(self, wtask_id: str, /, **values: Any) -> concurrent.futures.Future[Any]:
        return self._enqueue(("task", (wtask_id, values)))

    def _enqueue(self, op: Op | Lazy, result: Any = None) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            self._pending.append((op, fut, result))
            self._queued += 1
            if len(self._pending) == 1 or len(self._pending) >= self.batch_size:
                self._cond.notify()
        return fut

    def _mark(self) -> concurrent.futures.Future[None]:
        """A future done once every write queued so far is answered."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            if self._acked >= self._queued:
                fut.set_result(None)
                return fut
            self._waiters.append((self._queued, fut))
            self._urgent = True
            self._cond.notify()
        return fut

    async def flush(self) -> None:
        """Wait until what is queued now is committed (or, ``wait_on_flush`` False, only send
        it now: a worker's model calls are never held up by the store)."""
        if self.wait_on_flush:
            await asyncio.wrap_future(self._mark())
            return
        with self._cond:
            if self._pending:
                self._urgent = True
                self._cond.notify()

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far is committed (or failed); False when that
        took longer than ``timeout_s`` (the writes still go on)."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._mark())), timeout_s)
        except TimeoutError:
            log.warning("%r: the store did not answer within %g s", self, timeout_s)
            return False
        return True

    def flush_sync(self, timeout: float | None = 60.0) -> None:
        self._mark().result(timeout)

    def close(self) -> None:
        """Send what is queued, then stop the sender (the actor and its store stay up)."""
        if self._closed:
            return
        with contextlib.suppress(TimeoutError):  # closing goes on
            self.flush_sync(self.call_timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._sender.join(timeout=self.call_timeout_s)

    # ------------------------------------------------------------------ the sender
    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                deadline = time.monotonic() + self.linger_s  # let a batch gather
                while not (self._urgent or self._closed or len(self._pending) >= self.batch_size):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = self._pending[: self.batch_size]
                del self._pending[: self.batch_size]
            errors = self._send(batch)
            with self._cond:
                self._acked += len(batch)
                for (_, fut, result), error in zip(batch, errors, strict=True):
                    self.counters["writes"] += 1
                    if error is not None:
                        self.counters["write_errors"] += 1
                        _settle(fut, exc=RuntimeError(f"{self!r}: {error}"))
                    else:
                        _settle(fut, result)
                done = [f for target, f in self._waiters if target <= self._acked]
                self._waiters = [(t, f) for t, f in self._waiters if t > self._acked]
                self._urgent = bool(self._waiters)
            for f in done:
                _settle(f)

    def _send(self, batch: list[_Pending]) -> list[str | None]:
        """One call to the actor; per write, None or why it is not in the store."""
        ops: list[Op | None] = []
        errors: list[str | None] = []
        for op, _, _ in batch:
            try:
                if isinstance(op, Lazy):
                    stmt, params = op.make()
                    op = (_NAMES[id(stmt)], params)
                ops.append(op)
                errors.append(None)
            except Exception as exc:  # a row that cannot be built: that write only
                ops.append(None)
                errors.append(_text(exc))
        sent = [op for op in ops if op is not None]
        self.counters["batches"] += 1
        try:
            answers = iter(
                ray.get(self.host.write.remote(self.link_id, sent), timeout=self.call_timeout_s)
                if sent
                else []
            )
        except Exception as exc:
            self.counters["send_errors"] += 1
            if self.counters["send_errors"] <= 3:
                log.warning(
                    "%r: %d episode-store writes lost: %s (the run goes on; see the Ray "
                    "logs, /tmp/ray/session_latest/logs, for why the store-writer actor "
                    "failed)",
                    self,
                    len(sent),
                    _text(exc),
                )
            return [error or _text(exc) for error in errors]
        return [
            error if op is None else next(answers) for op, error in zip(ops, errors, strict=True)
        ]

    # ------------------------------------------------------------------ a proxy's reads
    def _read(self, name: str, *args: Any) -> Any:
        self.flush_sync(self.call_timeout_s)
        return ray.get(self.host.read.remote(name, args), timeout=self.call_timeout_s)

    def session_id_for_key(self, api_key: str) -> str | None:
        return self._read("session_id_for_key", api_key)  # type: ignore[no-any-return]

    def load(self, session_id: str) -> Session | None:
        return self._read("load", session_id)  # type: ignore[no-any-return]

    def response(self, session_id: str, response_id: str) -> list[dict[str, Any]] | None:
        return self._read("response", session_id, response_id)  # type: ignore[no-any-return]


class RayStore(StoreLink):
    """The driver's side: :meth:`start` the store-writer actor for a store, hand
    :attr:`info` to the rollout workers (each makes its link with :meth:`StoreLink.find`),
    write through it like any link, read the store directly (every read of
    :class:`EpisodeStore`: the actor runs on this node), and :meth:`close` it at the end,
    after the workers (their drained writes are committed by then)."""

    def __init__(self, host: Any, url: str, shown: str, name: str) -> None:
        super().__init__(host, "driver", shown)
        self.name = name
        # reads, and the maintenance statements (close_open, expire) that a local store also
        # runs outside its writer; every other write goes through the actor
        self.engine = make_engine(url)
        self._stopped = False

    # the driver reads the store itself, as a local store does
    session_id_for_key = EpisodeStore.session_id_for_key
    load = EpisodeStore.load
    response = EpisodeStore.response

    @classmethod
    def start(cls, spec: str | Path, *, ready_timeout_s: float = 120.0) -> RayStore:
        """The store-writer actor for ``spec`` (a file path, SQLite, or a ``postgresql://``
        URL), on this node, and its client. The store is opened here first, so that a store
        that cannot be opened fails with its own message."""
        url = store_url(spec)
        EpisodeStore(url).close()  # creates or upgrades the schema; a bad URL fails here
        name = f"areal-store-{uuid.uuid4().hex[:12]}"
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
        actor: Any = ray.remote(StoreHost).options(
            name=name,
            num_cpus=0,
            max_restarts=3,
            max_task_retries=0,
            scheduling_strategy=strategy,
        )
        host = actor.remote(url)
        try:
            wait_ready([host.describe.remote()], "episode store writer", ready_timeout_s, 1)
        except BaseException:
            ray.kill(host)
            raise
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        return cls(host, url, shown, name)

    @property
    def info(self) -> dict[str, Any]:
        """What a rollout worker needs to find the actor."""
        return {"name": self.name, "url": self.url}

    def end_link(self, link_id: str, reason: str) -> None:
        """End the open sessions of ``link_id`` (a rollout worker that died) as ``reason``,
        after this link's earlier writes."""
        self._enqueue(("end_link", {"link": link_id, "reason": reason}))

    def stats(self) -> dict[str, int]:
        """The actor's store counters (``writes``, ``commits``, ``failed_writes``, ...)."""
        return dict(ray.get(self.host.stats.remote(), timeout=self.call_timeout_s))

    def close(self) -> None:
        """Commit what this link queued, close the store, end the actor. A store that failed
        is reported (the Ray logs say why), never raised: the records are for inspection."""
        if self._stopped:
            return
        self._stopped = True
        super().close()
        failed: int | str = 0
        try:
            failed = self.stats()["failed_writes"]
            ray.get(self.host.close.remote(), timeout=self.call_timeout_s)
        except Exception as exc:
            failed = f"the store writer failed at the end ({_text(exc)}); its last"
        finally:
            ray.kill(self.host)
            self.engine.dispose()
        lost = failed or self.counters["write_errors"]
        if lost:
            log.warning(
                "%s writes did not reach the episode store %s (the episodes recorded before "
                "are kept); see the Ray logs, /tmp/ray/session_latest/logs, for why",
                lost,
                self.url,
            )


def _settle(
    fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None
) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
