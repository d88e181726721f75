"""What the lockstep clients (:mod:`.httpclient`, :mod:`.wsclient`) share: a connection that carries one request at
a time, whose answer is awaited under a :class:`~envkit.remote.deadlines.Deadlines` timeout (so a request schedules
no timer of its own), and which reads into one buffer per thread.

A buffered protocol: the transport reads into a reusable buffer. A plain protocol's selector transport allocates a
256 KiB bytes object per read, which glibc maps, shrinks and unmaps every time (three syscalls and fresh page faults
per answer: about a sixth of the client's CPU per step).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar, cast

from envkit.remote.deadlines import Deadlines

A = TypeVar("A")
_READ_SIZE = 256 * 1024
_per_thread = threading.local()  # holds the read buffer its connections share: each read is consumed at once


def read_buffer() -> memoryview:
    """This thread's read buffer, shared by its connections (each read is consumed before the next)."""
    buffer: memoryview | None = getattr(_per_thread, "read_buffer", None)
    if buffer is None:
        buffer = _per_thread.read_buffer = memoryview(bytearray(_READ_SIZE))
    return buffer


class LockstepConnection(asyncio.BufferedProtocol, Generic[A]):
    """A client connection on which requests and answers ``A`` alternate; subclasses speak the protocol, feeding
    each complete answer to :meth:`_deliver` and each failure to :meth:`_fail`."""

    closed_error: ClassVar[type[ConnectionError]] = ConnectionError
    """Raised when the connection ends before an answer, or is found closed."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._answer: asyncio.Future[A] | None = None
        self._deadlines = Deadlines()
        self._why_closed = ""

    @property
    def closed(self) -> bool:
        """True once no further request can be answered."""
        return self._transport is None or self._transport.is_closing()

    async def _exchange(self, send: Callable[[asyncio.Transport], None], timeout_s: float) -> A:
        """Write one request with ``send`` and await its answer.

        Raises TimeoutError after ``timeout_s`` and :attr:`closed_error` if the connection ends first. Either way,
        and on cancellation, the connection is closed, since a late answer would otherwise be read as the next
        one's.
        """
        if self._answer is not None:
            raise RuntimeError(f"{type(self).__name__} carries one request at a time")
        if self.closed:
            raise self.closed_error(f"the connection to {self.where} is closed{self._why_closed}")
        answer = self._answer = self._loop.create_future()
        self._deadlines.add(self, timeout_s, self._expire)
        send(cast(asyncio.Transport, self._transport))
        try:
            return await answer
        except BaseException:
            self.abort()
            raise
        finally:
            self._deadlines.discard(self)
            self._answer = None

    async def close(self) -> None:
        """Say goodbye where the protocol has a way to, close, and wait (briefly) for the end; idempotent."""
        if self._transport is None:
            return
        self._goodbye()
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

    def get_buffer(self, sizehint: int) -> memoryview:
        return read_buffer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadlines.clear()
        self._fail(self.closed_error(f"the connection to {self.where} closed{self._lost_detail(exc)}"))
        if not self._lost.done():
            self._lost.set_result(None)

    # ---- for subclasses --------------------------------------------------------------------------------------

    def _goodbye(self) -> None:
        """Send what the protocol sends before closing (nothing by default)."""

    def _lost_detail(self, exc: Exception | None) -> str:
        return f": {exc}" if exc else ""

    @property
    def _awaiting(self) -> bool:
        return self._answer is not None and not self._answer.done()

    def _deliver(self, answer: A) -> None:
        if self._awaiting:
            cast(asyncio.Future[A], self._answer).set_result(answer)
        else:
            self._unsolicited()

    def _unsolicited(self) -> None:
        self._fail(self.closed_error(f"{self.where} sent an answer nobody asked for"))
        self.abort()

    def _fail(self, exc: BaseException) -> None:
        if not self._why_closed:
            self._why_closed = f" ({exc})"
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)

    def _expire(self) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(TimeoutError())  # _exchange() then drops the connection
