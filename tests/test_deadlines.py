"""Deadlines on a real event loop: expiry at the right time, discards, one timer for a stream of waits."""

from __future__ import annotations

import asyncio
import time

import uvloop

from envkit.remote.deadlines import Deadlines


async def test_each_deadline_fires_on_time_unless_discarded():
    deadlines = Deadlines()
    fired: dict[str, float] = {}
    last = asyncio.Event()
    start = time.monotonic()
    for key, timeout in (("a", 0.05), ("b", 0.1), ("c", 0.2)):
        deadlines.add(key, timeout, lambda key=key: fired.setdefault(key, time.monotonic() - start))
    deadlines.add("last", 0.2, last.set)
    deadlines.discard("b")
    await asyncio.wait_for(last.wait(), 10)  # every deadline left is due by now, b's too had it not been discarded
    assert set(fired) == {"a", "c"}
    assert 0.05 <= fired["a"] < fired["c"] and fired["c"] >= 0.2  # never early, in deadline order
    assert len(deadlines) == 0


async def test_a_shorter_deadline_added_later_fires_first():
    deadlines = Deadlines()
    fired: list[str] = []
    long_fired = asyncio.Event()
    deadlines.add("long", 0.3, lambda: (fired.append("long"), long_fired.set()))
    deadlines.add("short", 0.05, lambda: fired.append("short"))
    await asyncio.wait_for(long_fired.wait(), 10)
    assert fired == ["short", "long"]


async def test_a_stream_of_short_waits_schedules_one_timer_not_one_each():
    loop = asyncio.get_running_loop()
    scheduled: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):  # the real call_at, counted
        scheduled.append(when)
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        deadlines = Deadlines()
        expired: list[int] = []
        for i in range(1000):
            deadlines.add(i, 10.0, lambda i=i: expired.append(i))
            await asyncio.sleep(0)
            deadlines.discard(i)
    finally:
        del loop.call_at
    assert len(scheduled) == 1 and expired == []
    deadlines.clear()


async def test_the_timer_rearms_for_waits_added_after_it_was_set():
    deadlines = Deadlines()
    fired: list[float] = []
    expired = asyncio.Event()
    deadlines.add(0, 0.1, lambda: fired.append(0))
    deadlines.discard(0)
    # Added while the timer is still armed for key 0 (no await in between), and due after it: `add` leaves that
    # timer alone, so key 1 fires only if the timer, finding nothing due at 0.1 s, re-arms for it.
    added = time.monotonic()
    deadlines.add(1, 0.3, lambda: (fired.append(time.monotonic() - added), expired.set()))
    await asyncio.wait_for(expired.wait(), 10)
    assert len(fired) == 1 and fired[0] >= 0.3  # key 1 only, and not when the timer first fired for key 0


def test_a_new_event_loop_starts_afresh():
    deadlines = Deadlines()
    fired: list[str] = []

    async def wait(key: str, seconds: float) -> None:
        expired = asyncio.Event()
        deadlines.add(key, seconds, lambda: (fired.append(key), expired.set()))
        await asyncio.wait_for(expired.wait(), 10)

    asyncio.run(wait("first", 0.01))
    asyncio.run(wait("second", 0.01))
    assert fired == ["first", "second"]


def test_a_deadline_under_a_millisecond_on_uvloop_then_another():
    """The server runs on uvloop, whose ``call_at`` hands back a plain ``Handle`` (no ``when()``) for a delay that
    rounds to 0 ms; a later ``add`` must still compare against the armed time (this crashed a step under load)."""
    deadlines = Deadlines()
    fired: list[str] = []

    async def run() -> None:
        later = asyncio.Event()
        deadlines.add("now", 0.0001, lambda: fired.append("now"))
        deadlines.add("later", 0.05, lambda: (fired.append("later"), later.set()))
        await asyncio.wait_for(later.wait(), 10)

    uvloop.run(run())
    assert fired == ["now", "later"]
