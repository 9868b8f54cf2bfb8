"""The episode store's rows: how sessions, completions and trainer records are encoded.

Long episodes cost O(tokens), not O(turns²): a completion is stored against a *base* (its
parent in the completion tree, or the session's previous completion, whichever shares
more): the base's prompt + output tokens shared with the new prompt are stored as a count,
and only the new suffix as tokens; the request messages likewise. :func:`rebuild` rebuilds
each prompt exactly (see :func:`~areal_agents.trajectory.prompt_base`).

Token ids, logprobs and versions are packed little-endian (``array`` typecodes ``i`` and
``d``); JSON is written with ASCII escapes, so whatever a client sent (lone surrogates
included) stores and reads back. ``train_tokens`` rows are checked before they are queued
(:func:`checked_train_row`) and packed in the writer thread (:func:`packed_train_row`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from areal_agents.serve.store_schema import TRAIN_FLAGS, TRAIN_FLOATS, TRAIN_SCALARS
from areal_agents.trajectory import Completion, PromptBase, prompt_base

if TYPE_CHECKING:
    from areal_agents.serve.session import Session

_LITTLE = sys.byteorder == "little"


def pack(kind: str, values: list[int] | list[float]) -> bytes:
    """``values`` as a little-endian array of ``kind`` (an ``array`` typecode)."""
    arr = array(kind, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack(kind: str, raw: bytes) -> list[Any]:
    """The values :func:`pack` packed as ``kind``."""
    arr = array(kind)
    arr.frombytes(raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def dumps(value: Any) -> str:
    """``value`` as compact JSON text."""
    # ensure_ascii: whatever a client sent (lone surrogates included) stores and reads back.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def session_row(session: Session) -> dict[str, Any]:
    """The ``sessions`` row of ``session`` (every column)."""
    ep = session.episode
    return {
        "id": session.id,
        "key_hash": session.key_hash or None,
        "group_id": ep.group_id,
        "task_id": ep.task_id,
        "metadata": dumps(ep.metadata),
        "sampling": dumps(session.sampling),
        "created_at": session.created_at,
        "last_active": session.last_active,
        "ended": ep.ended,
        "end_reason": ep.end_reason,
        "ended_at": time.time() if ep.ended else None,
        "final_reward": ep.final_reward,
        "errors": dumps(ep.errors),
    }


def completion_row(
    session: Session, seq: int, completion: Completion, earlier: list[Completion]
) -> dict[str, Any]:
    """The ``completions`` row of ``completion``, number ``seq`` of ``session``, stored as a
    delta against its base among ``earlier`` (the completions before it); the base is noted
    in ``session.episode.bases`` for delta reads of the live session."""
    base = prompt_base(earlier, completion)
    session.episode.bases[completion.id] = base  # for delta reads of the live session
    sid = session.id
    prev = earlier[-1] if earlier else None
    same_tools = prev is not None and prev.tools == completion.tools
    return {
        "session_id": sid,
        "seq": seq,
        "id": completion.id,
        "parent_id": completion.parent_id,
        "base_seq": base.index,
        "base_tokens": base.tokens,
        "base_messages": base.messages,
        "prompt_suffix": pack("i", completion.prompt_ids[base.tokens :]),
        "messages_suffix": dumps(completion.messages[base.messages :]),
        "output_ids": pack("i", completion.output_ids),
        "output_logprobs": pack("d", completion.output_logprobs),
        "output_versions": pack("i", completion.output_versions),
        "message": dumps(completion.message),
        "finish_reason": completion.finish_reason,
        "tools": None if same_tools else dumps(completion.tools),
        "tools_as_previous": same_tools,
        "parse_errors": dumps(completion.parse_errors),
        "sampling": dumps(completion.sampling),
        "created_at": completion.created_at,
        "latency_s": completion.latency_s,
        "queue_s": completion.queue_s,
        "reward": completion.reward,
        "agent": completion.agent,
        "context_rewrite": completion.context_rewrite,
        "context_edits": None
        if completion.context_edits is None
        else dumps(completion.context_edits),
        "segment": completion.segment,
        "trained": completion.trained,
    }


def rebuild(rows: Any, bases: dict[str, PromptBase]) -> Iterator[Completion]:
    """Completions from their stored rows (in sequence order), prompts rebuilt exactly;
    ``bases`` gets each one's :class:`PromptBase`."""
    built: list[Completion] = []
    for r in rows:
        prompt = unpack("i", r["prompt_suffix"])
        messages = json.loads(r["messages_suffix"])
        if r["base_seq"] is not None:
            base = built[r["base_seq"]]
            if k := r["base_tokens"]:  # one copy of the shared prefix (long episodes)
                bp = base.prompt_ids
                head = bp[:k] if k <= len(bp) else bp + base.output_ids[: k - len(bp)]
                head.extend(prompt)
                prompt = head
            if m := r["base_messages"]:
                bm = base.messages
                carried = bm[:m] if m <= len(bm) else [*bm, base.message]
                messages = carried + messages
        tools = built[-1].tools if r["tools_as_previous"] and built else None
        if not r["tools_as_previous"]:
            tools = json.loads(r["tools"]) if r["tools"] is not None else None
        c = Completion(
            id=r["id"],
            messages=messages,
            prompt_ids=prompt,
            output_ids=unpack("i", r["output_ids"]),
            output_logprobs=unpack("d", r["output_logprobs"]),
            output_versions=unpack("i", r["output_versions"]),
            message=json.loads(r["message"]),
            finish_reason=r["finish_reason"],
            tools=tools,
            parse_errors=json.loads(r["parse_errors"]),
            sampling=json.loads(r["sampling"]),
            created_at=r["created_at"],
            latency_s=r["latency_s"],
            queue_s=r["queue_s"],
            parent_id=r["parent_id"],
            reward=r["reward"],
            agent=r["agent"],
            # rows written before revision 0003 hold NULL: not rewritten, trained
            context_rewrite=r["context_rewrite"],
            context_edits=None if r["context_edits"] is None else json.loads(r["context_edits"]),
            segment=r["segment"] or 0,
            trained=r["trained"] is not False,
        )
        built.append(c)
        bases[c.id] = PromptBase(r["base_seq"], r["base_tokens"], r["base_messages"])
        yield c


