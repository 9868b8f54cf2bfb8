"""The view's reads of an episode store: the episode browser's filtered pages, one episode
with its trainer records, a group, and an eval run's episodes by task.

Everything the browser filters on is a column or an index of the store (``sessions``
columns, the full-text index over messages, ``train_tokens.step``), so a page costs the
same on 10,000 episodes as on 100: the filtered ids are counted and one page of them is
read; per-episode figures (turns, reward, agents, step) are computed for that page only.

An episode's *reward* is what the runner reports: the sum of its completions' rewards plus
its final reward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import sqlalchemy as sa

from areal_agents.serve import store_schema
from areal_agents.serve.store_schema import completions, sessions
from areal_agents.trajectory import merge_decisions, message_key, prompt_base
from areal_agents.view.sources import stage_of_group, stage_order

if TYPE_CHECKING:
    from areal_agents.serve.store import EpisodeStore
    from areal_agents.trajectory import Completion, Episode

PAGE_SIZE = 50
SORTS = {
    "new": "newest first",
    "old": "oldest first",
    "reward": "highest reward",
    "-reward": "lowest reward",
    "turns": "most turns",
}


@dataclass
class Filters:
    """The episode browser's filters (all optional; combined with AND)."""

    end_reason: str | None = None
    q: str | None = None
    step: int | None = None
    group: str | None = None
    task: str | None = None
    env: str | None = None
    agent: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    stage: str | None = None
    """``training`` (the episodes of training groups) or a held-out label (``base``,
    ``warm_start``, ``step-N``, ``final``: the groups ``eval-<label>-<seed>``)."""
    sort: str = "new"

    @classmethod
    def parse(cls, params: dict[str, str]) -> tuple[Filters, list[str]]:
        """Filters from query parameters; the problems found (a bad number names the
        field), each ignored filter left unset."""
        problems: list[str] = []

        def text(name: str) -> str | None:
            v = (params.get(name) or "").strip()
            return v or None

        def number(name: str, kind: type) -> Any:
            v = text(name)
            if v is None:
                return None
            try:
                out = kind(v)
            except ValueError:
                problems.append(f"{name}: expected a number, got {v!r}")
                return None
            if isinstance(out, float) and not math.isfinite(out):
                problems.append(f"{name}: expected a finite number, got {v!r}")
                return None
            return out

        sort = text("sort") or "new"
        if sort not in SORTS:
            problems.append(f"sort: one of {', '.join(SORTS)}, got {sort!r}")
            sort = "new"
        stage = text("stage")
        if stage is not None and stage != "training" and stage_of_group(f"eval-{stage}-0") is None:
            problems.append(f"stage: training, base, warm_start, step-N or final, got {stage!r}")
            stage = None
        f = cls(
            end_reason=text("end_reason"),
            q=text("q"),
            step=number("step", int),
            group=text("group"),
            task=text("task"),
            env=text("env"),
            agent=text("agent"),
            reward_min=number("reward_min", float),
            reward_max=number("reward_max", float),
            stage=stage,
            sort=sort,
        )
        return f, problems

    def query_string(self, **changes: Any) -> str:
        values = {**self.__dict__, **changes}
        return urlencode({k: v for k, v in values.items() if v not in (None, "")})


def _train_tokens_table() -> sa.Table | None:
    table = getattr(store_schema, "train_tokens", None)
    return table if isinstance(table, sa.Table) else None


def _reward_expr() -> Any:
    summed = (
        sa.select(sa.func.coalesce(sa.func.sum(completions.c.reward), 0.0))
        .where(completions.c.session_id == sessions.c.id)
        .scalar_subquery()
    )
    return sa.func.coalesce(sessions.c.final_reward, 0.0) + summed


def _turns_expr() -> Any:
    return (
        sa.select(sa.func.count())
        .where(completions.c.session_id == sessions.c.id)
        .scalar_subquery()
    )


