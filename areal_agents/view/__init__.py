"""``areal-agent view``: a trajectory explorer and run dashboard in the browser.

:func:`create_app` builds the FastAPI app over run directories, eval outputs and episode
stores (:mod:`.sources`); :mod:`.queries` holds its reads of the store; :func:`import_run`
builds a store from an older run's ``episodes.jsonl``.

The names are imported when first used, so that reading runs (``areal-agent runs``,
``status``: :mod:`.sources` only) does not load the web framework.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_agents.view.app import create_app
    from areal_agents.view.importer import import_run
    from areal_agents.view.sources import Run, RunSet

__all__ = ["Run", "RunSet", "create_app", "import_run"]

_HOMES = {
    "create_app": "areal_agents.view.app",
    "import_run": "areal_agents.view.importer",
    "Run": "areal_agents.view.sources",
    "RunSet": "areal_agents.view.sources",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
