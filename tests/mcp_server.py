"""A tiny MCP server (the official SDK's MCPServer) for the MCP tests: `python mcp_server.py` speaks stdio,
`python mcp_server.py --http PORT` streamable HTTP at /mcp on 127.0.0.1 (with /health for the test's wait).

Tools: add(a, b); lookup(key) from a small table (an unknown key is the tool's error); sleep(seconds); count() (this
process's calls so far: per-session state); pid() (the tests check that closing ends the process); picture() (an
image, which a chat cannot carry).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

TABLE = {"capital:france": "Paris", "capital:japan": "Tokyo", "secret": "The secret number is 42."}

server = MCPServer("envkit-test", log_level="WARNING")
calls = 0


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """Look a key up in the table."""
    if key not in TABLE:
        raise ToolError(f"no entry for {key!r}; keys: {', '.join(TABLE)}")
    return TABLE[key]


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def count() -> int:
    """How many times this server process has been counted."""
    global calls
    calls += 1
    return calls


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def picture() -> ImageContent:
    """A 1-pixel image."""
    return ImageContent(type="image", data=base64.b64encode(b"GIF89a").decode(), mime_type="image/gif")


@server.custom_route("/health", methods=["GET"])
async def health(_: Request) -> Response:
    return JSONResponse({"status": "ok"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()