def _json_text(store: EpisodeStore, column: Any, key: str) -> Any:
    """``column`` (JSON text) -> its top-level ``key`` as text, per dialect."""
    if store.engine.dialect.name == "postgresql":
        return sa.func.json_extract_path_text(sa.cast(column, sa.JSON), key)
    return sa.func.json_extract(column, f"$.{key}")


def _where(store: EpisodeStore, f: Filters) -> list[Any]:
    conds: list[Any] = [sessions.c.deleted_at.is_(None)]
    if f.end_reason == "(open)":
        conds.append(sessions.c.ended.is_(False))
    elif f.end_reason:
        conds.append(sessions.c.end_reason == f.end_reason)
    if f.group:
        conds.append(sessions.c.group_id == f.group)
    if f.task:
        conds.append(sessions.c.task_id == f.task)
    if f.env:
        conds.append(_json_text(store, sessions.c.metadata, "env") == f.env)
    if f.agent:
        conds.append(
            sa.exists().where(
                completions.c.session_id == sessions.c.id, completions.c.agent == f.agent
            )
        )
    if f.step is not None:
        tt = _train_tokens_table()
        if tt is None:
            conds.append(sa.false())
        else:
            conds.append(sessions.c.id.in_(sa.select(tt.c.session_id).where(tt.c.step == f.step)))
    if f.reward_min is not None:
        conds.append(_reward_expr() >= f.reward_min)
    if f.reward_max is not None:
        conds.append(_reward_expr() <= f.reward_max)
    if f.q:
        conds.append(sessions.c.id.in_(store.fts_clause(f.q)))
    if f.stage == "training":
        conds.append(
            sa.or_(
                sessions.c.group_id.is_(None),
                sa.not_(sessions.c.group_id.startswith("eval-", autoescape=True)),
            )
        )
    elif f.stage:
        conds.append(sessions.c.group_id.startswith(f"eval-{f.stage}-", autoescape=True))
    return conds


def list_episodes(
    store: EpisodeStore, f: Filters, page: int = 1, page_size: int = PAGE_SIZE
) -> tuple[int, list[dict[str, Any]]]:
    """``(matching episodes, the rows of page ``page``)`` (1-based)."""
    conds = _where(store, f)
    order: list[Any]
    if f.sort == "old":
        order = [sessions.c.created_at.asc()]
    elif f.sort == "reward":
        order = [_reward_expr().desc(), sessions.c.created_at.desc()]
    elif f.sort == "-reward":
        order = [_reward_expr().asc(), sessions.c.created_at.desc()]
    elif f.sort == "turns":
        order = [_turns_expr().desc(), sessions.c.created_at.desc()]
    else:
        order = [sessions.c.created_at.desc()]
    page = max(1, page)
    with store.engine.connect() as conn:
        # one pass: the matching rows are counted by a window over the same statement
        heads = (
            conn.execute(
                sa.select(
                    sessions.c.id,
                    sessions.c.group_id,
                    sessions.c.task_id,
                    sessions.c.metadata,
                    sessions.c.created_at,
                    sessions.c.ended,
                    sessions.c.end_reason,
                    sessions.c.final_reward,
                    sa.func.count().over().label("total"),
                )
                .where(*conds)
                .order_by(*order)
                .limit(page_size)
                .offset((page - 1) * page_size)
            )
            .mappings()
            .all()
        )
        if heads:
            total = int(heads[0]["total"])
        else:  # past the last page (or nothing matches)
            total = int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(sessions).where(*conds)
                ).scalar()
                or 0
            )
        ids = [h["id"] for h in heads]
        per: dict[str, dict[str, Any]] = {i: {"turns": 0, "reward": 0.0, "agents": []} for i in ids}
        if ids:
            for sid, n, total_reward in conn.execute(
                sa.select(
                    completions.c.session_id,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(completions.c.reward), 0.0),
                )
                .where(completions.c.session_id.in_(ids))
                .group_by(completions.c.session_id)
            ):
                per[sid]["turns"], per[sid]["reward"] = int(n), float(total_reward)
            for sid, agent in conn.execute(
                sa.select(completions.c.session_id, completions.c.agent)
                .where(completions.c.session_id.in_(ids), completions.c.agent.is_not(None))
                .distinct()
            ):
                per[sid]["agents"].append(agent)
            tt = _train_tokens_table()
            if tt is not None:
                for sid, step in conn.execute(
                    sa.select(tt.c.session_id, sa.func.min(tt.c.step))
                    .where(tt.c.session_id.in_(ids))
                    .group_by(tt.c.session_id)
                ):
                    per[sid]["step"] = int(step)
    rows = []
    for h in heads:
        meta = _loads(h["metadata"])
        extra = per[h["id"]]
        rows.append(
            {
                "id": h["id"],
                "group_id": h["group_id"],
                "task_id": h["task_id"],
                "env": meta.get("env"),
                "success": meta.get("success"),
                "created_at": h["created_at"],
                "ended": bool(h["ended"]),
                "end_reason": h["end_reason"] if h["ended"] else "(open)",
                "reward": extra["reward"] + (h["final_reward"] or 0.0),
                "turns": extra["turns"],
                "agents": sorted(extra["agents"]),
                "step": extra.get("step"),
                "stage": (stage_of_group(h["group_id"]) or (None, None))[0],
            }
        )
    return total, rows


