"""The OpenAI-compatible proxy and what it records with.

- ``proxy``: the ``Proxy``, built in layers: ``generation`` (prompt to token ids, sampling
  defaults, the engine call, the recorded completion), ``fitting`` (the context policy),
  ``core`` (``complete``, recording, sessions, store sync), ``routes`` (the FastAPI app).
- ``bodies``, ``api_error``, ``schemas``, ``openapi``, ``sse``: request hardening, the
  OpenAI error format, request models, the OpenAPI document, server-sent events.
- ``responses``: the Responses API.
- ``session``; ``store`` with ``store_schema``, ``store_rows``, ``store_writer`` and
  ``store_migrations``: sessions and the durable episode store.
- ``chat`` with ``chat_template`` and ``chat_messages``, ``toolcall``, ``context``: prompts
  to token ids, tool calls out of text, context that outgrows the window.
- ``server``: uvicorn on a thread, on the running loop, or in the foreground.

The proxy never imports torch: it renders prompts itself and hands token ids to an engine.
"""
