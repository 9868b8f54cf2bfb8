"""An env's tools as an MCP server (``areal-agent mcp-serve --env ID``).

:func:`serve` serves an env's tools to an MCP client, so that an MCP-speaking agent can run,
and be scored, on our envs. One server process holds one env and one episode at a time:

- its tools are the episode's tools, with the env's own names, descriptions and JSON
  schemas; a call runs the env's implementation, bound to the episode's state (a tau2
  database, say), and returns its text (``isError`` when the tool reports an error);
- ``reset_task`` (``seed``, ``task_id`` or ``task_index``, all optional) starts a new
  episode and returns its task: the env's first messages (system prompt, question) as text
  and as structured content. The server starts with the episode of ``--seed``;
- ``submit_answer`` (``answer``) ends the episode: the env scores the conversation (the task,
  each tool call and result, the answer), as it scores an agent-driven episode, and returns
  ``reward`` and ``success``. Tool calls after it fail until the next ``reset_task``.

Per-session state is per process: over stdio each client starts its own server process
(its own env), which is what MCP clients do. Over streamable HTTP every client of one server
shares its one episode, so run one HTTP server per concurrent episode (or use stdio).
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import anyio

from areal_agents.envs.registry import make
from areal_agents.errors import ConfigError

__all__ = ["RESET_TOOL", "SUBMIT_TOOL", "EnvToolServer", "build_server", "serve"]

RESET_TOOL = "reset_task"
SUBMIT_TOOL = "submit_answer"

_RESET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "seed": {"type": "integer", "description": "Seed that picks the task."},
        "task_id": {"type": "string", "description": "The id of the task to start."},
        "task_index": {"type": "integer", "description": "The index of the task to start."},
    },
}
_SUBMIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "description": "The final answer."}},
    "required": ["answer"],
}


class EnvToolServer:
    """One env and its current episode, answering MCP ``tools/list`` and ``tools/call``.

    Args:
        env_id: The registered id of the env.
        env_kwargs: Keyword arguments of ``envs.make``.
        seed: The seed of the first episode's reset.

    Raises:
        ConfigError: the env cannot be made or reset, or one of its tools is named like
            ``reset_task`` / ``submit_answer``.
    """

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any] | None = None, *, seed: int = 0):
        self.env_id = env_id
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the MCP wire
            try:
                self.env = make(env_id, **dict(env_kwargs or {}))
            except TypeError as exc:
                raise ConfigError(f"--env-kwargs: {env_id} does not take them: {exc}") from None
        self.messages: list[dict[str, Any]] = []
        self.active = False
        self._next_seed = seed + 1  # what reset_task without arguments starts
        self.reset(seed=seed)

    # ------------------------------------------------------------------ episode

    def reset(
        self, seed: int | None = None, task_id: str | None = None, task_index: int | None = None
    ) -> dict[str, Any]:
        """Start an episode; returns its task (messages, task id, tool names)."""
        options: dict[str, Any] = {}
        if task_id is not None:
            options["task_id"] = task_id
        if task_index is not None:
            options["task_index"] = task_index
        with contextlib.redirect_stdout(sys.stderr):
            try:
                obs, info = self.env.reset(seed=seed, options=options or None)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"{self.env_id}: reset failed: {type(exc).__name__}: {exc}"
                ) from None
        names = [t.name for t in self.env.tools()]
        clash = sorted({RESET_TOOL, SUBMIT_TOOL} & set(names))
        if clash:
            raise ConfigError(
                f"{self.env_id} has tool(s) named {clash}, which mcp-serve uses for its own "
                "episode control; rename them in the env"
            )
        self.messages = [dict(m) for m in obs]
        self.active = True
        return {"task_id": info.get("task_id"), "messages": self.messages, "tools": names}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """``(name, description, input schema)`` of every served tool, as dicts."""
        own = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in self.env.tools()
        ]
        return [
            *own,
            {
                "name": RESET_TOOL,
                "description": "Start a new episode (a new task) of the env and return its "
                "task; without arguments, the next seed's task.",
                "input_schema": _RESET_SCHEMA,
            },
            {
                "name": SUBMIT_TOOL,
                "description": "Submit the final answer: the env scores the episode and "
                "returns its reward. Call reset_task to start another.",
                "input_schema": _SUBMIT_SCHEMA,
            },
        ]

    def call(self, name: str, arguments: Mapping[str, Any] | None) -> tuple[str, Any, bool]:
        """Run one served tool: (text, structured content or None, is_error). Blocking."""
        arguments = dict(arguments or {})
        if name == RESET_TOOL:
            return self._reset_call(arguments)
        if name == SUBMIT_TOOL:
            return self._submit(arguments)
        tools = {t.name: t for t in self.env.tools()}
        if name not in tools:
            available = ", ".join([*sorted(tools), RESET_TOOL, SUBMIT_TOOL])
            return f"Error: unknown tool {name!r}; available tools: {available}", None, True
        if not self.active:
            return f"Error: the episode has ended; call {RESET_TOOL} to start one", None, True
        with contextlib.redirect_stdout(sys.stderr):
            result = tools[name].call(arguments)
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        self.messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                ],
            }
        )
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result.content})
        return result.content, None, not result.ok

    def _reset_call(self, arguments: dict[str, Any]) -> tuple[str, Any, bool]:
        unknown = sorted(set(arguments) - set(_RESET_SCHEMA["properties"]))
        if unknown:
            return (
                f"Error: unknown argument(s) {unknown}; expected seed, task_id or task_index",
                None,
                True,
            )
        seed = arguments.get("seed")
        if seed is None and "task_id" not in arguments and "task_index" not in arguments:
            seed, self._next_seed = self._next_seed, self._next_seed + 1
        try:
            task = self.reset(seed, arguments.get("task_id"), arguments.get("task_index"))
        except ConfigError as exc:
            return f"Error: {exc}", None, True
        text = "\n\n".join(
            f"[{m.get('role')}] {m.get('content')}" for m in task["messages"] if m.get("content")
        )
        return text, task, False

    def _submit(self, arguments: dict[str, Any]) -> tuple[str, Any, bool]:
        answer = arguments.get("answer")
        if not isinstance(answer, str) or set(arguments) != {"answer"}:
            return "Error: expected one argument, answer (a string)", None, True
        if not self.active:
            return f"Error: the episode has ended; call {RESET_TOOL} to start one", None, True
        self.messages.append({"role": "assistant", "content": answer})
        self.active = False
        try:
            with contextlib.redirect_stdout(sys.stderr):
                reward, info = self.env.score(list(self.messages))
        except NotImplementedError:
            return f"Error: {self.env_id} does not score answers (no score())", None, True
        except Exception as exc:
            return f"Error: scoring failed: {type(exc).__name__}: {exc}", None, True
        out = {
            "reward": float(reward),
            "success": info.get("success"),
            "info": json.loads(json.dumps(info, default=str)),
        }
        return f"reward: {out['reward']:g}, success: {out['success']}", out, False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.env.close()


def _plain(text: str) -> str:
    """An error's text without our ``Error:`` prefix: MCP marks errors with ``isError``."""
    return text.removeprefix("Error: ")


