"""A lockstep WebSocket client: send one frame, await one answer, on websockets' sans-I/O protocol.

An env session has one request in flight at a time. websockets' asyncio client is built for the general case
(concurrent senders, streamed fragments, keepalive, a timer per wait), which costs a remote step more CPU than the
env server spends on it. This drives the same protocol object (handshake, framing, masking, pings, closing) straight
from an asyncio transport, with what it shares with :mod:`envkit.remote.httpclient` in
:mod:`envkit.remote.lockstep`.
"""

from __future__ import annotations

import asyncio
import ssl

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidURI
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from envkit.remote.lockstep import LockstepConnection, read_buffer

_DATA = (Opcode.TEXT, Opcode.BINARY)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class WsClosedError(ConnectionError):
    """The connection closed (or was closed) before the answer came."""


class WsConnection(LockstepConnection[bytes]):
    """One client WebSocket on which requests and answers alternate; open it with :meth:`connect`."""

    closed_error = WsClosedError

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        super().__init__(url)
        self.url = url
        self._ws = ClientProtocol(parse_uri(url), max_size=None)
        self._headers = headers
        self._opened: asyncio.Future[None] = self._loop.create_future()
        self._opened.add_done_callback(_retrieve)  # a handshake abandoned by connect() must not log its error
        self._parts: list[bytes] = []

    @classmethod
    async def connect(cls, url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 5.0
                      ) -> WsConnection:
        """Open the TCP (or TLS) connection and complete the handshake within ``timeout_s``.

        A refused handshake raises websockets' ``InvalidStatus`` (its ``response`` carries the server's status and
        body), a refused or slow connection ``OSError`` or ``TimeoutError``.
        """
        uri = parse_uri(url)
        if uri.username is not None:
            raise InvalidURI(url, "credentials in the URL are not supported; send a token in the headers")
        loop = asyncio.get_running_loop()
        tls = ssl.create_default_context() if uri.secure else None
        async with asyncio.timeout(timeout_s):
            _, conn = await loop.create_connection(lambda: cls(url, dict(headers or {})), uri.host, uri.port, ssl=tls)
            try:
                await conn._opened
            except BaseException:
                conn.abort()
                raise
        return conn

    @property
    def closed(self) -> bool:
        """True once no further answer can arrive."""
        return self._ws.state is not State.OPEN or super().closed

    async def request(self, text: str | bytes, timeout_s: float) -> bytes:
        """Send ``text`` (str or UTF-8 bytes) as one text frame and return the next data message.

        Raises TimeoutError after ``timeout_s`` and WsClosedError if the connection ends first. Either way, and on
        cancellation, the connection is closed, since a late answer would otherwise be read as the next one's.
        """
        def send(_: asyncio.Transport) -> None:
            self._ws.send_text(text.encode() if isinstance(text, str) else text)
            self._flush()

        return await self._exchange(send, timeout_s)

    def send(self, text: str) -> None:
        """Send ``text`` as one frame that gets no answer (a goodbye, say)."""
        if self.closed:
            raise WsClosedError(f"the WebSocket to {self.url} is closed{self._why_closed}")
        self._ws.send_text(text.encode())
        self._flush()

    # ---- asyncio.BufferedProtocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        request = self._ws.connect()
        for name, value in self._headers.items():
            request.headers[name] = value
        self._ws.send_request(request)
        self._flush()

    def buffer_updated(self, nbytes: int) -> None:
        self._ws.receive_data(bytes(read_buffer()[:nbytes]))
        for event in self._ws.events_received():
            if isinstance(event, Frame):
                self._frame(event)
            elif not self._opened.done():  # the handshake response
                exc = self._ws.handshake_exc
                if exc is None:
                    self._opened.set_result(None)
                else:
                    self._opened.set_exception(exc)
        self._flush()
        if self._ws.state is not State.OPEN and self._opened.done():
            self._fail(WsClosedError(f"the server closed the WebSocket to {self.url}"
                                     f"{self._close_detail()}"))

    def eof_received(self) -> None:
        self._ws.receive_eof()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ws.receive_eof()
        if not self._opened.done():
            self._opened.set_exception(ConnectionError(f"the connection to {self.url} ended during the handshake"
                                                       f"{self._lost_detail(exc)}"))
        super().connection_lost(exc)

    # ---- internals -------------------------------------------------------------------------------------------

    def _frame(self, frame: Frame) -> None:
        if frame.opcode in _DATA or frame.opcode is Opcode.CONT:
            if frame.opcode is not Opcode.CONT:
                self._parts.clear()
            self._parts.append(frame.data)
            if frame.fin:
                data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
                self._parts.clear()
                self._deliver(data)

    def _flush(self) -> None:
        assert self._transport is not None
        for chunk in self._ws.data_to_send():
            if chunk:
                self._transport.write(chunk)
            elif self._transport.can_write_eof():
                self._transport.write_eof()

    def _goodbye(self) -> None:
        if self._ws.state is State.OPEN:
            self._ws.send_close()
            self._flush()

    def _lost_detail(self, exc: Exception | None) -> str:
        return f": {exc}" if exc else self._close_detail()

    def _close_detail(self) -> str:
        close = self._ws.close_rcvd
        if close is None:
            return ""
        return f" (code {close.code}{': ' + close.reason if close.reason else ''})"
