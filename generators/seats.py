"""Multi-agent episodes: each seat of a :class:`~envkit.multi_agent.MultiAgentEnv` bound to a player, one exact
trajectory per seat.

    seats = local_seats(make_env)               each episode a Table here (envkit/table.py), or remote_seats(url):
                                                a session per seat on an ``envkit serve`` server
    trajs = await play_episode(seats, players, ...)   every seat plays its own view at once

A player is a :class:`~generators.rollout.Generator` (a policy: one being trained, a frozen checkpoint, any
OpenAI-compatible endpoint), an :class:`AgentPlayer` (an agent that owns its loop, calling a generator's policy
through its capture gateway) or a :data:`Script`. A generator plays its seat's view as any chat episode
(generators/episodes/chat.py): the tokens it sampled have loss_mask 1, everything the env showed that seat (other
seats' moves among it, rendered as data) mask 0. So no trajectory holds another seat's tokens as its own, by
construction, and each seat's trajectory belongs to its own group (``GROUP/SEAT``): advantages compare a seat's
samples with that seat's, so moving first is not learned as skill.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envkit import Env, Message, StepResult, Task, Wrapper, assistant
from envkit.agents.agent import Agent, AgentClient, AgentEnv
from envkit.errors import EpisodeDoneError
from envkit.multi_agent import MultiAgentEnv, Seat
from envkit.table import EpisodeAborted, Table
from generators.rollout import Generator
from generators.trajectory import Trajectory

log = logging.getLogger(__name__)

Script = Callable[[list[Message]], Message | str | Awaitable[Message | str]]
"""A scripted player: the seat's chat so far -> its next assistant message (or its text)."""


@dataclass(frozen=True)
class AgentPlayer:
    """A seat played by an agent that owns its loop: an :data:`~envkit.agents.agent.Agent` (an async callable, or a
    :class:`~envkit.agents.agent.Command` process, isolated as every agent process is), its model calls served by
    ``policy``'s capture gateway. It is run at each of its seat's turns with the seat's chat so far as its task's
    ``messages`` (and the seat's ``tools``); what it returns is the seat's move. The tokens its calls sampled are
    its seat's trajectory (mask 1), as in any agent env's episode; the seat's rewards are its reward."""

    agent: Agent
    policy: Generator


Player = Generator | AgentPlayer | Script

Seating = Callable[[Sequence[Seat]], Awaitable[dict[Seat, Env]]]
"""Where one episode is played: the seats' names -> each seat's view of a fresh episode, as an env."""


def local_seats(make_env: Callable[[], MultiAgentEnv]) -> Seating:
    """Episodes of ``make_env()``'s env played in this process, one :class:`~envkit.table.Table` each."""

    async def seat(seats: Sequence[Seat]) -> dict[Seat, Env]:
        env = make_env()
        if set(seats) != set(env.seats):
            await env.close()
            raise ValueError(f"{env!r} has seats {list(env.seats)}: bind each to a player (got {sorted(seats)})")
        table = Table(env)
        return {s: table.view(s) for s in seats}

    return seat


def remote_seats(url: str, **env_kwargs: Any) -> Seating:
    """Episodes of the multi-agent env an ``envkit serve`` server serves at ``url``: a session per seat, the first
    seat's creating the episode's table and the others joining it (each sees its own seat's view only)."""
    from envkit.remote.client import RemoteEnv

    async def seat(seats: Sequence[Seat]) -> dict[Seat, Env]:
        first = RemoteEnv(url, env_kwargs=env_kwargs, seat=seats[0])
        await first.init()
        envs: dict[Seat, Env] = {seats[0]: first}
        try:
            for name in seats[1:]:
                envs[name] = RemoteEnv(url, env_kwargs=env_kwargs, seat=name, table=first.table)
                await envs[name].init()
        except BaseException:
            await asyncio.gather(*(e.close() for e in envs.values()), return_exceptions=True)
            raise
        return envs

    return seat


