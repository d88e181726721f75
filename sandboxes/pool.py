"""SandboxPool: ``size`` sandboxes started ahead of time, so a rollout gets a ready server in microseconds.

``acquire`` hands over a running sandbox (waiting only when all of them are leased or still starting); ``release``
scrubs it (every process ``exec`` left killed, its files deleted) and puts it back when that left it clean, and it
is young enough and still healthy, and otherwise closes it and starts a replacement in
the background. ``close`` drains the pool: in-flight starts are cancelled (which removes their containers), idle and
leased sandboxes are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from sandboxes.base import Sandbox, SandboxStateError, State

log = logging.getLogger(__name__)


class SandboxPool:
    """A warm pool of sandboxes made by ``factory`` (e.g. ``lambda: DockerSandbox(image)``)."""

    def __init__(self, factory: Callable[[], Sandbox], *, size: int = 2, max_lifetime_s: float = 600.0,
                 max_uses: int = 0, start_concurrency: int = 2, server_kwargs: dict[str, Any] | None = None) -> None:
        if size < 1 or max_lifetime_s <= 0 or max_uses < 0 or start_concurrency < 1:
            raise ValueError(f"SandboxPool needs size >= 1, max_lifetime_s > 0, max_uses >= 0 and "
                             f"start_concurrency >= 1 (got {size}, {max_lifetime_s}, {max_uses}, {start_concurrency})")
        self.factory = factory
        self.size = size
        self.max_lifetime_s = max_lifetime_s
        self.max_uses = max_uses
        """Recycle a sandbox at most this many times (0: no limit)."""
        self.server_kwargs = dict(server_kwargs or {})
        """The env kwargs the sandboxes' servers were started with (what ``factory`` gives them)."""
        self._ready: asyncio.Queue[Sandbox | BaseException] = asyncio.Queue()
        self._leased: set[Sandbox] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._fills: set[asyncio.Task[None]] = set()
        # Starting containers competes for the same few cores: bound how many start at once.
        self._start_slots = asyncio.Semaphore(start_concurrency)
        self._closed = False
        self._idle = 0
        self._start_error: BaseException | None = None
        self.lost = 0
        """Sandboxes found dead (OOM-killed, exited) when given back, and replaced."""

    async def start(self, *, wait: bool = True) -> None:
        """Start filling the pool; with ``wait``, return once every sandbox is ready (or raise the first failure)."""
        for _ in range(self.size):
            self._spawn_fill()
        if wait:
            await self.wait_ready()

    async def wait_ready(self) -> None:
        """Wait until no start is in flight; raises the latest start failure since the last call."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
        error, self._start_error = self._start_error, None
        if error is not None:
            raise error

    @property
    def idle(self) -> int:
        """Sandboxes ready to hand over now."""
        return self._idle

    def _spawn(self, coro: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_fill(self) -> None:
        task = self._spawn(self._fill_one())
        self._fills.add(task)
        task.add_done_callback(self._fills.discard)

    async def _fill_one(self) -> None:
        async with self._start_slots:
            sandbox = self.factory()
            try:
                await sandbox.start()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("sandbox pool: a start failed: %s", e)
                self._start_error = e
                self._ready.put_nowait(e)  # the next acquire raises it (and starts a replacement)
                return
        if self._closed:
            await sandbox.close()
            return
        self._put(sandbox)

    def _put(self, sandbox: Sandbox) -> None:
        self._idle += 1
        self._ready.put_nowait(sandbox)

    def _fresh(self, sandbox: Sandbox) -> bool:
        return (sandbox.state is State.RUNNING and sandbox.age_s < self.max_lifetime_s
                and (self.max_uses == 0 or sandbox.uses < self.max_uses))

    def _retire(self, sandbox: Sandbox) -> None:
        """Close ``sandbox`` and start its replacement, both in the background."""
        self._spawn(sandbox.close())
        if not self._closed:
            self._spawn_fill()

    async def acquire(self) -> Sandbox:
        """A running sandbox for exclusive use until ``release``."""
        while True:
            if self._closed:
                raise SandboxStateError("the sandbox pool is closed")
            item = await self._ready.get()
            if isinstance(item, BaseException):
                self._spawn_fill()
                raise item
            self._idle -= 1
            if self._fresh(item):
                item.uses += 1
                self._leased.add(item)
                return item
            self._retire(item)

    async def release(self, sandbox: Sandbox, *, dirty: bool = False) -> None:
        """Give a sandbox back: scrubbed, and recycled when clean, fresh and healthy; otherwise replaced (``dirty``
        forces that)."""
        self._leased.discard(sandbox)
        if self._closed:
            await sandbox.close()
            return
        # Clean is checked, not assumed: a sandbox whose scrub leaves a process or a file is replaced.
        if dirty or not self._fresh(sandbox):
            self._retire(sandbox)
            return
        if not await sandbox.alive() or not await sandbox.scrub():
            if why := await sandbox.lost():  # died in use: said once here, the episode's error says it too
                self.lost += 1
                log.warning("sandbox pool: %s; a replacement is starting", why)
            self._retire(sandbox)
            return
        self._put(sandbox)

    async def close(self) -> None:
        """Drain: cancel starts in flight, close idle and leased sandboxes (idempotent)."""
        self._closed = True
        for task in list(self._fills):  # a cancelled start removes its own container; closes run to the end
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        sandboxes = list(self._leased)
        self._leased.clear()
        while not self._ready.empty():
            item = self._ready.get_nowait()
            if isinstance(item, Sandbox):
                sandboxes.append(item)
        self._idle = 0
        await asyncio.gather(*(s.close() for s in sandboxes), return_exceptions=True)

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
