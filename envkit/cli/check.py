"""``envkit check NAME``: the conformance checks an env author runs before publishing an env.

It plays a few short episodes: from seeds, with scripted assistant replies ("The answer is 0.", then 1, ...); from
the first train tasks, with the env's own demonstrations where it offers them (``Env.demonstrate``: tool calls and
right answers), else the scripted replies. Other plays of the same start replay the same replies. Each check gives
one row, named in :data:`CHECKS`:

    contract          episodes from several seeds (and the first train tasks) run under the ContractChecker
    same start        a fresh env given the same seed or task opens the same way
    close twice       ``close`` is idempotent, after an episode and on an env never used
    isolated sessions the same episodes, played by several envs at once with their turns interleaved, go as they
                      went alone: no state is shared between instances
    ws round trip     the same episodes through ``envkit serve`` over ws:// give the same messages and rewards
    snapshot          each episode snapshotted after its first step: a fresh env restored from it, and the env
                      itself restored after it went on, play the rest as the episode went (skipped for an env
                      that cannot snapshot: ``Env.snapshot`` raised SnapshotError)
    disjoint splits   every listed task has a string ``id``, unique, and no task is in two splits (ids or contents)
    reward range      every reward seen lies in the env's declared ``reward_range``
    speed             reset latency and steps/s (reported, never failed)

A multi-agent env gets rows of its own (seats, private views, a ws:// session per seat: envkit/cli/check_seats.py).
A failing row makes ``envkit check`` exit 1; the table names it with what went wrong.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import envkit
from envkit.agents.agent import AgentEnv
from envkit.core import Env, Task
from envkit.distribution import install_hint
from envkit.errors import SnapshotError

CHECKS = ("contract", "same start", "close twice", "isolated sessions", "ws round trip", "snapshot",
          "disjoint splits", "reward range", "speed")
SPLITS = ("train", "test")
TASKS_COMPARED = 5000
"""Tasks of each split read for the disjointness check (a split may be generated without end)."""

Status = Literal["pass", "fail", "skip", "info"]
ResetArgs = dict[str, Any]
"""How an episode starts: ``{"seed": s}`` or ``{"task": t}``."""
Outcome = tuple[Status, str]


@dataclass
class Row:
    """One check's outcome."""

    check: str
    status: Status
    detail: str


@dataclass
class Episode:
    """What an episode showed: the opening messages, then each step's observation, reward and end flags."""

    start: ResetArgs
    actions: list[envkit.Message] = field(default_factory=list)
    transcript: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reset_s: float = 0.0
    step_s: float = 0.0


def action(k: int) -> envkit.Message:
    """The scripted reply at turn ``k``: a final answer most envs grade, so episodes stay short."""
    return envkit.assistant(f"The answer is {k}.")


def as_json(value: Any) -> Any:
    """``value`` as it would cross the wire (numpy scalars and arrays, tuples, ...): what two runs must agree on."""
    try:
        from envkit.remote import wire
    except ImportError:  # no server extra: the standard library's JSON, with what it cannot write as text
        return json.loads(json.dumps(value, default=repr))
    return wire.loads(wire.dumps(value))


async def play(env: Env, start: ResetArgs, max_steps: int, *, replay: list[envkit.Message] | None = None,
               demonstrate: bool = False, turn: Callable[[], Awaitable[None]] | None = None) -> Episode:
    """One episode from ``start``, at most ``max_steps`` steps: the env's own demonstrations where asked for and
    offered, else the scripted replies; or ``replay``'s replies. ``turn`` is awaited before each call, so concurrent
    episodes can take turns."""
    episode = Episode(start)
    if turn:
        await turn()
    began = time.perf_counter()
    messages, _ = await env.reset(seed=start.get("seed"), task=start.get("task"))
    episode.reset_s = time.perf_counter() - began
    episode.transcript.append(as_json(messages))
    history = list(messages)
    if isinstance(env.unwrapped, AgentEnv):  # its agent plays the episode, through a generator's gateway
        max_steps = 0
    for k in range(max_steps if replay is None else len(replay)):
        reply = replay[k] if replay is not None else await _reply(env, history, k, demonstrate)
        if turn:
            await turn()
        result = await step(env, reply, episode)
        history += [reply, *result.observation]
        if result.done:
            break
    return episode


