"""``envkit check NAME`` for a multi-agent env (:class:`~envkit.multi_agent.MultiAgentEnv`): the same idea as
envkit/cli/check.py, with rows of its own. Every seat's player is scripted: at its k-th turn it replies "The answer
is k." (or the env's first option word, where that makes episodes end sooner it is the env's business). Each check
gives one row, named in :data:`SEAT_CHECKS`:

    contract         episodes from several seeds (and the first train tasks) under the SeatsChecker
    seats            the seats, who acted and how turns went (alternating, simultaneous, env-chosen)
    same start       a fresh env given the same seed or task opens every seat's view the same way
    private views    each seat's view, played through envkit's Table as a trainer plays it, is exactly what the env
                     addressed to that seat; and no seat's view holds another seat's secrets
                     (``MultiAgentEnv.secrets``: what only that seat may see)
    ws round trip    the same episodes through ``envkit serve`` over ws://, a session per seat, give every seat the
                     same view and rewards
    snapshot         each episode snapshotted after its first step, restored into a fresh env, plays on the same
    reward range     every reward seen lies in the env's declared ``reward_range``
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import envkit
from envkit.cli.check import Checker, Outcome, ResetArgs, Row, _guarded, as_json, describe
from envkit.core import Env, Task
from envkit.errors import EpisodeDoneError, SnapshotError
from envkit.multi_agent import MultiAgentEnv, Seat, Turn
from envkit.table import Table

SEAT_CHECKS = ("contract", "seats", "same start", "private views", "ws round trip", "snapshot", "reward range")


def reply(k: int) -> envkit.Message:
    """A seat's scripted reply at its k-th turn."""
    return envkit.assistant(f"The answer is {k}.")


@dataclass
class SeatEpisode:
    """What a multi-agent episode showed: each step's actions, and each seat's view (messages, rewards)."""

    start: ResetArgs
    turns: list[tuple[str, ...]] = field(default_factory=list)
    """The seats to act, at each step."""
    views: dict[Seat, list[Any]] = field(default_factory=dict)
    """Per seat: the messages the env addressed to it, and its rewards, in order."""
    rewards: list[float] = field(default_factory=list)
    secrets: dict[Seat, list[str]] = field(default_factory=dict)
    """What the env said only each seat may see, in this episode."""

    def see(self, turn: Turn) -> None:
        for seat, messages in turn.observations.items():
            self.views.setdefault(seat, []).append(as_json(messages))
        for seat, reward in turn.rewards.items():
            self.views.setdefault(seat, []).append(float(reward))
            self.rewards.append(float(reward))
        if turn.to_act:
            self.turns.append(tuple(turn.to_act))


async def play(env: MultiAgentEnv, start: ResetArgs, max_steps: int, *, after: int | None = None) -> SeatEpisode:
    """One episode from ``start`` with scripted replies, at most ``max_steps`` steps (``after``: stop there)."""
    episode = SeatEpisode(start)
    turn = await env.reset(seed=start.get("seed"), task=start.get("task"))
    episode.see(turn)
    episode.secrets = {seat: env.secrets(seat) for seat in env.seats}
    played: dict[Seat, int] = {}
    for _ in range(max_steps if after is None else after):
        if turn.done:
            break
        turn = await env.step({seat: reply(_count(played, seat)) for seat in turn.to_act})
        episode.see(turn)
    return episode


def _count(played: dict[Seat, int], seat: Seat) -> int:
    k = played.get(seat, 0)
    played[seat] = k + 1
    return k


async def play_views(views: dict[Seat, Env], start: ResetArgs) -> dict[Seat, list[Any]]:
    """Every seat's view played at once by its scripted player: what each seat was shown, and its rewards."""
    shown: dict[Seat, list[Any]] = {seat: [] for seat in views}

    async def seat_plays(seat: Seat) -> None:
        view = views[seat]
        try:
            messages, _ = await view.reset(seed=start.get("seed"), task=start.get("task"))
        except EpisodeDoneError:  # the episode ended before this seat's first turn
            return
        shown[seat].append(as_json(messages))
        k = 0
        while True:
            result = await view.step(reply(k))
            k += 1
            shown[seat] += [as_json(result.observation), float(result.reward)] if result.observation else [
                float(result.reward)]
            if result.done:
                return

    try:
        await asyncio.gather(*(seat_plays(seat) for seat in views))
    finally:
        await asyncio.gather(*(v.close() for v in views.values()), return_exceptions=True)
    return shown


