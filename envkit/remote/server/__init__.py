"""``envkit serve``: any registered env behind a FastAPI server, one isolated env instance per session.

The routes and bodies are in :mod:`envkit.remote.protocol`; :class:`envkit.remote.RemoteEnv` is the client. What the
server guarantees:

- isolation: each session owns its env instance; requests on one session run one at a time;
- containment: an env that raises answers ``500 env_error``, one that hangs past ``step_timeout_s`` answers
  ``504 env_timeout``; either way only that episode ends (reset to go on) and the other sessions never notice;
- limits: ``max_sessions`` (``503 capacity``), ``max_request_bytes`` (``413``), an idle TTL after which the
  reaper closes the env, and a bearer token on every route but ``/health``;
- every error is ``{"error": {"code", "message", "status"}}`` with a 4xx status for client mistakes;
- shutdown (SIGINT/SIGTERM) closes every env.

Envs run in the server's event loop (they are async): an env that blocks the loop with synchronous work stalls
every session, so CPU-heavy envs should offload to threads themselves, or the server runs ``--workers N``.

The modules, by concern: :mod:`.config` (what ``envkit serve`` takes), :mod:`.sessions` (the sessions and their
envs), :mod:`.app` (the FastAPI app: routes and error handlers), :mod:`.guard` (the connection guard and the ASGI
middleware: token, body limit, hot paths), :mod:`.ws` (the WebSocket endpoint), :mod:`.metrics` (``/metrics``),
:mod:`.workers` (session slots shared by ``--workers N``), :mod:`.run` (``serve``: uvicorn, workers, logging),
:mod:`.mcp` (``--mcp``: the env's tools as an MCP server at ``/mcp``, one env per tool call; the ``mcp`` extra).
"""

from envkit.remote.server.app import create_app
from envkit.remote.server.config import ServeConfig, ServerLimits
from envkit.remote.server.run import RedactSecrets, is_loopback, serve
from envkit.remote.server.sessions import EnvServer

__all__ = ["EnvServer", "RedactSecrets", "ServeConfig", "ServerLimits", "create_app", "is_loopback", "serve"]