def facets(store: EpisodeStore) -> dict[str, list[Any]]:
    """The values the browser's drop-downs offer: end reasons, envs, agents, and the
    held-out stages whose episodes the store holds (base -> warm start -> step-N -> final;
    empty when it holds none)."""
    with store.engine.connect() as conn:
        reasons = [
            r[0]
            for r in conn.execute(
                sa.select(sessions.c.end_reason)
                .where(sessions.c.end_reason.is_not(None))
                .distinct()
                .order_by(sessions.c.end_reason)
            )
        ]
        env = _json_text(store, sessions.c.metadata, "env")
        envs = [
            r[0]
            for r in conn.execute(sa.select(env).where(env.is_not(None)).distinct().order_by(env))
        ]
        agents = [
            r[0]
            for r in conn.execute(
                sa.select(completions.c.agent)
                .where(completions.c.agent.is_not(None))
                .distinct()
                .order_by(completions.c.agent)
            )
        ]
        labels = {
            parsed[0]
            for (gid,) in conn.execute(
                sa.select(sessions.c.group_id)
                .where(sessions.c.group_id.startswith("eval-", autoescape=True))
                .distinct()
            )
            if (parsed := stage_of_group(gid)) is not None
        }
    stages = sorted(labels, key=stage_order)
    return {"end_reasons": reasons, "envs": envs, "agents": agents, "stages": stages}


