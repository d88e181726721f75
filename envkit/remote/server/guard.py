"""What ``envkit serve`` adds to uvicorn against slow and idle clients: uvicorn closes idle keep-alive connections,
but a connection that sends half a request and stalls, or never sends at all, it keeps open forever.

- every request's headers and body must arrive within ``request_timeout_s`` of its first byte (or of the
  connection, for one that never sends): past it the server answers ``408 request_timeout`` and closes;
- at most ``max_connections`` connections (HTTP and WebSocket) are open at once: one more is answered ``503
  capacity`` and closed as soon as it is accepted, so stalled clients can never take the last file descriptor;
- :func:`descriptor_budget` checks at start that the process may open that many descriptors (raising the soft
  limit where the hard one allows) and lowers the cap, with a warning, where it may not.

WebSockets that hold no session, or a session but never send, are closed by the ``/ws`` endpoint itself.

Past uvicorn, :class:`Guard` is the ASGI middleware in front of FastAPI: the bearer token, the body limit, and the
two hot paths it answers itself, ``/ws`` and a plain ``POST /sessions/{id}/step``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import resource
from http import HTTPStatus
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import envkit.agents.untrusted as untrusted
from envkit.remote import TOKEN_ENV
from envkit.remote.protocol import ApiError
from envkit.remote.server.asgi import ASGIApp, Message, Receive, Scope, Send
from envkit.remote.server.openenv import PREFIX as OPENENV_PREFIX
from envkit.remote.server.openenv import OpenEnvSession
from envkit.remote.server.sessions import EnvServer, plain_step_action
from envkit.remote.server.ws import WsEndpoint

log = logging.getLogger(__name__)

_REST_STEP = frozenset({"action"})
FILES_PATH = "/exec/files"

_DESCRIPTORS_PER_SESSION = 1
_DESCRIPTORS_OWN = 64  # the listening socket, logs, the interpreter's own files, a worker's pipes


def _answer_and_close(transport: asyncio.Transport, err: ApiError) -> None:
    body = err.encoded()
    head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if err.code == "capacity":
        head += "retry-after: 1\r\n"
    transport.write(head.encode() + b"\r\n" + body)
    transport.close()


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read deadline per request and a cap on open connections."""

    request_timeout_s: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 4096

    _deadline: asyncio.TimerHandle | None = None

    @classmethod
    def configure(cls, *, request_timeout_s: float, max_connections: int) -> None:
        """Set the deadline and the cap for every connection this process serves from now on."""
        cls.request_timeout_s, cls.max_connections = request_timeout_s, max_connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _answer_and_close(transport, ApiError("capacity", f"the server holds its limit of {self.max_connections} "
                                                              "open connections (ServerLimits.max_connections); "
                                                              "retry later"))
            return
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        _answer_and_close(self.transport, ApiError("request_timeout", "the request did not arrive within "
                                                                      f"{self.request_timeout_s:g} s "
                                                                      "(ServerLimits.request_timeout_s)"))


def descriptor_budget(max_connections: int, max_sessions: int) -> int:
    """How many connections this process can hold: ``max_connections``, or fewer (with a warning) when the
    descriptor limit is lower than that plus one per session and the server's own, after raising the soft limit
    as far as the hard one allows."""
    need = max_connections + max_sessions * _DESCRIPTORS_PER_SESSION + _DESCRIPTORS_OWN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    room = soft - max_sessions * _DESCRIPTORS_PER_SESSION - _DESCRIPTORS_OWN
    if room < 1:
        raise ValueError(f"the descriptor limit ({soft}, `ulimit -n`) leaves no room for connections next to "
                         f"{max_sessions} sessions: raise it or lower --max-sessions")
    log.warning("the descriptor limit is %d (`ulimit -n`; the hard limit allows no more): serving at most %d "
                "connections instead of %d", soft, room, max_connections)
    return room


# ---- ASGI middleware: auth and body size, before FastAPI parses anything ---------------------------------------


