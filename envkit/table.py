"""One episode of a multi-agent env, shared by its seats: each seat plays it as a single-agent ``envkit.Env``.

    table = Table(envkit.make("referential"))
    speaker, listener = table.view("speaker"), table.view("listener")
    # each view is played by its own player, at once: its reset waits for the seat's first turn, its step for the
    # next; it sees only its seat's observations and rewards

The same views serve a seat's session on an ``envkit serve`` server (one session per seat, joined by the table's id),
so a seat's player, local or remote, never receives another seat's view.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from envkit.core import Env, Snapshot, StepResult, Task
from envkit.errors import ContractError, EnvError, EpisodeDoneError, SnapshotError
from envkit.messages import Message
from envkit.multi_agent import MultiAgentEnv, Seat, Turn


class EpisodeAborted(EnvError):
    """The episode stopped before it ended: the env failed, or another seat's player left it."""


class NoTurn(EpisodeDoneError):
    """The episode ended before this seat had a turn (a game lost by the other seat's first moves): the seat has
    nothing to play, and nothing to learn from."""


class Table:
    """One episode of a multi-agent env, played by its seats at once: the env is stepped when every seat to act has
    acted, and each seat is told only its own observations and rewards."""

    def __init__(self, env: MultiAgentEnv) -> None:
        self.env = env
        self.start: tuple[int | None, Task | None] | None = None
        """The seed and task the episode started from: the first seat's to join."""
        self._inbox: dict[Seat, list[Message]] = {seat: [] for seat in env.seats}
        self._rewards: dict[Seat, float] = dict.fromkeys(env.seats, 0.0)
        self._acted: dict[Seat, Message] = {}
        self._last: Turn | None = None
        self._failed: BaseException | None = None
        self._left: set[Seat] = set()
        self._taken: set[Seat] = set()
        self._changed = asyncio.Condition()
        self._opening = asyncio.Lock()

    def view(self, seat: Seat) -> SeatView:
        """``seat``'s episode as a single-agent env (one view per seat)."""
        if seat not in self.env.seats:
            raise ValueError(f"{self.env!r} has no seat {seat!r}: its seats are {list(self.env.seats)}")
        if seat in self._taken:
            raise ValueError(f"seat {seat!r} of this table is taken")
        self._taken.add(seat)
        return SeatView(self, seat)

    @property
    def taken(self) -> frozenset[Seat]:
        """The seats whose views were taken."""
        return frozenset(self._taken)

    @property
    def closed(self) -> bool:
        """Whether every seat that took a view has left (the env is closed then)."""
        return bool(self._taken) and self._left >= self._taken

    async def join(self, seat: Seat, *, seed: int | None = None, task: Task | None = None) -> list[Message]:
        """``seat``'s opening messages, once it is its turn. The first seat to join starts the episode from its
        ``seed``/``task``; a later one must name the same start, or none."""
        async with self._opening:
            if self.start is None:
                self.start = (seed, task)
                await self._apply(self._open(seed, task))
            elif (seed, task) != (None, None) and (seed, task) != self.start:
                raise ContractError(f"seat {seat!r} reset with seed={seed!r}, task={task!r}, but the table's episode "
                                    f"started from seed={self.start[0]!r}, task={self.start[1]!r}: a table plays one "
                                    "episode")
        result = await self._await_turn(seat)
        if result.done:
            raise NoTurn(f"the episode ended before seat {seat!r} had a turn")
        return result.observation

    async def _open(self, seed: int | None, task: Task | None) -> Turn:
        await self.env.init()
        return await self.env.reset(seed=seed, task=task)

    async def act(self, seat: Seat, action: Message) -> StepResult:
        """Take ``seat``'s action; the env steps once every seat to act has acted. Returns once it is ``seat``'s
        turn again or the episode is over: what it saw meanwhile, and the rewards it got."""
        async with self._changed:
            assert self._last is not None
            if seat not in self._last.to_act or seat in self._acted:
                raise ContractError(f"seat {seat!r} acted out of turn (to act: {list(self._last.to_act)})")
            self._acted[seat] = action
            if set(self._acted) == set(self._last.to_act):
                actions, self._acted = self._acted, {}
                await self._apply(self.env.step(actions), locked=True)
        return await self._await_turn(seat)

    async def leave(self, seat: Seat) -> None:
        """``seat``'s player is done with the episode: if it is not over, it ends for every seat."""
        self._left.add(seat)
        if self._last is None or not self._last.done:
            await self._fail(EpisodeAborted(f"seat {seat!r} left the episode before it ended"))
        if self.closed:
            await self.env.close()

    async def _apply(self, pending: Awaitable[Turn], *, locked: bool = False) -> None:
        try:
            turn = await pending
        except Exception as e:
            await self._fail(EpisodeAborted(f"the env failed: {type(e).__name__}: {e}"), locked=locked)
            raise
        for seat, messages in turn.observations.items():
            self._inbox[seat].extend(messages)
        for seat, reward in turn.rewards.items():
            self._rewards[seat] += reward
        self._last = turn
        if locked:
            self._changed.notify_all()
        else:
            async with self._changed:
                self._changed.notify_all()

    async def _fail(self, error: BaseException, *, locked: bool = False) -> None:
        if self._failed is None:
            self._failed = error
        if locked:
            self._changed.notify_all()
            return
        async with self._changed:
            self._changed.notify_all()

    async def _await_turn(self, seat: Seat) -> StepResult:
        async with self._changed:
            await self._changed.wait_for(lambda: self._failed is not None or self._my_turn(seat))
            if self._failed is not None and not (self._last is not None and self._last.done):
                raise self._failed
            assert self._last is not None
            observation, self._inbox[seat] = self._inbox[seat], []
            reward, self._rewards[seat] = self._rewards[seat], 0.0
            last = self._last
            return StepResult(observation, reward, terminated=last.terminated, truncated=last.truncated,
                              info=dict(last.info) if last.done else {})

    def _my_turn(self, seat: Seat) -> bool:
        last = self._last
        return last is not None and (last.done or (seat in last.to_act and seat not in self._acted))


class SeatView(Env):
    """One seat's episode at a :class:`Table`, as an :class:`envkit.Env`: its reset waits for the seat's first
    turn, its step for the next; its observations and rewards are the seat's alone."""

    def __init__(self, table: Table, seat: Seat) -> None:
        self.table, self.seat = table, seat

    @property
    def tools(self) -> list[Any]:  # type: ignore[override]
        return self.table.env.tools(self.seat)

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        return await self.table.join(self.seat, seed=seed, task=task), {"seat": self.seat}

    async def step(self, action: Message) -> StepResult:
        return await self.table.act(self.seat, action)

    async def close(self) -> None:
        await self.table.leave(self.seat)

    async def snapshot(self) -> Snapshot:
        raise SnapshotError("one seat's view cannot be snapshotted alone: snapshot the multi-agent env itself "
                            "(MultiAgentEnv.snapshot), which holds every seat's state")

    def __repr__(self) -> str:
        return f"<SeatView {self.seat!r} of {self.table.env!r}>"


