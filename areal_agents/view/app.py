"""The web app of ``areal-agent view``: server-rendered pages (Jinja2) over the runs of a
:class:`~areal_agents.view.sources.RunSet`, plus the small JSON API the pages poll for live
updates.

Pages::

    /                                        runs: status, steps, elapsed, latest metrics
    /runs/NAME                               dashboard (plotly charts), config, checkpoints;
                                             an eval output's report tables
    /runs/NAME/episodes?filters              episode browser (filters, full-text search)
    /runs/NAME/episodes/SID                  one episode: conversation, tool calls, tree
    /runs/NAME/episodes/SID/tokens/CID       one completion's tokens, coloured
    /runs/NAME/groups/GID                    a group's episodes side by side
    /compare?a=NAME&b=NAME                   two eval outputs on the same tasks
    /compare?run=NAME&stages=base,final      a run's held-out stages side by side

JSON (for live updates): ``/api/runs``, ``/api/runs/NAME/metrics``,
``/api/runs/NAME/count`` (the browser's matching episodes). Pages of a run that is not
running do not poll. Any other path answers 404: a page, or JSON under ``/api/``.

With a ``token``, every request needs it: ``?token=T`` once (it is then kept in a cookie)
or the header ``Authorization: Bearer T``.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_agents.errors import ConfigError
from areal_agents.view import queries
from areal_agents.view.sources import Run, RunSet, stage_name

HERE = Path(__file__).parent
COOKIE = "areal_view_token"

CHARTS: list[tuple[str, str, list[str]]] = [
    ("reward_mean", "Reward (mean per episode)", ["reward_mean"]),
    ("success_rate", "Success rate", ["success_rate"]),
    ("kl", "KL", ["loss/kl", "loss/approx_kl"]),
    ("entropy", "Entropy", ["entropy"]),
    ("clip_fraction", "Clip fraction", ["loss/clip_fraction", "loss/behaviour_clip_fraction"]),
    (
        "staleness",
        "Staleness (trained tokens per policy-version lag)",
        ["histograms.staleness"],
    ),
    ("tokens_per_s", "Tokens per second", ["gen_tokens_per_s", "train_tokens_per_s"]),
    ("merge_rate", "Merge rate", ["merge_rate"]),
    ("dropped", "Dropped episodes by reason (run totals)", ["dropped/*"]),
    ("loss", "Loss", ["loss"]),
    ("grad_norm", "Gradient norm", ["grad_norm"]),
    ("busy", "Busy share of each step", ["time/busy", "time/busy_*", "time/cpu"]),
    ("idle", "Idle seconds of each step by cause", ["time/idle_*"]),
]
"""The dashboard's charts: ``(key, title, metric names; "prefix*" takes every metric whose
name starts with prefix, "histograms.staleness" the staleness histogram: trained tokens by
how many policy versions they lag)``. Quantities of different scale get charts of their own
(loss and gradient norm); within a chart, series of very different scale get a second y
axis. The held-out stages (base -> warm start -> step-N -> final) are a chart of their own
over the stages (``held_out``), not over steps."""

HELD_OUT_COLUMNS: list[tuple[str, str, str]] = [
    ("success_rate", "success", "pct"),
    ("mean_reward", "mean reward", "num"),
    ("mean_turns", "mean turns", "num"),
    ("mean_tool_calls", "tool calls / episode", "num"),
    ("tool_call_validity", "valid tool calls", "pct"),
]
"""The held-out table's figures: ``(key of an eval.json row, heading, how it is shown)``."""

LATEST_KEYS = [
    "reward_mean",
    "success_rate",
    "loss",
    "entropy",
    "loss/approx_kl",
    "loss/clip_fraction",
    "staleness_mean",
    "gen_tokens_per_s",
    "train_tokens_per_s",
    "merge_rate",
    "time/busy",
    "version",
    "elapsed_s",
]