def _loads(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------- one episode
def _nanmean(xs: list[float] | None) -> float | None:
    vals = [x for x in xs or [] if x is not None and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def episode_reward(episode: Episode) -> float:
    return sum(c.reward for c in episode.completions) + (episode.final_reward or 0.0)


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        out.append(
            {
                "id": call.get("id"),
                "name": fn.get("name") or "?",
                "arguments": args if isinstance(args, str) else _json_dumps(args),
            }
        )
    return out


def _json_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def pretty_json(text: str | None) -> str:
    """``text`` indented when it is JSON, else as it is."""
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def episode_detail(store: EpisodeStore, session_id: str, gamma: float) -> dict[str, Any] | None:
    """One episode as the episode view shows it (None: no such episode)."""
    session = store.load(session_id)
    if session is None:
        return None
    ep = session.episode
    rets = ep.returns(gamma)
    merges = merge_decisions(ep)
    records = _records(store, session_id)
    items = []
    for i, c in enumerate(ep.completions):
        base = ep.bases.get(c.id) or prompt_base(ep.completions[:i], c)
        carried = base.messages if base.index is not None else 0
        new_messages = c.messages[carried:]
        base_c = ep.completions[base.index] if base.index is not None else None
        # the base's reply, sent back in this request in the client's own spelling (call ids,
        # null fields): it is shown once, as the base's reply
        if (
            base_c is not None
            and new_messages
            and base.messages == len(base_c.messages)
            and message_key(new_messages[0]) == message_key(base_c.message)
        ):
            new_messages = new_messages[1:]
            carried += 1
        rec = records.get(c.id)
        versions = c.output_versions
        v_min = min(versions) if versions else None
        v_max = max(versions) if versions else None
        items.append(
            {
                "index": i,
                "id": c.id,
                "parent_id": c.parent_id,
                "agent": c.agent,
                "context_rewrite": c.context_rewrite,
                "segment": c.segment,
                "new_messages": [
                    {**m, "text": message_text(m), "calls": _tool_calls(m)} for m in new_messages
                ],
                "base_messages": carried,
                "reply": {
                    **c.message,
                    "text": message_text(c.message),
                    "calls": _tool_calls(c.message),
                },
                "finish_reason": c.finish_reason,
                "output_tokens": len(c.output_ids),
                "prompt_tokens": len(c.prompt_ids),
                "reward": c.reward,
                "return": rets[c.id],
                "merge": merges[i],
                "version_min": v_min,
                "version_max": v_max,
                "record": rec,
                "advantage": _nanmean(rec["advantages"]) if rec else None,
                "trained_version": rec["version"] if rec else None,
                "staleness": (rec["version"] - v_min) if rec and v_min is not None else None,
                "step": rec["step"] if rec else None,
                "latency_s": c.latency_s,
                "parse_errors": c.parse_errors,
                "logprob_mean": _nanmean(c.output_logprobs),
            }
        )
    return {
        "session": session,
        "episode": ep,
        "reward": episode_reward(ep),
        "completions": items,
        "tree": tree_rows(ep.completions),
        "metadata": ep.metadata,
        "advantage": _token_mean([r["advantages"] for r in records.values()]),
        "created_at": session.created_at,
    }


def _token_mean(arrays: list[list[float]]) -> float | None:
    vals = [x for a in arrays for x in a if x is not None and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def _records(store: EpisodeStore, session_id: str) -> dict[str, dict[str, Any]]:
    """The trainer's records of the session's completions (the latest step of each)."""
    reader = getattr(store, "train_tokens", None)
    if reader is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for r in reader(session_id):
        prev = out.get(r["completion_id"])
        if prev is None or r["step"] >= prev["step"]:
            out[r["completion_id"]] = r
    return out


TREE_INDENT_CAP = 4
"""The completion tree's rows are indented by their branch level, at most this many steps:
deeper branches keep the cap's indent and show their level as a number."""


def tree_rows(cs: list[Completion]) -> list[dict[str, Any]]:
    """The completion tree as a flat list of rows, in tree order (each completion after its
    parent, a parent's children oldest first, the roots oldest first), built without
    recursion: ``{index, id, agent, parent, depth, level, indent, forks, branch}``.

    ``depth``: the completion's ancestors (its turn on its branch); ``level``: the branches
    opened on the way to it (a completion's first child continues its branch, each later
    child opens a branch one level deeper; a later root starts at level 0 again);
    ``indent``: ``min(level, TREE_INDENT_CAP)``; ``forks``: how many children it has when
    more than one (else 0); ``branch``: whether the row does not continue the row above it
    (its parent is not the row just before: a branch opened at ``parent``, or a root after
    the first)."""
    index = {c.id: i for i, c in enumerate(cs)}
    children: list[list[int]] = [[] for _ in cs]
    roots: list[int] = []
    for i, c in enumerate(cs):
        p = index.get(c.parent_id) if c.parent_id else None
        if p is None or p == i:
            roots.append(i)
        else:
            children[p].append(i)
    rows: list[dict[str, Any]] = []
    placed = [False] * len(cs)
    # a stack of (completion, parent, depth, level), the next to show on top
    stack: list[tuple[int, int | None, int, int]] = [(r, None, 0, 0) for r in reversed(roots)]
    while stack:
        i, parent, depth, level = stack.pop()
        placed[i] = True
        kids = children[i]
        c = cs[i]
        rows.append(
            {
                "index": i,
                "id": c.id,
                "agent": c.agent,
                "parent": parent,
                "depth": depth,
                "level": level,
                "indent": min(level, TREE_INDENT_CAP),
                "forks": len(kids) if len(kids) > 1 else 0,
                "branch": bool(rows) and parent != rows[-1]["index"],
            }
        )
        for k in range(len(kids) - 1, -1, -1):
            stack.append((kids[k], i, depth + 1, level + (1 if k else 0)))
    for i in range(len(cs)):  # parent links that loop (never written by the proxy): no root
        if not placed[i]:
            placed[i] = True
            rows.append(
                {
                    "index": i,
                    "id": cs[i].id,
                    "agent": cs[i].agent,
                    "parent": None,
                    "depth": 0,
                    "level": 0,
                    "indent": 0,
                    "forks": 0,
                    "branch": True,
                }
            )
    return rows


def token_rows(
    detail: dict[str, Any], completion_id: str, tokenizer: Any, proximal: str | None = None
) -> dict[str, Any] | None:
    """The token view of one completion: its new prompt tokens (from tools, the user and
    the template: no loss) and its output tokens with their logprob, version and the
    trainer's per-token records.

    ``proximal`` is the run's ``loss.proximal`` (None: unknown, no config). Where the trainer
    recomputed the proximal logprobs (``recompute``, or unknown), a trained token sampled by
    the weights the trainer then had (its version is the record's ``version``) gets
    ``mismatch``: trainer - server logprob (``prox_logprobs - output_logprobs``), and the
    view a summary of them (:func:`mismatch_summary`). ``loglinear`` interpolates the
    proximal logprob from the server's, so there is nothing to compare."""
    ep: Episode = detail["episode"]
    idx = next((i for i, c in enumerate(ep.completions) if c.id == completion_id), None)
    if idx is None:
        return None
    c = ep.completions[idx]
    base = ep.bases.get(c.id) or prompt_base(ep.completions[:idx], c)
    suffix = c.prompt_ids[base.tokens :]
    strings = _strings(tokenizer, [*suffix, *c.output_ids])
    rec = detail["completions"][idx]["record"]
    compare = rec is not None and proximal in (None, "recompute")
    out = []
    for k, tid in enumerate(c.output_ids):
        logprob = c.output_logprobs[k] if k < len(c.output_logprobs) else None
        version = c.output_versions[k] if k < len(c.output_versions) else None
        prox = _at(rec, "prox_logprobs", k)
        fresh = compare and rec is not None and version == rec["version"]
        out.append(
            {
                "id": tid,
                "text": strings[len(suffix) + k],
                "logprob": logprob,
                "version": version,
                "weight": _at(rec, "behaviour_weights", k),
                "ratio_logp": _at(rec, "train_logprobs", k),
                "prox": prox,
                "mismatch": prox - logprob
                if fresh and prox is not None and logprob is not None
                else None,
                "advantage": _at(rec, "advantages", k),
                "clipped": bool(_at(rec, "clipped", k) or False),
                "behaviour_clipped": bool(_at(rec, "behaviour_clipped", k) or False),
            }
        )
    return {
        "completion": c,
        "index": idx,
        "shared_tokens": base.tokens,
        "prompt": [{"id": t, "text": strings[k]} for k, t in enumerate(suffix)],
        "output": out,
        "record": rec,
        "trained_version": rec["version"] if rec else None,
        "proximal": proximal,
        "mismatch": mismatch_summary([t["mismatch"] for t in out]),
    }


def mismatch_summary(diffs: list[float | None]) -> dict[str, float] | None:
    """Over the tokens with a trainer - server logprob ``d`` (the others None): their number,
    the mean k3 ``exp(d) - 1 - d`` (KL(server || trainer), as the trainer's ``mismatch/kl``)
    and the largest ``|d|``; None without any."""
    ds = [d for d in diffs if d is not None]
    if not ds:
        return None
    k3 = [math.exp(min(d, 700.0)) - 1.0 - d for d in ds]
    return {"tokens": len(ds), "kl": sum(k3) / len(ds), "abs_max": max(abs(d) for d in ds)}


def _at(rec: dict[str, Any] | None, key: str, k: int) -> Any:
    if not rec:
        return None
    xs = rec.get(key) or []
    if k >= len(xs):
        return None
    v = xs[k]
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def _strings(tokenizer: Any, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    try:
        return list(tokenizer.token_strings(ids))
    except Exception:
        return [f"<{i}>" for i in ids]


# ---------------------------------------------------------------------------- groups, evals
def group_episodes(store: EpisodeStore, group_id: str, gamma: float) -> list[dict[str, Any]]:
    """The episodes of group ``group_id``, best reward first, each with its final answer,
    tool calls and mean advantage."""
    with store.engine.connect() as conn:
        ids = [
            r[0]
            for r in conn.execute(
                sa.select(sessions.c.id)
                .where(sessions.c.group_id == group_id, sessions.c.deleted_at.is_(None))
                .order_by(sessions.c.created_at)
            )
        ]
    out = []
    for sid in ids:
        d = episode_detail(store, sid, gamma)
        if d is None:
            continue
        cs = d["completions"]
        out.append(
            {
                "id": sid,
                "reward": d["reward"],
                "advantage": d["advantage"],
                "turns": len(cs),
                "end_reason": d["episode"].end_reason,
                "success": d["metadata"].get("success"),
                "answer": cs[-1]["reply"]["text"] if cs else "",
                "calls": [call for c in cs for call in c["reply"]["calls"]],
                "completions": cs,
            }
        )
    out.sort(key=lambda e: -e["reward"])
    return out


def stage_episodes(
    store: EpisodeStore, labels: list[str]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The held-out episodes of stages ``labels`` (groups ``eval-<label>-<seed>``), by
    stage and then by task: ``{label: {seed: [{id, reward, success, task_id}]}}``. A task
    is its seed: the held-out evaluation gives each task the same seed at every stage."""
    reward = _reward_expr()
    out: dict[str, dict[str, list[dict[str, Any]]]] = {label: {} for label in labels}
    if not labels:
        return out
    prefix = [sessions.c.group_id.startswith(f"eval-{label}-", autoescape=True) for label in labels]
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                sessions.c.id, sessions.c.group_id, sessions.c.task_id, sessions.c.metadata, reward
            )
            .where(sessions.c.deleted_at.is_(None), sa.or_(*prefix))
            .order_by(sessions.c.created_at)
        ).all()
    for sid, gid, task, meta, r in rows:
        parsed = stage_of_group(gid)
        if parsed is None or parsed[0] not in out:
            continue
        out[parsed[0]].setdefault(parsed[1], []).append(
            {
                "id": sid,
                "reward": float(r or 0.0),
                "success": _loads(meta).get("success"),
                "task_id": task,
            }
        )
    return out


def episodes_by_task(store: EpisodeStore) -> dict[str, list[dict[str, Any]]]:
    """Every ended episode's ``{id, reward, success}`` by task id (eval comparisons)."""
    reward = _reward_expr()
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sessions.c.id, sessions.c.task_id, sessions.c.metadata, reward)
            .where(sessions.c.deleted_at.is_(None), sessions.c.task_id.is_not(None))
            .order_by(sessions.c.created_at)
        ).all()
    out: dict[str, list[dict[str, Any]]] = {}
    for sid, task, meta, r in rows:
        out.setdefault(task, []).append(
            {"id": sid, "reward": float(r or 0.0), "success": _loads(meta).get("success")}
        )
    return out
