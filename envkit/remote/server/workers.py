"""Session slots of ``envkit serve``: one limit for one process, or for all N worker processes of ``--workers N``.

Workers share a run directory that the parent process makes. ``sessions.json`` there maps each worker's pid to the
sessions it holds (envs being made included); a worker admits one more only while the sum over live workers stays
within ``max_sessions``, read and written under an exclusive ``flock``. Each worker also writes a snapshot of its
metrics there every :data:`FLUSH_S` seconds, so ``/metrics`` from any worker can sum the whole server's. A worker
that dies stops counting at once (its pid is gone), and the supervisor's replacement starts from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "ENVKIT_SERVE_RUN_DIR"
"""Where the parent tells each worker process the run directory is."""
FLUSH_S = 0.5
"""How often a worker writes its metrics snapshot: other workers' numbers in ``/metrics`` are at most this old."""


class LocalSlots:
    """The session slots of a server that is one process: a counter."""

    workers = 1

    def __init__(self) -> None:
        self.held = 0

    async def open(self) -> None:
        """Join the server (a worker shows up in the counts from here on, with no sessions)."""

    async def close(self) -> None:
        """Leave the server."""

    async def admit(self, limit: int) -> bool:
        """Take a slot if fewer than ``limit`` are held."""
        if self.held >= limit:
            return False
        self.held += 1
        return True

    async def release(self) -> None:
        """Give a slot back."""
        self.held -= 1

    async def total(self) -> int:
        """Slots held by the whole server."""
        return self.held


class WorkerSlots(LocalSlots):
    """The session slots of one of N worker processes, counted against one limit for all of them."""

    def __init__(self, run_dir: str | Path, workers: int) -> None:
        super().__init__()
        self.dir = Path(run_dir)
        self.workers = workers
        self.pid = os.getpid()
        self._lock = asyncio.Lock()  # one file update at a time from this process, in the order they were asked

    async def open(self) -> None:
        """Join the server (a worker shows up in the counts from here on, with no sessions)."""
        await asyncio.to_thread(self._write, 0, None)

    async def close(self) -> None:
        """Leave the server: drop this worker's count and metrics."""
        await asyncio.to_thread(self._leave)

    def _leave(self) -> None:
        with self._counts() as counts:
            counts.pop(self.pid, None)
        (self.dir / f"metrics-{self.pid}.json").unlink(missing_ok=True)

    async def admit(self, limit: int) -> bool:
        """Take a slot if the whole server holds fewer than ``limit``."""
        async with self._lock:
            if not await asyncio.to_thread(self._write, self.held + 1, limit):
                return False
            self.held += 1
            return True

    async def release(self) -> None:
        """Give a slot back."""
        async with self._lock:
            self.held -= 1
            await asyncio.to_thread(self._write, self.held, None)

    async def total(self) -> int:
        """Slots held by the live workers."""
        return sum((await asyncio.to_thread(self.counts)).values())

    def counts(self) -> dict[int, int]:
        """Sessions held per live worker pid."""
        with self._counts() as counts:
            return dict(counts)

    def _write(self, held: int, limit: int | None) -> bool:
        with self._counts() as counts:
            if limit is not None and sum(n for pid, n in counts.items() if pid != self.pid) + held > limit:
                return False
            counts[self.pid] = held
            return True

    @contextlib.contextmanager
    def _counts(self) -> Iterator[dict[int, int]]:
        """The live workers' counts under the lock; what the block leaves in the dict is written back."""
        path = self.dir / "sessions.json"
        with open(self.dir / "sessions.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            try:
                counts = {int(pid): n for pid, n in json.loads(path.read_text()).items()}
            except FileNotFoundError:
                counts = {}
            counts = {pid: n for pid, n in counts.items() if pid == self.pid or _alive(pid)}
            yield counts
            path.write_text(json.dumps(counts))

    def write_metrics(self, snapshot: dict[str, Any]) -> None:
        """Publish this worker's metrics (atomically: readers never see half a file)."""
        tmp = self.dir / f".metrics-{self.pid}.tmp"
        tmp.write_text(json.dumps(snapshot))
        tmp.replace(self.dir / f"metrics-{self.pid}.json")

    def other_metrics(self) -> list[dict[str, Any]]:
        """The latest snapshots of the other live workers."""
        snapshots = []
        for path in self.dir.glob("metrics-*.json"):
            pid = int(path.stem.removeprefix("metrics-"))
            if pid != self.pid and _alive(pid):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    snapshots.append(json.loads(path.read_text()))
        return snapshots


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
