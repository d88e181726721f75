"""A lockstep HTTP/1.1 client: one keep-alive connection, one request at a time, on httptools' response parser.

A REST env session sends one request and waits for its answer before the next. httpx serves the general case
(connection pools, redirects, streaming, HTTP/2, a timer per wait) and spends about a millisecond of CPU on each of
these small requests, several times what the env server spends answering them. This writes the request line and
headers itself, parses answers with httptools (llhttp, the parser uvicorn serves with), and times answers out with
:class:`~envkit.remote.deadlines.Deadlines` (:mod:`envkit.remote.lockstep`), as :mod:`envkit.remote.wsclient` does for
WebSockets.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools

from envkit.remote.lockstep import LockstepConnection, read_buffer


def _header_block(headers: dict[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if not name.isascii() or not name.replace("-", "").isalnum():
            raise ValueError(f"invalid HTTP header name {name!r}")
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
            raise ValueError(f"the value of HTTP header {name!r} holds a control character")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


class HttpClosedError(ConnectionError):
    """The connection closed (or was closed) before the whole answer came."""


class HttpConnection(LockstepConnection[tuple[int, bytes]]):
    """One client connection to ``http(s)://host:port`` on which requests and answers alternate; open it with
    :meth:`connect`. Every request carries ``headers`` (fixed for the connection's life)."""

    closed_error = HttpClosedError

    def __init__(self, origin: str, headers: dict[str, str]) -> None:
        super().__init__(origin)
        self.origin = origin
        self._head_tail = f"host: {urlsplit(origin).netloc}\r\n".encode() + _header_block(headers)
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._keep_alive = True

    @classmethod
    async def connect(cls, origin: str, *, headers: dict[str, str] | None = None, timeout_s: float = 5.0
                      ) -> HttpConnection:
        """Open the TCP (or TLS) connection to ``origin`` (``http(s)://host[:port]``) within ``timeout_s``.

        A refused or slow connection raises ``OSError`` or ``TimeoutError``; a malformed origin or header
        ``ValueError``.
        """
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an HTTP origin looks like http://host:port, got {origin!r}")
        if parts.username is not None:
            raise ValueError(f"{origin!r}: credentials in the URL are not supported; send a token in the headers")
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        loop = asyncio.get_running_loop()
        conn = cls(origin, dict(headers or {}))
        async with asyncio.timeout(timeout_s):
            await loop.create_connection(lambda: conn, parts.hostname, port,
                                         ssl=ssl.create_default_context() if secure else None)
        return conn

    @property
    def closed(self) -> bool:
        """True once no further request can be sent on this connection."""
        return super().closed or not self._keep_alive

    async def request(self, method: str, target: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        """Send one request (``target`` is the path and query) and return the answer's status and body.

        Raises TimeoutError after ``timeout_s`` and HttpClosedError if the connection ends first (or the answer is
        not HTTP). Either way, and on cancellation, the connection is closed, since a late answer would otherwise
        be read as the next one's.
        """
        head = f"{method} {target} HTTP/1.1\r\ncontent-length: {len(body) if body else 0}\r\n".encode()
        request = head + self._head_tail + b"\r\n" + body if body else head + self._head_tail + b"\r\n"
        try:
            return await self._exchange(lambda transport: transport.write(request), timeout_s)
        finally:
            if not self._keep_alive and self._transport is not None:
                self._transport.close()

    # ---- asyncio.BufferedProtocol ----------------------------------------------------------------------------

    def buffer_updated(self, nbytes: int) -> None:
        if not self._awaiting:  # not even part of an answer may come unasked: it would be read as the next one's
            return self._unsolicited()
        try:
            self._parser.feed_data(bytes(read_buffer()[:nbytes]))
        except httptools.HttpParserError as e:
            self._fail(HttpClosedError(f"{self.origin} answered something that is not HTTP/1.1: {e}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    # ---- httptools callbacks ---------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._body.clear()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._deliver((self._parser.get_status_code(), body))