def checked_train_row(i: int, row: Any) -> dict[str, Any]:
    """``row`` (number ``i`` of a ``put_train_tokens`` call) if it is a complete, well-typed
    ``train_tokens`` row; else ``ValueError`` saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"train_tokens row {i}: expected a dict, got {type(row).__name__}")
    want = {*TRAIN_SCALARS, *TRAIN_FLOATS, *TRAIN_FLAGS}
    missing, extra = sorted(want - row.keys()), sorted(row.keys() - want)
    if missing or extra:
        raise ValueError(f"train_tokens row {i}: missing {missing}, unknown {extra}")
    for name, kinds in TRAIN_SCALARS.items():
        value = row[name]
        ok = isinstance(value, kinds) and (name == "merged" or not isinstance(value, bool))
        if not ok:
            want_kind = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"train_tokens row {i}: {name} must be {want_kind}, got {value!r}")
    if row["step"] < 1 or row["version"] < 0:
        raise ValueError(
            f"train_tokens row {i}: step must be >= 1 and version >= 0, got step "
            f"{row['step']}, version {row['version']}"
        )
    lengths = {name: len(row[name]) for name in (*TRAIN_FLOATS, *TRAIN_FLAGS)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"train_tokens row {i}: the per-token arrays differ in length: {lengths}")
    for name in TRAIN_FLOATS:
        if not all(isinstance(v, int | float) for v in row[name]):
            raise ValueError(f"train_tokens row {i}: {name} must hold numbers")
    for name in TRAIN_FLAGS:
        if not all(isinstance(v, bool | int) and v in (0, 1) for v in row[name]):
            raise ValueError(f"train_tokens row {i}: {name} must hold booleans")
    if not math.isfinite(row["ret"]):
        raise ValueError(f"train_tokens row {i}: ret must be finite, got {row['ret']}")
    return row


def packed_train_row(row: dict[str, Any]) -> dict[str, Any]:
    """A checked ``train_tokens`` row with its per-token arrays packed for the table."""
    out = {name: row[name] for name in TRAIN_SCALARS}
    out["ret"] = float(out["ret"])
    for name in TRAIN_FLOATS:
        out[name] = pack("d", [float(v) for v in row[name]])
    for name in TRAIN_FLAGS:
        out[name] = pack("b", [int(bool(v)) for v in row[name]])
    return out


def decoded_train_row(stored: Any) -> dict[str, Any]:
    """A stored ``train_tokens`` row with its arrays decoded (lists of floats and bools)."""
    row = dict(stored)
    row["merged"] = bool(row["merged"])
    for name in TRAIN_FLOATS:
        row[name] = unpack("d", row[name])
    for name in TRAIN_FLAGS:
        row[name] = [bool(v) for v in unpack("b", row[name])]
    return row
