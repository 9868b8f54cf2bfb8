"""The OpenAI-compatible proxy and what it records with.

- ``proxy``: the ``Proxy`` (in-process ``complete`` and the FastAPI app), split by idea into
  its route modules.
- ``responses``, ``schemas``: the Responses API and the request bodies.
- ``session``, ``store`` (+ ``store_migrations``): sessions and the durable episode store.
- ``chat``, ``toolcall``, ``context``: prompts to token ids, tool calls out of text, context
  that outgrows the window.
- ``server``: uvicorn on a thread, on the running loop, or in the foreground.

The proxy never imports torch: it renders prompts itself and hands token ids to an engine.
"""
