"""Deadlines: many timeouts on one lazily re-armed event-loop timer.

``asyncio.timeout`` schedules (and cancels) a timer for every wait. An env server answering tens of thousands of
steps a second, or a client waiting on as many answers, pays more for those timers than for a fast env's step.
Here adding and discarding a deadline are dict operations; the single timer fires at the earliest deadline it knows
of, expires whatever is due, and re-arms at the earliest one left, so it fires about once per timeout period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable


class Deadlines:
    """Callbacks that run when their deadline passes, unless discarded first; one timer for all of them."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # uvloop rounds a timer's delay to whole milliseconds and hands back a plain ``Handle`` (no ``when()``)
        # for one under half a millisecond, so the timer's due time is kept here.
        self._timer: asyncio.Handle | None = None
        self._timer_when = 0.0

    def add(self, key: Hashable, timeout_s: float, on_expire: Callable[[], None]) -> None:
        """Call ``on_expire()`` in ``timeout_s`` seconds unless ``key`` is discarded before (must run in the loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new loop (a test client's, say): the old timer is moot
            self.clear()
            self._loop = loop
        when = self._loop.time() + timeout_s
        self._pending[key] = (when, on_expire)
        if self._timer is None or when < self._timer_when:
            if self._timer is not None:
                self._timer.cancel()
            self._arm(when)

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s deadline (no-op if it is gone or has expired)."""
        self._pending.pop(key, None)

    def clear(self) -> None:
        """Forget every deadline and stop the timer."""
        self._pending.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __len__(self) -> int:
        return len(self._pending)

    def _fire(self) -> None:
        assert self._loop is not None
        self._timer = None
        now = self._loop.time()
        due = [key for key, (when, _) in self._pending.items() if when <= now]
        for key in due:
            _, on_expire = self._pending.pop(key)
            on_expire()
        if self._pending and self._timer is None:
            self._arm(min(when for when, _ in self._pending.values()))

    def _arm(self, when: float) -> None:
        assert self._loop is not None
        self._timer, self._timer_when = self._loop.call_at(when, self._fire), when


class Canceller:
    """A deadline's ``on_expire`` that cancels the task that made it; ``expired`` says whether it has (the task
    then tells a timeout from any other cancellation, and calls ``task.uncancel()`` once it has handled it)."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Canceller must be made inside a task")
        self.task = task
        self.expired = False

    def __call__(self) -> None:
        self.expired = True
        self.task.cancel()
