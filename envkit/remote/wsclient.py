"""A lockstep WebSocket client: send one frame, await one answer, on websockets' sans-I/O protocol.

An env session has one request in flight at a time. websockets' asyncio client is built for the general case
(concurrent senders, streamed fragments, keepalive, a timer per wait), which costs a remote step more CPU than the
env server spends on it. This drives the same protocol object (handshake, framing, masking, pings, closing) straight
from an asyncio transport, and times answers out with :class:`~envkit.remote.deadlines.Deadlines`, so a step
schedules no timer of its own.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import cast

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidURI
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from envkit.remote.deadlines import Deadlines

_DATA = (Opcode.TEXT, Opcode.BINARY)
_READ_SIZE = 256 * 1024
_per_thread = threading.local()  # holds the read buffer its connections share: each read is consumed at once


def read_buffer() -> memoryview:
    """This thread's read buffer, shared by its connections (each read is consumed before the next)."""
    buffer: memoryview | None = getattr(_per_thread, "read_buffer", None)
    if buffer is None:
        buffer = _per_thread.read_buffer = memoryview(bytearray(_READ_SIZE))
    return buffer


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class WsClosedError(ConnectionError):
    """The connection closed (or was closed) before the answer came."""


class WsConnection(asyncio.BufferedProtocol):
    """One client WebSocket on which requests and answers alternate; open it with :meth:`connect`.

    A buffered protocol: the transport reads into a reusable buffer. A plain protocol's selector transport
    allocates a 256 KiB bytes object per read, which glibc maps, shrinks and unmaps every time (three syscalls and
    fresh page faults per answer: about a sixth of the client's CPU per step here).
    """

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self._loop = asyncio.get_running_loop()
        self._ws = ClientProtocol(parse_uri(url), max_size=None)
        self._headers = headers
        self._transport: asyncio.Transport | None = None
        self._opened: asyncio.Future[None] = self._loop.create_future()
        self._opened.add_done_callback(_retrieve)  # a handshake abandoned by connect() must not log its error
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._answer: asyncio.Future[bytes] | None = None
        self._parts: list[bytes] = []
        self._deadlines = Deadlines()
        self._why_closed = ""

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
        return self._ws.state is not State.OPEN or self._transport is None or self._transport.is_closing()

    async def request(self, text: str | bytes, timeout_s: float) -> bytes:
        """Send ``text`` (str or UTF-8 bytes) as one text frame and return the next data message.

        Raises TimeoutError after ``timeout_s`` and WsClosedError if the connection ends first. Either way, and on
        cancellation, the connection is closed, since a late answer would otherwise be read as the next one's.
        """
        if self._answer is not None:
            raise RuntimeError("WsConnection carries one request at a time")
        if self.closed:
            raise WsClosedError(f"the WebSocket to {self.url} is closed{self._why_closed}")
        answer = self._answer = self._loop.create_future()
        self._deadlines.add(self, timeout_s, self._expire)
        self._ws.send_text(text.encode() if isinstance(text, str) else text)
        self._flush()
        try:
            return await answer
        except BaseException:
            self.abort()
            raise
        finally:
            self._deadlines.discard(self)
            self._answer = None

    def send(self, text: str) -> None:
        """Send ``text`` as one frame that gets no answer (a goodbye, say)."""
        if self.closed:
            raise WsClosedError(f"the WebSocket to {self.url} is closed{self._why_closed}")
        self._ws.send_text(text.encode())
        self._flush()

    async def close(self) -> None:
        """Send a close frame and wait (briefly) for the connection to end; idempotent."""
        if self._transport is None:
            return
        if self._ws.state is State.OPEN:
            self._ws.send_close()
            self._flush()
        self._transport.close()
        try:
            async with asyncio.timeout(1.0):
                await asyncio.shield(self._lost)
        except TimeoutError:
            self.abort()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self._transport is not None:
            self._transport.abort()

    # ---- asyncio.BufferedProtocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it, so no isinstance check here.
        self._transport = cast(asyncio.Transport, transport)
        request = self._ws.connect()
        for name, value in self._headers.items():
            request.headers[name] = value
        self._ws.send_request(request)
        self._flush()

    def get_buffer(self, sizehint: int) -> memoryview:
        return read_buffer()

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
        self._deadlines.clear()
        detail = f": {exc}" if exc else self._close_detail()
        if not self._opened.done():
            self._opened.set_exception(ConnectionError(f"the connection to {self.url} ended during the handshake"
                                                       f"{detail}"))
        self._fail(WsClosedError(f"the WebSocket to {self.url} closed{detail}"))
        if not self._lost.done():
            self._lost.set_result(None)

    # ---- internals -------------------------------------------------------------------------------------------

    def _frame(self, frame: Frame) -> None:
        if frame.opcode in _DATA or frame.opcode is Opcode.CONT:
            if frame.opcode is not Opcode.CONT:
                self._parts.clear()
            self._parts.append(frame.data)
            if frame.fin:
                data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
                self._parts.clear()
                if self._answer is None or self._answer.done():
                    self._fail(WsClosedError(f"{self.url} sent a message nobody asked for"))
                    self.abort()
                else:
                    self._answer.set_result(data)

    def _flush(self) -> None:
        assert self._transport is not None
        for chunk in self._ws.data_to_send():
            if chunk:
                self._transport.write(chunk)
            elif self._transport.can_write_eof():
                self._transport.write_eof()

    def _fail(self, exc: BaseException) -> None:
        if not self._why_closed:
            self._why_closed = f" ({exc})"
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)

    def _close_detail(self) -> str:
        close = self._ws.close_rcvd
        if close is None:
            return ""
        return f" (code {close.code}{': ' + close.reason if close.reason else ''})"

    def _expire(self) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(TimeoutError())  # request() then drops the connection
