"""Async off-policy rollouts (``trainer.mode=async``): the next steps' rollouts are generated while this one trains.

    groups admitted − groups dropped  ≤  (version served + max_staleness + 1) · prompts_per_step

Prompts are drawn from the Mixture as sync mode draws them, as many as that bound allows, whenever the engine
starts serving new weights or a group is dropped. A step trains on the first ``prompts_per_step`` groups to complete
(a slow group never holds a step up), in the order they were drawn. A group whose oldest rollout was sampled more
than ``max_staleness`` versions before the policy about to be trained is dropped and counted, and its place goes to
a new prompt. With ``max_staleness=0`` step s's prompts are drawn only once version s serves and all of them train
at step s: exactly what sync mode samples and trains.

All of it runs on the trainer's event loop, which in async mode lives in a thread of its own (:class:`LoopThread`),
so no state here is shared between threads. A checkpoint holds what was drawn but not trained: completed groups as
their rollouts, groups still in flight as their starts (generated again on resume). A crash loses neither.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from generators import Trajectory
from trainer.sources import EnvStream, Mixture, Start

T = TypeVar("T")


class LoopThread:
    """An event loop in a thread of its own, driven like ``asyncio.Runner``: ``run(coro)`` blocks until ``coro``
    is done, and between calls the loop goes on running background tasks (generation while the trainer trains)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="envkit-rollouts", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def native_id(self) -> int:
        """The loop thread's id in the OS (for its scheduling priority)."""
        assert self._thread.native_id is not None  # started in __init__
        return self._thread.native_id

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting for it (a server that runs until stopped)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        """Cancel what is still running, stop the loop and join its thread."""
        async def finish() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._loop.shutdown_asyncgens()
            await self._loop.shutdown_default_executor()

        self.run(finish())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


@dataclass
class _Group:
    """One prompt's rollouts, or (while in flight) just its start."""

    key: tuple[int, int, int]
    """(draw, env's place in that draw, start's place in the env's starts): the order sync mode trains in."""
    stream: EnvStream
    start: Start
    rollouts: list[Trajectory] | None = None


GroupGenerator = Callable[[EnvStream, list[Start], Callable[[int, list[Trajectory]], None]], Awaitable[Any]]
"""How a list of starts is generated: ``(stream, starts, on_group)``, ``on_group(i, rollouts)`` as the i-th's group
completes."""


class AsyncRollouts:
    """Draws, generates and hands out groups under the staleness bound (see the module docstring). A group is what
    ``generate`` makes of one start: its rollouts, or a multi-agent episode's every seat."""

    def __init__(self, envs: Mixture, generate: GroupGenerator, *, prompts_per_step: int, max_staleness: int) -> None:
        self.envs = envs
        self.generate = generate
        self.per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.version = 0
        self._kept = 0  # groups drawn and not dropped, over the whole run (trained ones included)
        self._draws = 0
        self._groups: dict[tuple[int, int, int], _Group] = {}  # drawn, not yet trained or dropped
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None

    async def start(self, *, step: int, version: int, pending: list[dict[str, Any]]) -> None:
        """Begin drawing at ``step`` with ``version`` served; ``pending`` is a checkpoint's :meth:`pending`."""
        self.version = version
        self._kept = step * self.per_step
        by_label = {s.label: s for s in self.envs.streams}
        for i, item in enumerate(pending):
            group = _Group((-1, 0, i), by_label[item["env"]], (item["task"], item["seed"]))
            if item["rollouts"] is None:
                self._launch(group.key[0], [group])
            else:
                group.rollouts = [Trajectory.from_json(t) for t in item["rollouts"]]
            self._groups[group.key] = group
            self._kept += 1
        self._fill()

    async def set_version(self, version: int) -> None:
        """The engine now serves ``version``: more prompts may be drawn."""
        self.version = version
        self._fill()

    async def batch(self, step: int) -> tuple[list[Trajectory], int]:
        """The rollouts step ``step`` (training the policy of version ``step``) trains on, and how many rollouts of
        groups too stale to train were dropped while collecting them."""
        taken: list[_Group] = []
        dropped = 0
        while len(taken) < self.per_step:
            if self._failure is not None:
                raise RuntimeError("async rollout generation failed") from self._failure
            done = sorted(k for k, g in self._groups.items() if g.rollouts is not None)
            if not done:
                self._changed.clear()
                await self._changed.wait()
                continue
            group = self._groups.pop(done[0])
            assert group.rollouts is not None
            if step - min(t.policy_version for t in group.rollouts) > self.max_staleness:
                dropped += len(group.rollouts)
                self._kept -= 1
                self._fill()
            else:
                taken.append(group)
        return [t for g in sorted(taken, key=lambda g: g.key) for t in g.rollouts or ()], dropped

    def pending(self) -> list[dict[str, Any]]:
        """What was drawn but not trained, for the checkpoint: completed groups with their rollouts, groups in flight
        with ``rollouts: None`` (generated again on resume)."""
        return [{"env": g.stream.label, "task": g.start[0], "seed": g.start[1],
                 "rollouts": None if g.rollouts is None else [t.to_json() for t in g.rollouts]}
                for _, g in sorted(self._groups.items())]

    async def close(self) -> None:
        """Cancel the generation still in flight."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _fill(self) -> None:
        """Draw as many prompts as the staleness bound allows, and start their rollouts."""
        room = (self.version + self.max_staleness + 1) * self.per_step - self._kept
        if room <= 0:
            return
        draw, self._draws = self._draws, self._draws + 1
        for place, (stream, starts) in enumerate(self.envs.draw(room)):
            groups = [_Group((draw, place, i), stream, start) for i, start in enumerate(starts)]
            self._groups.update((g.key, g) for g in groups)
            self._launch(draw, groups)
        self._kept += room

    def _launch(self, draw: int, groups: list[_Group]) -> None:
        def completed(i: int, rollouts: list[Trajectory]) -> None:
            groups[i].rollouts = rollouts
            groups[i].stream.observe(groups[i].start, rollouts)
            self._changed.set()

        task = asyncio.create_task(self.generate(groups[0].stream, [g.start for g in groups], completed),
                                   name=f"rollouts-draw-{draw}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self._changed.set()