def _declared_length_over(scope: Scope, max_bytes: int) -> bool:
    """Whether the request's ``content-length`` header declares a body of more than ``max_bytes``."""
    return any(name == b"content-length" and value.isdigit() and int(value) > max_bytes
               for name, value in scope["headers"])


async def _send_json(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class Guard:
    """Bearer-token check (all routes but /health) and the request body limit, as plain ASGI middleware.

    It also answers ``/ws`` itself, ahead of FastAPI's routing and exception middleware: a WebSocket session's
    task resumes through every ASGI layer above its handler once per frame, and those layers cost about a tenth of
    the server's CPU per step of a fast env.
    """

    def __init__(self, app: ASGIApp, *, server: EnvServer, token: str | None, files: bool = False) -> None:
        self.app = app
        self.server = server
        self.ws = WsEndpoint(server)
        self.openenv_ws = WsEndpoint(server, OpenEnvSession)
        self.token = token.encode() if token else None
        self.max_bytes = server.limits.max_request_bytes
        self.files = files
        """Whether the app serves ``/exec/files``, whose body (a sandbox's files) may be up to ARCHIVE_LIMIT."""
        self.too_large = ApiError("payload_too_large", f"request body over {self.max_bytes} bytes "
                                                       "(ServerLimits.max_request_bytes)")
        self.files_too_large = ApiError("payload_too_large", f"a files archive over {untrusted.ARCHIVE_LIMIT} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.token is not None and scope["path"] != "/health" and not self._authorized(scope):
            err = ApiError("unauthorized", "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                           f"(the token given to envkit serve via --token or {TOKEN_ENV})")
            self.server.metrics.errors[err.code] += 1
            if scope["type"] == "websocket":
                return await self._deny_websocket(scope, send, err)
            return await _send_json(send, err.status, err.encoded(), [(b"www-authenticate", b"Bearer")])
        if scope["type"] == "http":
            return await self._limit_body(scope, receive, send)
        if scope["path"] == "/ws":
            return await self.ws(scope, receive, send)
        if scope["path"] == OPENENV_PREFIX + "/ws":
            return await self.openenv_ws(scope, receive, send)
        return await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token or b"")
        return False

    @staticmethod
    async def _deny_websocket(scope: Scope, send: Send, err: ApiError) -> None:
        if "websocket.http.response" in scope.get("extensions", {}):
            payload = err.encoded()
            await send({"type": "websocket.http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": payload})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": err.code})

    async def _limit_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large, max_bytes = self.too_large, self.max_bytes
        if self.files and scope["path"] == FILES_PATH:  # a sandbox's files from a snapshot: a limit of their own
            too_large, max_bytes = self.files_too_large, untrusted.ARCHIVE_LIMIT
        if _declared_length_over(scope, max_bytes):
            self.server.metrics.errors[too_large.code] += 1
            return await _send_json(send, too_large.status, too_large.encoded())
        # Read the whole body first (bodies are small): a chunked upload cannot slip past the limit.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                self.server.metrics.errors[too_large.code] += 1
                return await _send_json(send, too_large.status, too_large.encoded())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        if scope["method"] == "POST" and await self._fast_step(scope, body, send):
            return

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _fast_step(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Answer ``POST /sessions/{id}/step`` with a plain text action past FastAPI's routing and validation
        (about two thirds of the server's CPU per REST step of a fast env); False leaves the request to FastAPI."""
        path: str = scope["path"]
        session_id = path[len("/sessions/"):-len("/step")]
        if not path.startswith("/sessions/") or not path.endswith("/step") or not session_id or "/" in session_id:
            return False
        if not any(name == b"content-type" and b"json" in value for name, value in scope["headers"]):
            return False
        action = plain_step_action(body, _REST_STEP)
        if action is None:
            return False
        await _send_json(send, *await self.server.answer("step", "rest", self.server.step(session_id, action)))
        return True