class _Outcome(Wrapper):
    """A seat's view that keeps the episode's outcome (the info of its last step's result, scalars only), and
    whether the episode ended before the seat had a turn (its reset says so, here or on a server)."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.outcome: dict[str, Any] = {}
        self.no_turn = False

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        try:
            return await self.env.reset(seed=seed, task=task)
        except EpisodeDoneError:
            self.no_turn = True
            raise

    async def step(self, action: Message) -> StepResult:
        result = await self.env.step(action)
        if result.done:
            self.outcome = {k: v for k, v in result.info.items() if isinstance(v, str | int | float | bool | None)}
        return result


class AgentTurns(AgentEnv):
    """A seat's view played by an :class:`AgentPlayer`'s agent, one run of it per turn (see there)."""

    def __init__(self, view: Env, agent: Agent) -> None:
        super().__init__(agent=agent, agent_fields=("messages", "tools"))
        self.view = view
        self.chat: list[Message] = []

    async def init(self) -> None:
        await self.view.init()

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        messages, info = await self.view.reset(seed=seed, task=task)
        self.chat = list(messages)
        return messages, info

    async def run(self, client: AgentClient) -> float:
        """Play the seat's turns until the episode ends; the seat's total reward."""
        total = 0.0
        while True:
            tools = self.view.tools
            self.task = {"messages": list(self.chat), **({"tools": tools} if tools else {})}
            reply = await super().run(client)
            action: Message = reply if isinstance(reply, dict) else assistant(str(reply))
            result = await self.view.step(action)
            total += result.reward
            self.chat += [action, *result.observation]
            if result.done:
                return total

    async def grade(self, result: Any) -> float:
        return float(result)

    async def close(self) -> None:
        await self.view.close()


async def play_script(script: Script, view: Env, *, timeout_s: float, seed: int | None = None,
                      task: Task | None = None) -> None:
    """Play ``view`` with ``script`` until the episode ends (a scripted seat yields no trajectory)."""
    try:
        async with asyncio.timeout(timeout_s):
            messages, _ = await view.reset(seed=seed, task=task)
            chat = list(messages)
            while True:
                reply = script(list(chat))
                if inspect.isawaitable(reply):
                    reply = await reply
                action: Message = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
                result = await view.step(action)
                chat += [action, *result.observation]
                if result.done:
                    return
    except Exception:  # the episode's failure is the other seats' to report
        log.debug("a scripted seat's episode failed", exc_info=True)
    finally:
        await view.close()


async def play_episode(seating: Seating, players: Mapping[Seat, Player], *, task: Task | None = None,
                       seed: int | None = None, group_id: str = "", sample_index: int = 0, env_name: str = "",
                       timeout_s: float = 300.0) -> dict[Seat, Trajectory]:
    """One episode, every seat played by its player at once: the trajectory of each seat a generator plays, its
    group ``GROUP_ID/SEAT``. A failure of the env or of any seat's player fails every seat's rollout."""
    seats = list(players)
    try:
        envs = {seat: _Outcome(env) for seat, env in (await seating(seats)).items()}
    except Exception as e:  # no episode to play (a server that refused its sessions): this rollout fails, no other
        return {seat: Trajectory(group_id=f"{group_id}/{seat}", sample_index=sample_index, seed=seed,
                                 env_name=env_name, task_id=(task or {}).get("id"), stop_reason="error",
                                 error=f"{type(e).__name__}: {e}", seat=seat)
                for seat in seats if isinstance(players[seat], Generator | AgentPlayer)}

    async def play(seat: Seat) -> Trajectory | None:
        player, view = players[seat], envs[seat]
        if isinstance(player, AgentPlayer):
            player, view = player.policy, AgentTurns(view, player.agent)
        if not isinstance(player, Generator):
            await play_script(player, view, timeout_s=timeout_s, seed=seed, task=task)
            return None
        traj = await player.rollout(lambda: view, task=task, seed=seed, group_id=f"{group_id}/{seat}",
                                    sample_index=sample_index, env_name=env_name)
        traj.seat = seat
        return traj

    t0 = time.perf_counter()
    results = await asyncio.gather(*(play(seat) for seat in seats))
    # a seat the episode ended before had nothing to play: no trajectory, and no failure of the others
    trajs = {seat: t for seat, t in zip(seats, results, strict=True) if t is not None and not envs[seat].no_turn}
    failed = next((t for t in trajs.values() if t.failed and EpisodeAborted.__name__ not in (t.error or "")), None)
    for traj in trajs.values():
        if failed is not None and not traj.failed:  # an episode the env did not finish trains no seat
            traj.stop_reason, traj.error = "error", f"seat {failed.seat!r} failed: {failed.error}"
        traj.timings["episode"] = time.perf_counter() - t0
        traj.outcome = next((env.outcome for env in envs.values() if env.outcome), {})
    return trajs


async def play_starts(seating: Seating, players: Mapping[Seat, Player],
                      starts: Sequence[tuple[Task | None, int | None]], *, samples: int = 1, concurrency: int = 64,
                      env_name: str = "", timeout_s: float = 300.0) -> list[dict[Seat, Trajectory]]:
    """``samples`` episodes of each start, ``concurrency`` at a time, in start order; episodes of one start share a
    group per seat."""
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task | None, seed: int | None, k: int) -> dict[Seat, Trajectory]:
        group = str(task.get("id", f"task-{i}")) if task is not None else f"seed-{seed}"
        async with limit:
            return await play_episode(seating, players, task=task, seed=seed, group_id=group, sample_index=k,
                                      env_name=env_name, timeout_s=timeout_s)

    return list(await asyncio.gather(*(one(i, task, seed, k) for i, (task, seed) in enumerate(starts)
                                       for k in range(samples))))
