"""The multi-agent env contract: several named seats in one episode, in one file.

A multi-agent env is an episode several players share, each from a seat of its own::

    env = envkit.make("referential")             # a MultiAgentEnv (make() checks its contract too)
    turn = await env.reset(seed=0)               # Turn: each seat's opening messages, and who acts first
    while not turn.done:
        actions = {seat: await players[seat](turn.observations[seat]) for seat in turn.to_act}
        turn = await env.step(actions)           # each seat's new messages and rewards, and who acts next
    await env.close()

Each seat has its own observations (a seat sees only what the env gives it: its view), its own tools and its own
rewards. Turn order is the env's: ``to_act`` names the seats whose actions the next ``step`` takes, one seat
(alternating or env-chosen turns) or several (simultaneous moves). Who plays a seat (a policy being trained, a
frozen checkpoint, a script, an endpoint) is the caller's business, never the env's: ``generators.seats`` binds
seats to players.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from envkit.core import EnvBase, Forwarding, Snapshot, Task, check_kind
from envkit.errors import (
    EnvClosedError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidStepResultError,
    ResetNeededError,
)
from envkit.messages import Message, is_message, validate_action

if TYPE_CHECKING:
    from envkit.tools import Tool

Seat = str
"""A seat's name, one of the env's ``seats``."""


@dataclass(slots=True)
class Turn:
    """What ``MultiAgentEnv.reset`` and ``step`` return: each seat's view of what happened, and who acts next."""

    observations: dict[Seat, list[Message]]
    """Each seat's new messages since its last turn (its view only); a seat missing here got none."""
    to_act: tuple[Seat, ...]
    """The seats whose actions the next ``step`` takes; empty once the episode is done."""
    rewards: dict[Seat, float] = field(default_factory=dict)
    """Each seat's reward for this step; a seat missing here got 0."""
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """True when the episode is over (terminated or truncated)."""
        return self.terminated or self.truncated


class MultiAgentEnv(EnvBase, abc.ABC):
    """Base class of every multi-agent environment. The docstrings of its methods (and
    :class:`~envkit.core.EnvBase`'s: init, close, snapshot, restore) are the contract; ``reward_range`` bounds one
    seat's reward for one step."""

    seats: ClassVar[tuple[Seat, ...]] = ()
    """The seats every episode has, in a fixed order."""

    seat_tools: ClassVar[Mapping[Seat, list[Tool]]] = {}
    """Tools each seat may call (a seat missing here has none)."""

    @abc.abstractmethod
    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        """Start an episode: each seat's opening messages and the seats that act first. The same ``seed`` or
        ``task`` gives the same start."""

    @abc.abstractmethod
    async def step(self, actions: dict[Seat, Message]) -> Turn:
        """Apply one assistant message from each seat in the last ``to_act`` (exactly those) and return what
        each seat now sees, its rewards, and who acts next."""

    def tools(self, seat: Seat) -> list[Tool]:
        """The tools ``seat`` may call."""
        return list(self.seat_tools.get(seat, []))

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        """The env's tasks for ``split``, or None when tasks are not enumerable."""
        return None

    def secrets(self, seat: Seat) -> list[str]:
        """Text only ``seat`` may be shown in the current episode (its hidden card, its target): ``envkit check``
        plays episodes and fails the env if another seat's view holds any of it. Optional; none by default."""
        return []


class SeatsChecker(Forwarding, MultiAgentEnv):
    """Enforces the contract around a multi-agent env: call order, actions from exactly the seats to act, and a
    well-formed :class:`Turn` back (known seats only, chat messages, finite rewards, someone to act until done)."""

    def __init__(self, env: MultiAgentEnv) -> None:
        if not env.seats or len(set(env.seats)) != len(env.seats):
            raise InvalidStepResultError(f"{env!r} must name its seats, each once, got {env.seats!r}")
        self.env = env
        self._initialized = False
        self._to_act: tuple[Seat, ...] = ()
        self._started = False
        self._closed = False

    @property
    def seats(self) -> tuple[Seat, ...]:  # type: ignore[override]
        return self.env.seats

    @property
    def snapshot_kind(self) -> str:
        return self.env.snapshot_kind

    def tools(self, seat: Seat) -> list[Tool]:
        return self.env.tools(seat)

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        return self.env.tasks(split)

    def secrets(self, seat: Seat) -> list[str]:
        return self.env.secrets(seat)

    async def init(self) -> None:
        if not self._initialized:
            await self.env.init()
            self._initialized = True

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        if self._closed:
            raise EnvClosedError("reset() called on a closed env. Make a new one with envkit.make().")
        await self.init()
        turn = self._checked("reset", await self.env.reset(seed=seed, task=task))
        self._started = True
        return turn

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        if not self._to_act:
            if self._closed:
                raise EnvClosedError("step() called on a closed env. Make a new one with envkit.make().")
            if self._started:
                raise EpisodeDoneError("step() called after the episode ended. Call reset() to start a new one.")
            raise ResetNeededError("step() called before reset(). Call `await env.reset(...)` first.")
        if not isinstance(actions, dict) or set(actions) != set(self._to_act):
            got = sorted(actions) if isinstance(actions, dict) else type(actions).__name__
            raise InvalidActionError(f"step() takes one action from each seat to act, {sorted(self._to_act)}; "
                                     f"got {got}")
        checked = {seat: validate_action(action) for seat, action in actions.items()}
        return self._checked("step", await self.env.step(checked))

    async def snapshot(self) -> Snapshot:
        if self._closed:
            raise EnvClosedError("snapshot() called on a closed env.")
        inner = await self.env.snapshot()
        return Snapshot(inner.kind, (self._to_act, self._started, inner))

    async def restore(self, snapshot: Snapshot) -> None:
        if self._closed:
            raise EnvClosedError("restore() called on a closed env. Make a new one with envkit.make().")
        await self.init()
        check_kind(self, snapshot)
        self._to_act, self._started, inner = snapshot.state
        await self.env.restore(inner)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._to_act = ()
            await self.env.close()

    def _checked(self, method: str, turn: Any) -> Turn:
        env = self.env
        if not isinstance(turn, Turn):
            raise InvalidStepResultError(f"{env!r}.{method}() must return envkit.multi_agent.Turn, got "
                                         f"{type(turn).__name__}")
        seats = set(env.seats)
        for what, keys in (("observations", turn.observations), ("rewards", turn.rewards), ("to_act", turn.to_act)):
            unknown = set(keys) - seats
            if unknown:
                raise InvalidStepResultError(f"{env!r}.{method}() names seats it does not have in {what}: "
                                             f"{sorted(unknown)} (its seats: {list(env.seats)})")
        for seat, messages in turn.observations.items():
            if not isinstance(messages, list) or not all(is_message(m) for m in messages):
                raise InvalidStepResultError(f"{env!r}.{method}() observations[{seat!r}] must be a list of chat "
                                             f"messages, got {messages!r:.160}")
        for seat, reward in turn.rewards.items():
            if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
                raise InvalidStepResultError(f"{env!r}.{method}() rewards[{seat!r}] must be a finite number, got "
                                             f"{reward!r}")
        if turn.done == bool(turn.to_act):
            raise InvalidStepResultError(f"{env!r}.{method}() must name the seats to act while the episode goes on, "
                                         f"and none once it is done (done={turn.done}, to_act={turn.to_act!r})")
        self._to_act = tuple(turn.to_act)
        return turn