async def step(env: Env, reply: envkit.Message, episode: Episode) -> envkit.StepResult:
    """One step of ``episode``, recorded in it."""
    episode.actions.append(reply)
    began = time.perf_counter()
    result = await env.step(reply)
    episode.step_s += time.perf_counter() - began
    episode.rewards.append(float(result.reward))
    episode.transcript.append(as_json([result.observation, result.reward, result.terminated, result.truncated]))
    return result


async def go_on(env: Env, first: Episode, start: int) -> Episode:
    """``first``'s steps from ``start`` on, replayed in ``env`` where the episode stands after ``start`` steps; the
    transcript holds the opening messages of ``first``, so that :func:`first_difference` counts steps alike."""
    episode = Episode(first.start, transcript=first.transcript[:start + 1])
    for reply in first.actions[start:]:
        if (await step(env, reply, episode)).done:
            break
    return episode


async def _reply(env: Env, history: list[envkit.Message], k: int, demonstrate: bool) -> envkit.Message:
    if demonstrate:
        try:
            return await env.demonstrate(history)
        except NotImplementedError:
            pass
    return action(k)


def first_difference(a: Episode, b: Episode) -> str:
    """Where two plays of one start part: "the opening messages" or "step k"."""
    for k, (x, y) in enumerate(zip(a.transcript, b.transcript, strict=False)):
        if x != y:
            return "the opening messages" if k == 0 else f"step {k}"
    return f"the episode's length ({len(a.transcript) - 1} steps against {len(b.transcript) - 1})"


def describe(start: ResetArgs) -> str:
    """A start as the table shows it."""
    return f"seed {start['seed']}" if "seed" in start else f"task {start['task'].get('id')!r}"


