"""``areal-agent view``: a trajectory explorer and run dashboard in the browser.

:func:`create_app` builds the FastAPI app over run directories, eval outputs and episode
stores (:mod:`.sources`); :mod:`.queries` holds its reads of the store; :func:`import_run`
builds a store from an older run's ``episodes.jsonl``.
"""

from .app import create_app
from .importer import import_run
from .sources import Run, RunSet

__all__ = ["Run", "RunSet", "create_app", "import_run"]
