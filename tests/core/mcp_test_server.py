"""A small MCP server for tests/core/test_mcp.py, written with the mcp package (2.x).

Run as ``python mcp_test_server.py [stdio|http PORT]``. Its tools cover what the client
must handle: text results, structured results, a reported error (``isError``), a call that
outlasts its time limit, a crash of the server process, and a counter that shows whether two
calls reached the same server process.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("areal-test-tools", log_level="WARNING")
_calls = {"n": 0}


@server.tool()
def add(a: int, b: int = 1) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def lookup(city: str) -> dict[str, object]:
    """Facts about a city, as structured content."""
    return {"city": city, "population": len(city) * 1000}


@server.tool()
def fail(reason: str) -> str:
    """Always reports an error."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def slow(seconds: float) -> str:
    """Sleeps, then answers."""
    time.sleep(seconds)
    return "done"


@server.tool()
def crash() -> str:
    """Ends the server process at once."""
    os._exit(3)


@server.tool()
def counter() -> str:
    """How many times this server process was called here, and its pid."""
    _calls["n"] += 1
    return f"{_calls['n']} {os.getpid()}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