class Checker:
    """The checks of one env, made as ``envkit.make(name, **kwargs)``."""

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None, *, seeds: int = 3, max_steps: int = 8,
                 serve: bool = True) -> None:
        self.name, self.kwargs = name, dict(kwargs or {})
        self.seeds, self.max_steps, self.serve = seeds, max_steps, serve
        self.rewards: list[float] = []
        self.reward_range: tuple[float, float] = (-math.inf, math.inf)

    def make(self) -> Env:
        """A fresh env under test."""
        return envkit.make(self.name, **self.kwargs)

    async def run(self) -> list[Row]:
        """Every check, in :data:`CHECKS` order. A check that cannot run is failed, not skipped: the env
        raised."""
        probe = self.make()
        self.reward_range = probe.reward_range
        tasks = {split: self._tasks(probe, split) for split in SPLITS}
        await probe.close()
        starts: list[ResetArgs] = [{"seed": s} for s in range(self.seeds)]
        starts += [{"task": t} for t in (tasks["train"] or [])[:2]]
        rows: list[Row] = []
        alone: list[Episode] = []
        try:
            alone = [await self._play_alone(s) for s in starts]
            agent = (" (an agent env: only reset is checked; its agent plays episodes through a generator, as "
                     "`envkit eval` runs them)") if isinstance(probe.unwrapped, AgentEnv) else ""
            rows.append(Row("contract", "pass", f"{len(alone)} episodes from {', '.join(map(describe, starts))}; "
                                                f"{sum(len(e.rewards) for e in alone)} steps{agent}"))
        except Exception as e:
            rows.append(Row("contract", "fail", _failure(e)))
        rows.append(await _guarded("close twice", self._close_twice(starts[0])))
        rows.append(await _guarded("same start", self._same_start(alone)) if alone
                    else Row("same start", "skip", "no episode ran (see contract)"))
        repeats = rows[-1].status == "pass"
        for title, check in (("isolated sessions", self._isolated), ("ws round trip", self._ws_round_trip),
                             ("snapshot", self._snapshot)):
            # both compare other plays of a start with the first one, which only a deterministic env repeats
            rows.append(await _guarded(title, check(alone)) if repeats
                        else Row(title, "skip", "needs the same start (see it)"))
        rows.append(Row("disjoint splits", *self._disjoint(tasks)))
        rows.append(Row("reward range", *self._in_range()))
        rows.append(Row("speed", *self._speed(alone)))
        return [next(r for r in rows if r.check == name) for name in CHECKS]

    def _tasks(self, env: Env, split: str) -> list[Task] | None:
        try:
            listed = env.tasks(split)
        except ValueError:
            return None
        if listed is None:
            return None
        out: list[Task] = []
        for task in listed:
            out.append(task)
            if len(out) >= TASKS_COMPARED:
                break
        return out

    async def _play_alone(self, start: ResetArgs) -> Episode:
        env = self.make()
        try:
            episode = await play(env, start, self.max_steps, demonstrate="task" in start)
        except Exception as e:
            raise CheckError(f"{describe(start)}: {_failure(e)}") from e
        finally:
            await env.close()
        self.rewards += episode.rewards
        return episode

    async def _same_start(self, alone: list[Episode]) -> Outcome:
        for first in alone:
            start = first.start
            env = self.make()
            try:
                messages, _ = await env.reset(seed=start.get("seed"), task=start.get("task"))
            finally:
                await env.close()
            if as_json(messages) != first.transcript[0]:
                return "fail", (f"{describe(start)} opened differently in a fresh env: "
                                f"{_short(first.transcript[0])} then {_short(as_json(messages))}")
        return "pass", f"{len(alone)} starts opened the same way twice"

    async def _close_twice(self, start: ResetArgs) -> Outcome:
        # the env itself: make()'s ContractChecker would not pass a second close on
        used = envkit.make(self.name, checked=False, **self.kwargs)
        try:
            await used.reset(seed=start.get("seed"), task=start.get("task"))
        finally:
            await used.close()
        await used.close()
        unused = envkit.make(self.name, checked=False, **self.kwargs)
        await unused.close()
        await unused.close()
        return "pass", "after an episode, and on an env never used"

    async def _isolated(self, alone: list[Episode]) -> Outcome:
        envs = [self.make() for _ in alone]
        ready = asyncio.Event()
        waiting = 0

        async def turn() -> None:  # every session resets before any steps, then they step in turn
            nonlocal waiting
            if not ready.is_set():
                waiting += 1
                if waiting == len(envs):
                    ready.set()
                await ready.wait()
            await asyncio.sleep(0)

        try:
            together = await asyncio.gather(*(play(env, first.start, self.max_steps, replay=first.actions, turn=turn)
                                              for env, first in zip(envs, alone, strict=True)))
        finally:
            await asyncio.gather(*(env.close() for env in envs))
        for first, again in zip(alone, together, strict=True):
            self.rewards += again.rewards
            if again.transcript != first.transcript:
                return "fail", (f"{describe(first.start)} went differently at {first_difference(first, again)} "
                                f"with {len(envs)} envs playing at once than alone: instances share state")
        return "pass", f"{len(envs)} envs at once, turns interleaved, each as alone"

    async def _ws_round_trip(self, alone: list[Episode]) -> Outcome:
        if not self.serve:
            return "skip", "--no-serve"
        if "sandbox" in self.kwargs or "://" in self.name:
            return "skip", "the env already runs behind a server (a sandbox's, or the URL's)"
        if importlib.util.find_spec("fastapi") is None:
            return "skip", f"envkit serve needs the server extra: {install_hint('server')}"
        # envkit serve in a child process (the local sandbox), over ws://: one session plays every episode
        async with envkit.make(self.name, sandbox="local", **self.kwargs) as remote:
            for first in alone:
                again = await play(remote, first.start, self.max_steps, replay=first.actions)
                if again.transcript != first.transcript:
                    return "fail", f"{describe(first.start)} differs over ws:// at {first_difference(first, again)}"
        return "pass", f"{len(alone)} episodes through envkit serve, in one ws:// session, as in-process"

    async def _snapshot(self, alone: list[Episode]) -> Outcome:
        episodes = [e for e in alone if len(e.actions) >= 2]
        if not episodes:
            return "skip", "no episode ran two steps to snapshot between"
        took: list[float] = []
        for first in episodes:
            env, fresh = self.make(), self.make()
            try:
                await play(env, first.start, 0, replay=first.actions[:1])
                began = time.perf_counter()
                try:
                    snapshot = await env.snapshot()
                except SnapshotError as e:
                    return "skip", f"the env cannot snapshot its state: {e}"
                took.append(time.perf_counter() - began)
                plays = {"the env that was snapshotted": await go_on(env, first, 1)}
                for label, target in (("a fresh env restored from it", fresh), ("the env restored", env)):
                    began = time.perf_counter()
                    await target.restore(snapshot)
                    took.append(time.perf_counter() - began)
                    plays[label] = await go_on(target, first, 1)
            finally:
                await asyncio.gather(env.close(), fresh.close())
            for label, again in plays.items():
                if again.transcript != first.transcript:
                    return "fail", (f"{describe(first.start)}, snapshotted after step 1: {label} went differently at "
                                    f"{first_difference(first, again)}")
        return "pass", (f"{len(episodes)} episodes, each snapshotted after step 1 and restored twice; "
                        f"{1000 * sum(took) / len(took):.2f} ms a snapshot or restore")

    @staticmethod
    def _disjoint(tasks: dict[str, list[Task] | None]) -> Outcome:
        listed = {split: t for split, t in tasks.items() if t is not None}
        if not listed:
            return "skip", "the env lists no tasks (episodes are drawn by seed)"
        contents: dict[str, set[str]] = {}
        for split, split_tasks in listed.items():
            ids: set[str] = set()
            for i, task in enumerate(split_tasks):
                task_id = task.get("id") if isinstance(task, dict) else None
                if not isinstance(task_id, str):
                    return "fail", f"{split} task {i} has no string id: {_short(task)}"
                if task_id in ids:
                    return "fail", f"{split} lists id {task_id!r} twice"
                ids.add(task_id)
            contents[split] = {json.dumps(as_json({k: v for k, v in t.items() if k != "id"}), sort_keys=True)
                               for t in split_tasks}
        names = list(listed)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                shared_ids = {t["id"] for t in listed[a]} & {t["id"] for t in listed[b]}
                shared = contents[a] & contents[b]
                if shared_ids or shared:
                    example = sorted(shared_ids)[0] if shared_ids else sorted(shared)[0]
                    return "fail", (f"{len(shared_ids)} ids and {len(shared)} tasks are in both {a} and {b}, "
                                    f"e.g. {example[:160]}")
        counts = ", ".join(f"{split} {len(t)}" for split, t in listed.items())
        return "pass", f"{counts} tasks (the first {TASKS_COMPARED} at most): ids unique, no task in two splits"

    def _in_range(self) -> Outcome:
        low, high = self.reward_range
        if not self.rewards:
            return "skip", "no step ran"
        seen = f"rewards seen {min(self.rewards):g} .. {max(self.rewards):g}"
        outside = [r for r in self.rewards if not low <= r <= high]
        if outside:
            return "fail", f"{seen}, outside the declared reward_range [{low:g}, {high:g}]"
        if math.isinf(low) and math.isinf(high):
            return "pass", f"{seen}; the env declares no reward_range"
        return "pass", f"{seen}, within [{low:g}, {high:g}]"

    @staticmethod
    def _speed(alone: list[Episode]) -> Outcome:
        if not alone:
            return "skip", "no episode ran"
        steps = sum(len(e.rewards) for e in alone)
        step_s = sum(e.step_s for e in alone)
        reset_ms = 1000 * sum(e.reset_s for e in alone) / len(alone)
        rate = f"{steps / step_s:,.3g} steps/s" if step_s > 0 else "steps too fast to time"
        return "info", f"reset {reset_ms:.2f} ms on average; {rate} (in-process, one env)"


class CheckError(Exception):
    """A check's failure, with the row's detail as its message."""


def _failure(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckError) else f"{type(e).__name__}: {e}"


async def _guarded(title: str, check: Awaitable[Outcome]) -> Row:
    """The check's row, or a failed one naming what the env raised."""
    try:
        return Row(title, *await check)
    except Exception as e:
        return Row(title, "fail", _failure(e))


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def check(name: str, kwargs: dict[str, Any] | None = None, **options: Any) -> list[Row]:
    """Run every check on ``envkit.make(name, **kwargs)`` (``options``: seeds, max_steps, serve); a multi-agent env's
    are :func:`envkit.cli.check_seats.check_seats`."""
    return asyncio.run(Checker(name, kwargs, **options).run())


def failed(rows: Iterable[Row]) -> list[Row]:
    """The failing rows."""
    return [r for r in rows if r.status == "fail"]
