"""Producing episodes: the runner, task agents, the worker hub, Ray, evaluation.

- ``runner``: runs episodes (env-driven or agent-driven) through proxy sessions.
- ``task_agent``: ``"pkg.module:factory"`` to an agent.
- ``workers``: the ``/workers/tasks`` hub that external agents pull from.
- ``cluster``, ``ray_runner``: engine replicas and episode runners as Ray actors.
- ``evaluate``: held-out success over an env's tasks.
"""
