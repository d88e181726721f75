"""``envkit serve --mcp``: the served env's tools as an MCP server, streamable HTTP at ``/mcp``, on the MCP SDK's
server side, behind the server's bearer token, body limit and connection guard like every other route.

Stateless by design: each ``tools/call`` runs in an env instance of its own, made and initialised for that call and
closed after it. It is a session of the server's, so ``--max-sessions`` and ``--step-timeout`` hold and
``/metrics`` counts it (``sessions_closed{reason="mcp"}``, latency under ``tool_call``/``mcp``). No episode is
started: the tools must work without one, as a ToolEnv's tool methods normally do. That is what the 2026-07-28
protocol (which has no sessions) expects of a server, it works with ``--workers N``, and one client's calls never
see another's state. Tools that keep state from call to call (a shell whose files persist) need an episode: serve
those over the session protocol (``envkit.make("ws://HOST:PORT/NAME")``) instead.

``tools/list`` is the env's tools, their OpenAI parameter schemas as input schemas. A tool's failure (an unknown tool,
bad arguments, the tool raised) is a result flagged ``isError`` carrying the message a model would read; a failure of
the server or the env itself (capacity, an env that raises in ``init`` or outlives the step timeout) is a JSON-RPC
error.
"""

from __future__ import annotations

from typing import Any

from mcp import types
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

import envkit
from envkit.remote.protocol import ApiError
from envkit.remote.server.sessions import EnvServer

MCP_PATH = "/mcp"


def mcp_endpoint(server: EnvServer, *, loopback: bool) -> tuple[StreamableHTTPASGIApp, StreamableHTTPSessionManager]:
    """The ASGI endpoint of ``/mcp`` for ``server``'s env, and the session manager to run in the app's lifespan.

    ``loopback``: the server binds a loopback address, so requests must name a loopback host and origin (the MCP
    SDK's guard against DNS rebinding, which a browser on this machine could otherwise use to reach the tools).
    """
    if not server.is_tool_env:
        raise ValueError(f"--mcp serves the tools of a ToolEnv one call at a time; {server.env_name!r} runs its tools "
                         "inside step() (serve it without --mcp and use its sessions)")
    schemas = {t["function"]["name"]: t["function"] for t in server.info["tools"]}
    tools = [types.Tool(name=name, description=f.get("description") or None, input_schema=f.get("parameters") or
                        {"type": "object", "properties": {}}) for name, f in schemas.items()]

    async def list_tools(_: ServerRequestContext[Any],
                         __: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(_: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            text, failed = await server.run_tool(params.name, dict(params.arguments or {}))
        except ApiError as e:
            raise MCPError(types.INTERNAL_ERROR, f"{e.code}: {e.message}") from e
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=failed)

    app: Server[Any] = Server(f"envkit serve {server.env_name}", version=envkit.__version__,
                              description=server.info["description"] or None,
                              get_tool_input_schema=lambda name: schemas.get(name, {}).get("parameters"),
                              on_list_tools=list_tools, on_call_tool=call_tool)
    security = TransportSecuritySettings(
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
    ) if loopback else None
    # One JSON answer per request: nothing streams, and no session outlives its request.
    manager = StreamableHTTPSessionManager(app, stateless=True, json_response=True, security_settings=security,
                                           max_request_body_size=server.limits.max_request_bytes)
    return StreamableHTTPASGIApp(manager), manager