class SeatChecks(Checker):
    """The checks of one multi-agent env, made as ``envkit.make(name, **kwargs)``; the reward range is checked as
    a single-agent env's is."""

    def make(self) -> MultiAgentEnv:  # type: ignore[override]
        env = envkit.make(self.name, **self.kwargs)
        assert isinstance(env, MultiAgentEnv)
        return env

    async def run(self) -> list[Row]:
        """Every check, in :data:`SEAT_CHECKS` order."""
        probe = self.make()
        self.reward_range, self.seats = probe.reward_range, probe.seats
        listed = _first_tasks(probe)
        await probe.close()
        starts: list[ResetArgs] = [{"seed": s} for s in range(self.seeds)] + [{"task": t} for t in listed[:2]]
        rows: list[Row] = []
        alone: list[SeatEpisode] = []
        try:
            for start in starts:
                alone.append(await self._alone(start))
            rows.append(Row("contract", "pass", f"{len(alone)} episodes from {', '.join(map(describe, starts))}; "
                                                f"{sum(len(e.turns) for e in alone)} steps"))
        except Exception as e:
            rows.append(Row("contract", "fail", f"{type(e).__name__}: {e}"))
        rows.append(Row("seats", *self._seats(alone)))
        checks: list[tuple[str, Callable[[list[SeatEpisode]], Awaitable[Outcome]]]] = [
            ("same start", self._same_start), ("private views", self._private), ("ws round trip", self._ws),
            ("snapshot", self._snapshot)]
        for title, check in checks:
            rows.append(await _guarded(title, check(alone)) if alone else Row(title, "skip", "no episode ran"))
        rows.append(Row("reward range", *self._in_range()))
        return rows

    async def _alone(self, start: ResetArgs) -> SeatEpisode:
        env = self.make()
        try:
            episode = await play(env, start, self.max_steps)
        finally:
            await env.close()
        self.rewards += episode.rewards
        return episode

    def _seats(self, alone: list[SeatEpisode]) -> Outcome:
        if not alone:
            return "skip", "no episode ran"
        acted = sorted({seat for e in alone for turn in e.turns for seat in turn})
        never = [s for s in self.seats if s not in acted]
        turns = [turn for e in alone for turn in e.turns]
        order = ("simultaneous" if all(len(t) == len(self.seats) for t in turns)
                 else "alternating" if all(len(t) == 1 for t in turns) and all(
                     a != b for e in alone for a, b in zip(e.turns, e.turns[1:], strict=False))
                 else "env-chosen")
        acting = (f"{never} never acted in these scripted episodes (each ended first)" if never
                  else "every one acted")
        return "pass", f"seats {list(self.seats)}, {acting}; turns {order}"

    async def _same_start(self, alone: list[SeatEpisode]) -> Outcome:
        for first in alone:
            env = self.make()
            try:
                turn = await env.reset(seed=first.start.get("seed"), task=first.start.get("task"))
            finally:
                await env.close()
            if {seat: [as_json(m)] for seat, m in turn.observations.items()} != {
                    seat: view[:1] for seat, view in first.views.items() if seat in turn.observations}:
                return "fail", f"{describe(first.start)} opened differently in a fresh env"
        return "pass", f"{len(alone)} starts opened every seat's view the same way twice"

    async def _private(self, alone: list[SeatEpisode]) -> Outcome:
        declared = 0
        for first in alone:
            for seat, secrets in first.secrets.items():
                declared += len(secrets)
                for other, view in first.views.items():
                    shown = json.dumps(view)
                    leaked = [s for s in secrets if other != seat and json.dumps(s)[1:-1] in shown]
                    if leaked:
                        return "fail", (f"{describe(first.start)}: {other!r} was shown {seat!r}'s secret "
                                        f"{leaked[0][:120]!r}")
            table = Table(self.make())
            shown_through = await play_views({seat: table.view(seat) for seat in self.seats}, first.start)
            played = {seat for seat, view in shown_through.items() if view}  # a seat may have had no turn
            if {s: m for s, m in _messages(shown_through).items() if s in played} != {
                    s: m for s, m in _messages(first.views).items() if s in played}:
                return "fail", (f"{describe(first.start)}: a seat's view through envkit's Table differs from what the "
                                "env addressed to it")
        secrets = (f"{declared} secrets declared, none shown to another seat" if declared
                   else "the env declares no secrets (MultiAgentEnv.secrets)")
        return "pass", f"{len(alone)} episodes: each seat's view through the Table is exactly its own; {secrets}"

    async def _ws(self, alone: list[SeatEpisode]) -> Outcome:
        if not self.serve:
            return "skip", "--no-serve"
        if importlib.util.find_spec("fastapi") is None:
            return "skip", "envkit serve needs the server extra"
        from envkit.remote.client import RemoteEnv

        async with _served(self.name, self.kwargs) as url:
            for first in alone:
                seats = list(self.seats)
                head = RemoteEnv(url, seat=seats[0])
                await head.init()
                views: dict[Seat, Env] = {seats[0]: head}
                for seat in seats[1:]:
                    views[seat] = RemoteEnv(url, seat=seat, table=head.table)
                    await views[seat].init()
                there = await play_views(views, first.start)
                local = Table(self.make())
                here = await play_views({seat: local.view(seat) for seat in seats}, first.start)
                if there != here:
                    return "fail", f"{describe(first.start)} shows a seat another view over ws:// than in-process"
        return "pass", f"{len(alone)} episodes through envkit serve, a ws:// session per seat, as in-process"

    async def _snapshot(self, alone: list[SeatEpisode]) -> Outcome:
        episodes = [e for e in alone if len(e.turns) >= 2]
        if not episodes:
            return "skip", "no episode ran two steps to snapshot between"
        for first in episodes:
            env, fresh = self.make(), self.make()
            try:
                head = await play(env, first.start, self.max_steps, after=1)
                try:
                    snapshot = await env.snapshot()
                except SnapshotError as e:
                    return "skip", f"the env cannot snapshot its state: {e}"
                await fresh.restore(snapshot)
                plays = {"the env that was snapshotted": await self._rest(env, first),
                         "a fresh env restored from it": await self._rest(fresh, first)}
            finally:
                await asyncio.gather(env.close(), fresh.close())
            tail = {seat: view[len(head.views.get(seat, [])):] for seat, view in first.views.items()}
            for label, rest in plays.items():
                if {seat: rest.views.get(seat, []) for seat in tail} != tail:
                    return "fail", f"{describe(first.start)}, snapshotted after step 1: {label} went differently"
        return "pass", f"{len(episodes)} episodes, each snapshotted after step 1 and restored into a fresh env"

    async def _rest(self, env: MultiAgentEnv, first: SeatEpisode) -> SeatEpisode:
        """``first`` played on from its second step in ``env`` (which stands after its first), with its replies."""
        played: dict[Seat, int] = {}
        for seat in first.turns[0]:
            _count(played, seat)
        rest = SeatEpisode(first.start)
        for acted in first.turns[1:]:
            turn = await env.step({seat: reply(_count(played, seat)) for seat in acted})
            rest.see(turn)
            if turn.done:
                break
        return rest


