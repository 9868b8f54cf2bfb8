"""The ``areal-agent`` command: ``train``, ``eval``, ``serve``, ``view``, ``worker``,
``demos``, ``envs``, ``mcp-serve``. The top floor: it may import every other room."""
