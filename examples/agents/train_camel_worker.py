"""A CAMEL-AI ChatAgent, in a venv of its own, trained as external workers of
``areal-agent train`` on areal/Calculator-v0.

The trainer serves the proxy and the worker API; each worker process pulls a task, builds a
``ChatAgent`` whose model is the task's proxy session and whose tools are the env's tools
(they run in the trainer, next to the env), steps it once on the question and posts the
answer; the env scores it and the trainer trains on what the session recorded. CAMEL and
torch do not share a venv, so the workers run from CAMEL's::

    requirements/make_venv.sh camel .venv-camel
    .venv/bin/areal-agent train --config examples/agents/train_camel_worker.yaml
    # it prints the worker API's URL; the token is in runs/camel-worker/workers.json
    .venv-camel/bin/areal-agent worker --connect URL --token TOKEN --concurrency 4 \\
        --agent examples/agents/train_camel_worker.py:make_agent

Start two or more workers (here or on other machines, with ``workers.host: 0.0.0.0``);
they wait while the trainer's staleness gate is full and go on after a ``--resume``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx


class CamelSolver:
    """The worker's agent: one CAMEL ``ChatAgent`` per task (``areal_agents.client.WorkerTask``)."""

    def __init__(
        self, temperature: float = 1.0, max_tokens: int = 64, log: str | None = None
    ) -> None:
        self.settings = {"temperature": temperature, "max_tokens": max_tokens}
        self.log = log
        self._lock = threading.Lock()

    def __call__(self, task: Any) -> str | None:
        from camel.agents import ChatAgent

        from areal_agents.integrations.camel import as_function_tools, session_model

        system = [m["content"] for m in task.messages if m["role"] == "system"]
        agent = ChatAgent(
            "\n\n".join(system) or None,
            model=session_model(task.base_url, task.api_key, model_config_dict=self.settings),
            tools=as_function_tools(task.tools),
            max_iteration=3,
        )
        try:
            response = agent.step(task.messages[-1]["content"])
            answer = response.msgs[0].content if response.msgs else None
        finally:
            self._record(task)
        return answer

    def _record(self, task: Any) -> None:
        """Append what the session recorded (its completion ids) to ``log``, for audits."""
        if not self.log:
            return
        url = task.base_url.removesuffix("/v1") + f"/sessions/{task.session_id}/trajectory"
        auth = {"Authorization": f"Bearer {task.api_key}"}
        traj = httpx.get(url, headers=auth, timeout=30).raise_for_status().json()
        row = {
            "task": task.id,
            "session": task.session_id,
            "group": task.group_id,
            "completions": [c["id"] for c in traj["completions"]],
        }
        with self._lock, open(self.log, "a") as f:
            f.write(json.dumps(row) + "\n")


def make_agent(**kwargs: Any) -> CamelSolver:
    """The factory ``areal-agent worker --agent`` names (``--agent-kwargs`` are its kwargs)."""
    return CamelSolver(**kwargs)
