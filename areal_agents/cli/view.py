"""``areal-agent view``: browse runs, episodes and tokens in the browser (a local web server),
or import an older run's episodes into its episode store (``--import``)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import webbrowser
from pathlib import Path

import uvicorn

from areal_agents.errors import ConfigError
from areal_agents.view import RunSet, create_app, import_run

__all__ = ["view_command"]


def view_command(args: argparse.Namespace) -> int:
    """Serve the viewer on ``--host``:``--port`` (after ``--import``, if given) until stopped."""
    if args.import_dir:
        counts = import_run(args.import_dir)
        print(
            f"imported {counts['imported']} episodes into {Path(args.import_dir) / 'episodes.db'}"
            f" ({counts['skipped']} already there, {counts['bad_lines']} unreadable lines)"
        )
        if not args.sources:
            return 0
    sources = args.sources or (["runs"] if Path("runs").is_dir() else [])
    if not sources:
        raise ConfigError(
            "areal-agent view: name a run directory (e.g. runs/quickstart), a directory of "
            "runs or an episode store; there is no runs/ here"
        )
    runs = RunSet(sources)
    token = args.token
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not token:
        token = secrets.token_urlsafe(18)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown_host}:{args.port}/" + (f"?token={token}" if token else "")
    app = create_app(runs, token=token)
    names = ", ".join(r.name for r in runs.runs()) or "none yet"
    print(f"view: {url}", flush=True)
    print(f"runs: {names}", flush=True)
    if not args.no_browser and (os.environ.get("DISPLAY") or sys.platform == "darwin"):
        webbrowser.open(url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