def has_seats(name: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``envkit.make(name, **kwargs)`` is a multi-agent env (whose checks are these)."""
    env = envkit.make(name, **(kwargs or {}))
    asyncio.run(env.close())
    return isinstance(env, MultiAgentEnv)


def check_seats(name: str, kwargs: dict[str, Any] | None = None, **options: Any) -> list[Row]:
    """Run every check of a multi-agent env, ``envkit.make(name, **kwargs)`` (``options``: seeds, max_steps,
    serve)."""
    return asyncio.run(SeatChecks(name, kwargs, **options).run())


def _first_tasks(env: MultiAgentEnv) -> list[Task]:
    try:
        listed = env.tasks("train")
    except ValueError:
        return []
    out: list[Task] = []
    for task in listed or ():
        out.append(task)
        if len(out) == 2:
            break
    return out


def _messages(views: dict[Seat, list[Any]]) -> dict[Seat, list[Any]]:
    """Each seat's messages, in order, rewards left out (a player is shown the messages of several of the env's
    turns at once, between two of its own)."""
    return {seat: [m for part in view if isinstance(part, list) for m in part] for seat, view in views.items()}


@contextlib.asynccontextmanager
async def _served(name: str, kwargs: dict[str, Any]) -> AsyncIterator[str]:
    """``envkit serve NAME`` in a child process on a free loopback port, for as long as the block runs: its ws URL."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "envkit.cli", "serve", name, "--port", str(port)]
    if kwargs:
        argv += ["--kwargs", json.dumps(kwargs)]
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                if process.returncode is not None:
                    raise RuntimeError(f"envkit serve {name} exited with {process.returncode}")
                await asyncio.sleep(0.1)
        yield f"ws://127.0.0.1:{port}/{name}"
    finally:
        process.terminate()
        await process.wait()
