"""An episode's private view of a tau² domain database.

A domain database is a JSON object of tables (``users``, ``orders``, ``flights`` ...), each a
mapping from a record id to a JSON record. Every episode needs its own mutable copy, and
concurrent episodes must never share state. A full deep copy of the airline database is
~50 MB of Python objects and ~60 ms per episode, which does not scale to hundreds of
concurrent episodes, so :class:`Database` copies on write, per record:

- the pristine tables loaded from disk are shared by every episode and never mutated;
- :meth:`Database.get` returns a record for reading (the caller must not mutate it);
- :meth:`Database.mutable` deep-copies a record into the episode's own layer the first time
  it is written, and returns that private copy from then on;
- :meth:`Database.insert` adds a new record to the episode's own layer.

Observable behaviour is exactly that of a private deep copy. Two databases built on the same
pristine tables compare equal (:meth:`Database.same_state`) when every record either of them
touched is equal in both; :meth:`Database.state_hash` hashes the whole merged state the way
the benchmark does (SHA-256 of sorted-key JSON), with integral floats written as integers so
that ``100`` and ``100.0`` hash alike (the benchmark's typed records make them the same value).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

Record = dict[str, Any]
Tables = Mapping[str, Mapping[str, Record]]


class Database:
    """A copy-on-write, per-episode view of shared pristine tables.

    Args:
        base: The pristine tables. They are shared and must never be mutated.

    Example:
        >>> base = {"users": {"u1": {"name": "Ada", "tags": []}}}
        >>> db = Database(base)
        >>> db.mutable("users", "u1")["tags"].append("vip")
        >>> db.get("users", "u1")["tags"], base["users"]["u1"]["tags"]
        (['vip'], [])
    """

    def __init__(self, base: Tables) -> None:
        self._base = base
        self._own: dict[str, dict[str, Record]] = {table: {} for table in base}

    @property
    def base(self) -> Tables:
        """The shared pristine tables this view is built on."""
        return self._base

    def _table(self, table: str) -> dict[str, Record]:
        if table not in self._own:
            raise KeyError(f"unknown table {table!r}; tables: {sorted(self._own)}")
        return self._own[table]

    def has(self, table: str, key: str) -> bool:
        """Whether ``table`` holds a record ``key``."""
        return key in self._table(table) or key in self._base[table]

    def get(self, table: str, key: str) -> Record | None:
        """The record ``key`` of ``table`` for reading, or ``None``. Do not mutate it."""
        own = self._table(table)
        if key in own:
            return own[key]
        return self._base[table].get(key)

    def mutable(self, table: str, key: str) -> Record:
        """The record ``key`` of ``table`` for writing (privately copied on first write).

        Raises:
            KeyError: If the record does not exist.
        """
        own = self._table(table)
        if key not in own:
            own[key] = copy.deepcopy(self._base[table][key])
        return own[key]

    def insert(self, table: str, key: str, record: Record) -> None:
        """Add (or replace) record ``key`` of ``table`` in this episode's own layer."""
        self._table(table)[key] = record

    def keys(self, table: str) -> Iterator[str]:
        """The record ids of ``table``: pristine ones in order, then new ones."""
        own = self._table(table)
        yield from self._base[table]
        for key in own:
            if key not in self._base[table]:
                yield key

    def values(self, table: str) -> Iterator[Record]:
        """The records of ``table`` (for reading), in :meth:`keys` order."""
        for key in self.keys(table):
            record = self.get(table, key)
            assert record is not None
            yield record

    def touched(self, table: str) -> set[str]:
        """The ids of the records of ``table`` this episode wrote or inserted."""
        return set(self._table(table))

    def same_state(self, other: Database) -> bool:
        """Whether this database's state equals ``other``'s (built on the same pristine tables).

        Raises:
            ValueError: If the two views are built on different pristine tables.
        """
        if other._base is not self._base:
            raise ValueError("can only compare databases built on the same pristine tables")
        for table in self._own:
            for key in self.touched(table) | other.touched(table):
                if self.get(table, key) != other.get(table, key):
                    return False
        return True

    def diff(self, other: Database) -> list[str]:
        """The ``table/key`` ids of the records whose state differs from ``other``'s."""
        changed = []
        for table in self._own:
            for key in sorted(self.touched(table) | other.touched(table)):
                if self.get(table, key) != other.get(table, key):
                    changed.append(f"{table}/{key}")
        return changed

    def to_dict(self) -> dict[str, dict[str, Record]]:
        """A full, independent deep copy of the merged state."""
        return {
            table: {
                key: copy.deepcopy(record)
                for key, record in zip(self.keys(table), self.values(table), strict=True)
            }
            for table in self._own
        }

    def state_hash(self) -> str:
        """SHA-256 of the merged state as canonical JSON (sorted keys, integral floats as ints)."""
        merged = {
            table: dict(zip(self.keys(table), self.values(table), strict=True))
            for table in self._own
        }
        text = json.dumps(_canonical(merged), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` with integral floats replaced by ints (so ``2.0`` and ``2`` hash alike)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value
