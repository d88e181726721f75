"""SIGTERM ends a long run (``python -m trainer``, ``envkit eval``) as Ctrl-C does: the asyncio task in flight is
cancelled first, so rollouts release their sandboxes and managed servers stop, then KeyboardInterrupt unwinds the
run's own cleanup. Also where SIGINT was ignored (a background job's), since ``asyncio.Runner`` only takes Ctrl-C
over from Python's own handler."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

terminated: list[int] = []
"""The signals that ended this process's run (empty after Ctrl-C): its exit status is 128 + the first."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Inside asyncio.Runner.run, unwinding is its SIGINT handler's work: it cancels the task it runs, then raises
    # KeyboardInterrupt. An exception raised here instead would leave that task running through the cleanup.
    terminated.append(signum)
    interrupt = signal.getsignal(signal.SIGINT)
    if not callable(interrupt):  # a library set SIGINT to SIG_IGN or SIG_DFL after handled_signals()
        raise KeyboardInterrupt
    interrupt(signal.SIGINT, frame)


@contextlib.contextmanager
def handled_signals() -> Iterator[None]:
    """SIGTERM and SIGINT end the run cleanly inside this block (enter it before the run starts its event loop);
    the previous handlers come back after it. Outside the main thread, where handlers cannot be set, it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def exit_status() -> int:
    """The exit status of a run that a signal interrupted: 128 + SIGTERM's number, or 130 for Ctrl-C."""
    return 128 + (terminated[0] if terminated else signal.SIGINT)
