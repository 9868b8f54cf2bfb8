"""``areal-agent view``: a trajectory explorer and run dashboard in the browser.

:func:`create_app` builds the FastAPI app over run directories, eval outputs and episode
stores (:mod:`.sources`); :mod:`.queries` holds its reads of the store; :func:`import_run`
builds a store from an older run's ``episodes.jsonl``.
"""

from areal_agents.view.app import create_app
from areal_agents.view.importer import import_run
from areal_agents.view.sources import Run, RunSet

__all__ = ["Run", "RunSet", "create_app", "import_run"]