def plotly_js() -> Path | None:
    """plotly.min.js of the installed ``plotly`` package (its ``package_data``)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    return path if path.exists() else None


def _quoted(text: str) -> str:
    """``text`` as a JSON string (escapes show whitespace), a plain string that autoescaping
    makes safe inside an attribute (``tojson`` leaves its quotes, which end a ``title``)."""
    return json.dumps(text, ensure_ascii=False)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 10 ** (-digits)):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "–"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def _ago(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "–"
    return _duration(max(0.0, time.time() - ts)) + " ago"


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


# An episode of more than LONG_EPISODE completions shows its first EPISODE_HEAD and last
# EPISODE_TAIL, and a link to the rest (?turns=all): a 150-turn page stays quick to render
# and to read; the completion tree always lists every completion.
LONG_EPISODE = 50
EPISODE_HEAD = 20
EPISODE_TAIL = 20


def create_app(sources: list[str | Path] | RunSet, token: str | None = None) -> FastAPI:
    """The view's FastAPI app over ``sources`` (see :mod:`areal_agents.view.sources`)."""
    runs = sources if isinstance(sources, RunSet) else RunSet(list(sources))
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = _fmt
    env.filters["quoted"] = _quoted
    env.filters["duration"] = _duration
    env.filters["ago"] = _ago
    env.filters["when"] = _when
    env.filters["pretty_json"] = queries.pretty_json
    env.filters["pct"] = _pct
    env.filters["stage_name"] = stage_name
    env.globals["SORTS"] = queries.SORTS
    env.globals["HELD_OUT_COLUMNS"] = HELD_OUT_COLUMNS

    app = FastAPI(title="areal-agent view", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def page(request: Request, name: str, status_code: int = 200, **ctx: Any) -> HTMLResponse:
        html = env.get_template(name).render(request=request, runs_all=runs.runs(), **ctx)
        return HTMLResponse(html, status_code=status_code)

    def error(request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return page(request, "error.html", status, title=title, message=message, code=status)

    if token:

        @app.middleware("http")
        async def check_token(request: Request, call_next: Any) -> Response:
            given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:]
            if not hmac.compare_digest(given.encode(), token.encode()):
                return HTMLResponse(
                    "<h1>401</h1><p>This view needs its token: open the URL that "
                    "<code>areal-agent view</code> printed (it ends in <code>?token=...</code>)."
                    "</p>",
                    status_code=401,
                )
            response: Response = await call_next(request)
            if request.query_params.get("token"):
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response

    def run_or_404(name: str) -> Run:
        run = runs.get(name)
        if run is None:
            raise HTTPException(404, f"no run named {name!r}")
        return run

    async def store_of(run: Run) -> Any:
        try:
            return await asyncio.to_thread(run.store)
        except ConfigError as exc:
            raise HTTPException(500, str(exc)) from exc

    async def episode_store(run: Run) -> Any:
        """The run's store; a run without one gets the "No episodes" page (``_NoStore``)."""
        store = await store_of(run)
        if store is None:
            raise _NoStore(run)
        return store

    @app.exception_handler(_NoStore)
    async def no_store(request: Request, exc: _NoStore) -> Response:
        return error(request, 404, "No episodes", exc.run.missing_store_hint())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Every HTTP error, the router's own (an unknown path, a wrong method) included:
        JSON under ``/api/``, else the error page."""
        if request.url.path.startswith("/api/"):
            return JSONResponse(
                {"error": exc.detail}, status_code=exc.status_code, headers=exc.headers
            )
        titles = {404: "Not found", 405: "Not allowed", 500: "Cannot read this run"}
        message = str(exc.detail)
        if not isinstance(exc, HTTPException):  # the router's: "Not Found" and the like
            message = {
                404: f"Nothing is at {request.url.path}.",
                405: f"{request.method} is not allowed on {request.url.path}.",
            }.get(exc.status_code, message)
        return error(request, exc.status_code, titles.get(exc.status_code, "Error"), message)

    # ------------------------------------------------------------------ pages
    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    async def plotly() -> Response:
        path = plotly_js()
        if path is None:
            raise HTTPException(404, "plotly is not installed: pip install plotly")
        return FileResponse(
            path, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"}
        )

    @app.get("/", response_class=HTMLResponse)
    async def runs_page(request: Request) -> HTMLResponse:
        rows = [(r, await asyncio.to_thread(r.status)) for r in runs.runs()]
        staged = [r.name for r in runs.runs() if r.kind == "train" and r.stages()]
        return page(
            request,
            "runs.html",
            rows=rows,
            latest_keys=LATEST_KEYS[:6],
            live=any(st["state"] == "training" for _, st in rows),
            watching=runs.watches_directories,
            staged=staged,
        )

    @app.get("/runs/{name}", response_class=HTMLResponse)
    async def run_page(request: Request, name: str) -> HTMLResponse:
        run = run_or_404(name)
        status = await asyncio.to_thread(run.status)
        names = await asyncio.to_thread(run.metric_names)
        others = [r.name for r in runs.runs() if r.name != name and r.kind == "train"]
        overlay = [o for o in request.query_params.get("overlay", "").split(",") if o in others]
        latest = [(k, status["latest"].get(k)) for k in LATEST_KEYS if k in status["latest"]]
        stages = await asyncio.to_thread(run.stages)
        return page(
            request,
            "run.html",
            run=run,
            status=status,
            stages=stages,
            charts=CHARTS,
            metric_names=names,
            latest=latest,
            others=others,
            overlay=overlay,
            report=run.report(),
            checkpoints=run.checkpoints(),
            tensorboard=run.tensorboard_dir(),
            has_store=run.store_location() is not None,
            store_hint=run.missing_store_hint(),
        )

    @app.get("/runs/{name}/episodes", response_class=HTMLResponse)
    async def episodes_page(request: Request, name: str) -> HTMLResponse:
        run = run_or_404(name)
        store = await episode_store(run)
        params = dict(request.query_params)
        filters, problems = queries.Filters.parse(params)
        try:
            page_no = max(1, int(params.get("page") or 1))
        except ValueError:
            problems.append(f"page: expected a number, got {params.get('page')!r}")
            page_no = 1
        total, rows = await asyncio.to_thread(queries.list_episodes, store, filters, page_no)
        facets = await asyncio.to_thread(queries.facets, store)
        status = await asyncio.to_thread(run.status)
        pages = max(1, math.ceil(total / queries.PAGE_SIZE))
        return page(
            request,
            "episodes.html",
            run=run,
            filters=filters,
            problems=problems,
            total=total,
            rows=rows,
            facets=facets,
            page_no=page_no,
            pages=pages,
            live=status["state"] == "training",
        )

    @app.get("/runs/{name}/episodes/{sid}", response_class=HTMLResponse)
    async def episode_page(request: Request, name: str, sid: str) -> HTMLResponse:
        run = run_or_404(name)
        store = await episode_store(run)
        detail = await asyncio.to_thread(queries.episode_detail, store, sid, run.gamma)
        if detail is None:
            raise HTTPException(404, f"no episode {sid!r} in {name}")
        n = len(detail["completions"])
        everything = request.query_params.get("turns") == "all" or n <= LONG_EPISODE
        hidden = range(0) if everything else range(EPISODE_HEAD, n - EPISODE_TAIL)
        return page(request, "episode.html", run=run, d=detail, gamma=run.gamma, hidden=hidden)

    @app.get("/runs/{name}/episodes/{sid}/tokens/{cid}", response_class=HTMLResponse)
    async def tokens_page(request: Request, name: str, sid: str, cid: str) -> HTMLResponse:
        run = run_or_404(name)
        store = await episode_store(run)
        detail = await asyncio.to_thread(queries.episode_detail, store, sid, run.gamma)
        if detail is None:
            raise HTTPException(404, f"no episode {sid!r} in {name}")
        tokenizer = await asyncio.to_thread(run.tokenizer)
        view = queries.token_rows(detail, cid, tokenizer, _proximal(run))
        if view is None:
            raise HTTPException(404, f"no completion {cid!r} in episode {sid}")
        mode = request.query_params.get("color", "logprob")
        if mode not in COLOR_MODES:
            mode = "logprob"
        colour = COLOR_MODES[mode]
        for t in view["output"]:
            t["style"] = colour(t, view)
            t["title"] = _token_title(t, view)
        for t in view["prompt"]:
            t["title"] = f"prompt token {t['id']} {_quoted(t['text'])} ({PROMPT_TOKEN})"
        return page(
            request,
            "tokens.html",
            run=run,
            d=detail,
            v=view,
            mode=mode,
            modes=COLOR_MODES,
            legend=LEGENDS[mode],
            has_tokenizer=tokenizer is not None,
        )

    @app.get("/runs/{name}/groups/{gid}", response_class=HTMLResponse)
    async def group_page(request: Request, name: str, gid: str) -> HTMLResponse:
        run = run_or_404(name)
        store = await episode_store(run)
        eps = await asyncio.to_thread(queries.group_episodes, store, gid, run.gamma)
        if not eps:
            raise HTTPException(404, f"no group {gid!r} in {name}")
        return page(request, "group.html", run=run, gid=gid, eps=eps)

    @app.get("/compare", response_class=HTMLResponse)
    async def compare_page(request: Request) -> HTMLResponse:
        a, b = request.query_params.get("a", ""), request.query_params.get("b", "")
        evals = [r.name for r in runs.runs() if r.store_location() is not None]
        staged = {
            r.name: [s["label"] for s in await asyncio.to_thread(r.stages)]
            for r in runs.runs()
            if r.kind == "train"
        }
        staged = {k: v for k, v in staged.items() if v}
        chosen = request.query_params.get("run", "")
        forms: dict[str, Any] = {"evals": evals, "a": a, "b": b, "staged": staged, "chosen": chosen}
        if chosen:
            return await compare_stages(request, run_or_404(chosen), forms)
        if not a or not b:
            return page(request, "compare.html", rows=None, **forms)
        ra, rb = run_or_404(a), run_or_404(b)
        sa_, sb = await episode_store(ra), await episode_store(rb)
        ta = await asyncio.to_thread(queries.episodes_by_task, sa_)
        tb = await asyncio.to_thread(queries.episodes_by_task, sb)
        rows = []
        for task in sorted(set(ta) & set(tb)):
            rows.append({"task": task, "a": _summary(ta[task]), "b": _summary(tb[task])})
        only = (len(set(ta) - set(tb)), len(set(tb) - set(ta)))
        return page(
            request,
            "compare.html",
            rows=rows,
            only=only,
            reports=(ra.report(), rb.report()),
            **forms,
        )

    async def compare_stages(request: Request, run: Run, forms: dict[str, Any]) -> HTMLResponse:
        """``/compare?run=NAME&stages=base,final``: the run's held-out stages side by side
        (all of them without ``stages``): their figures from eval.json, and task by task the
        episodes the run's store holds of each."""
        stages = await asyncio.to_thread(run.stages)
        by_label = {s["label"]: s for s in stages}
        # ?stages=base,final or, from the form's boxes, ?stages=base&stages=final
        given = ",".join(request.query_params.getlist("stages"))
        asked = [x.strip() for x in given.split(",") if x.strip()]
        problems = [f"{run.name} has no held-out stage {x!r}" for x in asked if x not in by_label]
        labels = [x for x in dict.fromkeys(asked) if x in by_label] or list(by_label)
        if not stages:
            problems.append(
                f"{run.name} recorded no held-out evaluation (eval.json): set eval.episodes "
                "in its config to evaluate the base model, the warm start and the final one"
            )
        chosen = [by_label[x] for x in labels]
        kinds = sorted({k for s in chosen for k in s["by_kind"]})
        tasks: list[dict[str, Any]] = []
        store = await store_of(run) if chosen else None
        if store is not None:
            eps = await asyncio.to_thread(queries.stage_episodes, store, labels)
            seeds = sorted({seed for per in eps.values() for seed in per}, key=int)
            for seed in seeds:
                cells = {label: _summary(eps[label].get(seed, [])) for label in labels}
                task_id = next(
                    (e["task_id"] for c in cells.values() for e in c["episodes"] if e["task_id"]),
                    None,
                )
                tasks.append({"seed": seed, "task_id": task_id, "cells": cells})
        return page(
            request,
            "compare.html",
            rows=None,
            run=run,
            stages=stages,
            chosen_stages=chosen,
            kinds=kinds,
            tasks=tasks,
            stage_problems=problems,
            **forms,
        )

    # ------------------------------------------------------------------ JSON
    @app.get("/api/runs")
    async def api_runs() -> dict[str, Any]:
        out = []
        for r in runs.runs():
            st = await asyncio.to_thread(r.status)
            out.append({"name": r.name, "kind": r.kind, **st})
        return {"runs": out}

    @app.get("/api/runs/{name}/metrics")
    async def api_metrics(name: str) -> dict[str, Any]:
        """The run's training steps (``rows``), its held-out stages (``held_out``) and its
        state (a page stops polling once it is not ``training``)."""
        run = run_or_404(name)
        rows = await asyncio.to_thread(run.metrics)
        stages = await asyncio.to_thread(run.stages)
        status = await asyncio.to_thread(run.status)
        return {"name": name, "rows": rows, "held_out": stages, "state": status["state"]}

    @app.get("/api/runs/{name}/count")
    async def api_count(request: Request, name: str) -> dict[str, Any]:
        run = run_or_404(name)
        store = await store_of(run)
        if store is None:
            return {"total": 0}
        filters, _ = queries.Filters.parse(dict(request.query_params))
        total, _rows = await asyncio.to_thread(queries.list_episodes, store, filters, 1, 1)
        return {"total": total}

    @app.on_event("shutdown")
    async def close() -> None:
        runs.close()

    return app


class _NoStore(Exception):
    """A page that needs episodes, of a run that has no store."""

    def __init__(self, run: Run) -> None:
        super().__init__(run.name)
        self.run = run


def _proximal(run: Run) -> str | None:
    """The run's ``loss.proximal`` from its config.yaml (``recompute``, the trainer's default,
    where the file leaves it out); None without a readable config."""
    cfg = run.config()
    if not cfg:
        return None
    loss = cfg.get("loss")
    value = loss.get("proximal") if isinstance(loss, dict) else None
    return str(value) if value else "recompute"


def _pct(value: Any) -> str:
    """A share as a percentage (``–`` when not recorded)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        return "–"
    return f"{100 * value:.1f}%"


def _summary(eps: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [e["reward"] for e in eps]
    wins = [e["success"] for e in eps if e["success"] is not None]
    return {
        "n": len(eps),
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "success": (sum(1 for w in wins if w), len(wins)),
        "episodes": eps,
    }


# ---------------------------------------------------------------------------- token tooltips
PROMPT_TOKEN = "from tools, the user or the template: no loss"


def _token_title(t: dict[str, Any], v: dict[str, Any]) -> str:
    """An output token's tooltip, as plain text (the template's autoescaping makes it one
    attribute, whatever the token's text holds): id, text, logprob, p = exp(logprob),
    version, importance weight and advantage (– where not recorded or not trained), then the
    trainer - server logprob and the clipping where there are."""
    lp = t["logprob"]
    parts = [
        f"id {t['id']}",
        _quoted(t["text"]),
        f"logprob {_fmt(lp, 4)}",
        f"p {_fmt(math.exp(min(lp, 0.0)) if lp is not None else None, 3)}",
        f"version {_fmt(t['version'])}",
        f"weight {_fmt(t['weight'], 3)}",
        f"advantage {_fmt(t['advantage'], 3)}" + ("" if v["record"] else " (not trained)"),
    ]
    if t["mismatch"] is not None:
        what = (
            "(proximal − sampled: the training-inference mismatch if the run recomputed it)"
            if v["proximal"] is None
            else "(same weights)"
        )
        parts.append(f"trainer − server logprob {_fmt(t['mismatch'], 4)} {what}")
    if t["clipped"]:
        parts.append("ratio clipped")
    if t["behaviour_clipped"]:
        parts.append("weight over cap")
    return " · ".join(parts)


# ---------------------------------------------------------------------------- token colours
def _by_logprob(t: dict[str, Any], v: dict[str, Any]) -> str:
    lp = t["logprob"]
    if lp is None:
        return "background:#eee"
    p = math.exp(max(-30.0, min(0.0, lp)))
    return f"background:hsl({round(120 * p)},75%,{round(82 - 8 * p)}%)"


def _by_weight(t: dict[str, Any], v: dict[str, Any]) -> str:
    w = t["weight"]
    if w is None:
        return "background:#eee;color:#777"
    x = max(-1.0, min(1.0, math.log2(w) if w > 0 else -1.0))
    hue = 215 if x < 0 else 28
    light = round(96 - 36 * abs(x))
    style = f"background:hsl({hue},85%,{light}%)"
    if t["clipped"]:
        style += ";outline:2px solid #c62828;outline-offset:-2px"
    if t["behaviour_clipped"]:
        style += ";text-decoration:line-through"
    return style


PALETTE = ["#c8e6c9", "#fff59d", "#ffcc80", "#ef9a9a", "#ce93d8"]


def _by_version(t: dict[str, Any], v: dict[str, Any]) -> str:
    ver = t["version"]
    if ver is None:
        return "background:#eee"
    ref = v["trained_version"]
    if ref is None:
        ref = max((x["version"] for x in v["output"] if x["version"] is not None), default=ver)
    lag = max(0, ref - ver)
    return f"background:{PALETTE[min(lag, len(PALETTE) - 1)]}"


COLOR_MODES = {
    "logprob": _by_logprob,
    "weight": _by_weight,
    "version": _by_version,
}
LEGENDS = {
    "logprob": {
        "title": "probability of the sampled token (exp logprob)",
        "gradient": "linear-gradient(90deg,hsl(0,75%,82%),hsl(60,75%,78%),hsl(120,75%,74%))",
        "labels": ["0", "0.5", "1"],
        "notes": ["grey: no logprob recorded"],
    },
    "weight": {
        "title": "behaviour importance weight w = π_prox / π_behav (log scale)",
        "gradient": "linear-gradient(90deg,hsl(215,85%,60%),hsl(215,85%,96%),hsl(28,85%,60%))",
        "labels": ["≤ 0.5", "1", "≥ 2"],
        "notes": [
            "red outline: the ratio π_θ / π_prox was clipped",
            "struck through: w over its cap (clipped or masked)",
            "grey: not trained (no trainer record)",
        ],
    },
    "version": {
        "title": "policy versions behind the version trained from (staleness)",
        "swatches": [(str(i) if i < 4 else "4+", c) for i, c in enumerate(PALETTE)],
        "notes": ["grey: no version recorded"],
    },
}
