"""What ``envkit serve`` adds to uvicorn against slow and idle clients: uvicorn closes idle keep-alive connections,
but a connection that sends half a request and stalls, or never sends at all, it keeps open forever.

- every request's headers and body must arrive within ``request_timeout_s`` of its first byte (or of the
  connection, for one that never sends): past it the server answers ``408 request_timeout`` and closes;
- at most ``max_connections`` connections (HTTP and WebSocket) are open at once: one more is answered ``503
  capacity`` and closed as soon as it is accepted, so stalled clients can never take the last file descriptor;
- :func:`descriptor_budget` checks at start that the process may open that many descriptors (raising the soft
  limit where the hard one allows) and lowers the cap, with a warning, where it may not.

WebSockets that hold no session, or a session but never send, are closed by the ``/ws`` endpoint itself.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from http import HTTPStatus
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from envkit.remote.protocol import ApiError

log = logging.getLogger("envkit.remote.server")

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