def build_server(state: EnvToolServer) -> Any:
    """The MCP (low-level) ``Server`` answering for ``state``."""
    import mcp_types as types  # noqa: PLC0415  mcp is an optional extra (areal-agents[mcp])
    from mcp.server.lowlevel import Server  # noqa: PLC0415  mcp is an optional extra, loaded here

    lock = anyio.Lock()  # one episode: its tool calls run one at a time, in order

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t["name"], description=t["description"], input_schema=t["input_schema"]
                )
                for t in state.tool_schemas()
            ]
        )

    async def call_tool(ctx: Any, params: Any) -> Any:
        async with lock:
            text, structured, is_error = await anyio.to_thread.run_sync(
                state.call, params.name, params.arguments
            )
        if is_error:
            text = _plain(text)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=structured,
            is_error=is_error,
        )

    return Server(
        f"areal {state.env_id}",
        instructions=f"Tools of the areal env {state.env_id}. Call {RESET_TOOL} to start a "
        f"task, the env's tools to work on it, and {SUBMIT_TOOL} to have the answer scored.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def serve(
    env_id: str,
    env_kwargs: Mapping[str, Any] | None = None,
    *,
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8000,
    seed: int = 0,
) -> None:
    """Serve ``env_id``'s tools over MCP until the client goes (stdio) or the process is
    stopped (HTTP, at ``http://HOST:PORT/mcp``). See the module docstring."""
    if transport not in ("stdio", "http"):
        raise ConfigError(f"--transport: expected stdio or http, got {transport!r}")
    try:
        import mcp  # noqa: F401, PLC0415  mcp is an optional extra, checked before serving
        from mcp.server.lowlevel import Server  # noqa: F401, PLC0415  the 2.x API of that extra
    except ImportError as exc:
        raise ConfigError(
            f"mcp-serve needs the mcp package, 2.x ({exc}); install it with "
            "pip install 'areal-agents[mcp]'"
        ) from None
    state = EnvToolServer(env_id, env_kwargs, seed=seed)
    server = build_server(state)
    try:
        if transport == "stdio":
            from mcp.server.stdio import stdio_server  # noqa: PLC0415  mcp is an optional extra

            async def run_stdio() -> None:
                async with stdio_server() as (read, write):
                    await server.run(read, write, server.create_initialization_options())

            anyio.run(run_stdio)
        else:
            import uvicorn  # noqa: PLC0415  uvicorn loads only for the HTTP transport

            app = server.streamable_http_app(host=host)
            uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        state.close()
