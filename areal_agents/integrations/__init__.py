"""Existing agent frameworks, pointed at the recording proxy without changing the agent.

Each submodule adapts one framework and imports it only inside its functions, so importing
``areal_agents`` (or this package) never needs the framework installed; this package imports
neither submodule, so using one never loads the other (a worker that runs an Agents SDK agent
loads no chat tokenizer):

- :mod:`areal_agents.integrations.openai_agents`: the OpenAI Agents SDK (``openai-agents``):
  :func:`~areal_agents.integrations.openai_agents.session_model`,
  :func:`~areal_agents.integrations.openai_agents.as_function_tools`,
  :func:`~areal_agents.integrations.openai_agents.run_agent`.
- :mod:`areal_agents.integrations.camel`: CAMEL-AI (``camel-ai``):
  :func:`~areal_agents.integrations.camel.session_model`,
  :func:`~areal_agents.integrations.camel.as_function_tools`,
  :class:`~areal_agents.integrations.camel.OfflineTokenCounter`.

The two frameworks pin incompatible pydantic versions, so each runs in its own virtual
environment (``requirements/make_venv.sh NAME DIR`` builds one from
``requirements/NAME.txt``).
"""
