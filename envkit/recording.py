"""Episode recordings: every reset and step of an env as one JSON line, written as it happens.

::

    env = envkit.make("guess-number", record="runs/episodes.jsonl")   # or +env.kwargs.record=... in the trainer
    envkit replay runs/episodes.jsonl          # play each episode again against the env: where does it differ?
    envkit.make("replay:runs/episodes.jsonl")  # the recorded episodes played back, no env needed

A line is ``{"kind": "reset" | "step" | "restore" | "error", "episode": ID, ...}``: a reset holds the env's name,
kwargs and tools, the seed or task, the opening messages and info; a step its number, the action (tool calls
included), the observation (tool outputs and sandbox results included), reward, end flags and info; each its
``duration_s``. An env that raises writes an ``error`` line; a restored snapshot starts a new episode whose
``restore`` line names the episode and step it continues. Episodes of concurrent envs interleave in one file, each
line whole (one ``write`` on a file opened for appending).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envkit.core import Env, Snapshot, StepResult, Task, Wrapper
from envkit.errors import EnvError
from envkit.messages import Message
from envkit.tools import Tool

Event = dict[str, Any]


def dumps(value: Any) -> bytes:
    """``value`` as one line of JSON: as the env server writes it (numpy values included), or, without the server
    extra or for a value it refuses, the standard library's JSON with ``repr`` for the rest."""
    try:
        from envkit.remote import wire

        return wire.dumps(value)
    except (ImportError, TypeError, ValueError):
        return json.dumps(value, default=repr).encode()


def as_recorded(value: Any) -> Any:
    """``value`` as a recording holds it: what a replay compares."""
    return json.loads(dumps(value))


class RecordedEnvError(EnvError):
    """A recording cannot be played back: the action differs from the recorded one, or no episode matches."""


class Recorder(Wrapper):
    """Writes every reset and step of ``env`` to ``path`` (JSONL, appended; see the module docstring)."""

    snapshot_exclude = frozenset({"env", "path", "_fd"})

    def __init__(self, env: Env, path: str | os.PathLike[str]) -> None:
        super().__init__(env)
        self.path = Path(path)
        self._fd: int | None = None
        self._episode: str | None = None
        self._step = 0

    def _write(self, event: Event) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._fd, dumps(event) + b"\n")  # one write: a whole line among concurrent envs' lines

    def _failed(self, began: float, e: Exception, **where: Any) -> None:
        self._write({"kind": "error", "episode": self._episode, "step": self._step, **where,
                     "error": f"{type(e).__name__}: {e}", "duration_s": time.perf_counter() - began})

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self._episode, self._step = uuid.uuid4().hex[:16], 0
        spec = self.env.spec
        head: Event = {"kind": "reset", "episode": self._episode, "env": spec.name if spec else None,
                       "kwargs": _recordable(spec.kwargs if spec else {}), "seed": seed, "task": task,
                       "time": time.time()}
        began = time.perf_counter()
        try:
            messages, info = await self.env.reset(seed=seed, task=task)
        except Exception as e:
            self._write(head)
            self._failed(began, e, op="reset")
            raise
        took = time.perf_counter() - began
        self._write({**head, "tools": [t.to_openai() for t in self.env.tools], "observation": messages,
                     "info": info, "duration_s": took})
        return messages, info

    async def step(self, action: Message) -> StepResult:
        self._step += 1
        began = time.perf_counter()
        try:
            result = await self.env.step(action)
        except Exception as e:
            self._failed(began, e, op="step", action=action)
            raise
        self._write({"kind": "step", "episode": self._episode, "step": self._step, "action": action,
                     "observation": result.observation, "reward": result.reward, "terminated": result.terminated,
                     "truncated": result.truncated, "info": result.info,
                     "duration_s": time.perf_counter() - began})
        return result

    async def restore(self, snapshot: Snapshot) -> None:
        await super().restore(snapshot)
        parent, self._episode = self._episode, uuid.uuid4().hex[:16]
        self._write({"kind": "restore", "episode": self._episode, "parent": parent, "after_step": self._step,
                     "time": time.time()})

    async def close(self) -> None:
        try:
            await self.env.close()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _recordable(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs JSON can carry (a replay makes the env with them); objects such as a pool or a rubric are left
    out."""
    out = {}
    for key, value in kwargs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """The events of a recording, in the order written (a line cut short by a crash is skipped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and "kind" in event and "episode" in event:
            events.append(event)
    return events


@dataclass
class Episode:
    """One recorded episode: its reset (or the parent it was restored from) and its steps."""

    id: str
    start: Event
    steps: list[Event] = field(default_factory=list)
    error: Event | None = None


def episodes(events: Iterable[Event]) -> dict[str, Episode]:
    """The episodes of a recording by id, in the order they started."""
    out: dict[str, Episode] = {}
    for event in events:
        kind, episode = event["kind"], event["episode"]
        if kind in ("reset", "restore"):
            out[episode] = Episode(episode, event)
        elif episode in out and kind == "step":
            out[episode].steps.append(event)
        elif episode in out and kind == "error":
            out[episode].error = event
    return out


def lineage(episode: Episode, by_id: dict[str, Episode]) -> tuple[Event, list[Event]]:
    """The reset an episode goes back to and every step from there: a restored episode's parent's steps up to the
    snapshot, then its own."""
    start, steps = episode.start, list(episode.steps)
    seen = {episode.id}
    while start["kind"] == "restore":
        parent = by_id.get(start.get("parent") or "")
        if parent is None or parent.id in seen:
            raise RecordedEnvError(f"episode {episode.id} continues episode {start.get('parent')}, which is not "
                                   "in the recording")
        seen.add(parent.id)
        steps = parent.steps[:start["after_step"]] + steps
        start = parent.start
    return start, steps


class RecordedEnv(Env):
    """A recording played back: ``reset`` opens the next recorded episode (the one with the same seed or task,
    when given), ``step`` answers what was recorded; an action that differs from the recorded one raises
    RecordedEnvError unless ``strict=False``."""

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        self.path, self.strict = Path(path), strict
        by_id = episodes(read_events(self.path))
        self._episodes = []
        for episode in by_id.values():
            with contextlib.suppress(RecordedEnvError):  # continues an episode recorded elsewhere: unplayable
                if episode.error is None:
                    self._episodes.append(lineage(episode, by_id))
        if not self._episodes:
            raise RecordedEnvError(f"{self.path} holds no finished episode to play back")
        self.tools = [Tool.from_openai(t) for t in self._episodes[0][0].get("tools", [])]  # type: ignore[misc]
        self._next = 0
        self._steps: Iterator[Event] = iter(())
        self._step = 0

    def tasks(self, split: str = "train") -> list[Task] | None:
        """The recorded tasks (every split: a recording has no splits), or None when episodes began from seeds."""
        tasks = [start["task"] for start, _ in self._episodes if start.get("task") is not None]
        return tasks or None

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """The opening of the next recorded episode started from ``seed`` or ``task`` (the next one, given neither)."""
        order = self._episodes[self._next:] + self._episodes[:self._next]
        wanted = [e for e in order if (task is None or e[0].get("task") == as_recorded(task))
                  and (seed is None or e[0].get("seed") == seed)]
        if not wanted:
            raise RecordedEnvError(f"no episode in {self.path} starts from seed {seed} / task {task}")
        start, steps = wanted[0]
        self._next = (self._episodes.index(wanted[0]) + 1) % len(self._episodes)
        self._steps, self._step = iter(steps), 0
        return start["observation"], start["info"]

    async def step(self, action: Message) -> StepResult:
        """The recorded answer to the recorded action."""
        self._step += 1
        recorded = next(self._steps, None)
        if recorded is None:
            raise RecordedEnvError(f"the recording has no step {self._step} in this episode")
        if self.strict and as_recorded(action) != recorded["action"]:
            raise RecordedEnvError(f"step {self._step}: the action differs from the recorded one: "
                                   f"{json.dumps(as_recorded(action))[:200]} against "
                                   f"{json.dumps(recorded['action'])[:200]}")
        return StepResult(recorded["observation"], recorded["reward"], terminated=recorded["terminated"],
                          truncated=recorded["truncated"], info=recorded["info"])


@dataclass
class Replayed:
    """How one recorded episode went when played again against its env."""

    episode: str
    env: str
    start: str
    """Its seed or task id."""
    steps: int
    """Steps that went as recorded."""
    difference: str | None = None
    """The first thing that went otherwise (``"step 3: reward was 0.0, replayed 1.0"``); None: none did."""


async def replay(path: str | os.PathLike[str], *, make: Callable[..., Env], env: str | None = None,
                 kwargs: dict[str, Any] | None = None, only: Iterable[str] = (), ignore_info: Iterable[str] = ()
                 ) -> list[Replayed]:
    """Play each recorded episode (or those ``only`` names) again in a fresh env, made by ``make`` (``envkit.make``:
    ``make(name, **kwargs)``) as recorded (or as ``env`` with ``kwargs``), with the recorded seed or task and actions;
    each answer is compared with the recorded one (``ignore_info``: info keys that may differ, such as timings)."""
    by_id = episodes(read_events(path))
    wanted = set(only)
    out = []
    for episode in by_id.values():
        if wanted and episode.id not in wanted:
            continue
        try:
            start, steps = lineage(episode, by_id)
        except RecordedEnvError as e:
            out.append(Replayed(episode.id, env or "?", "?", 0, f"cannot replay: {e}"))
            continue
        name = env or start.get("env")
        if not name:
            raise RecordedEnvError(f"episode {episode.id} does not name its env: replay it with env=")
        made = make(name, **(start.get("kwargs", {}) if kwargs is None else kwargs))
        task = start.get("task")
        began = f"seed {start.get('seed')}" if task is None else f"task {task.get('id', '?')}"
        try:
            difference, done = await _replay_one(made, episode, start, steps, frozenset(ignore_info))
        finally:
            await made.close()
        out.append(Replayed(episode.id, name, began, done, difference))
    return out


async def _replay_one(env: Env, episode: Episode, start: Event, steps: list[Event], ignore: frozenset[str]
                      ) -> tuple[str | None, int]:
    """The first difference between ``env`` and the recording, and the steps that went the same before it."""
    failure = episode.error
    try:
        messages, info = await env.reset(seed=start.get("seed"), task=start.get("task"))
    except Exception as e:
        if failure is not None and failure.get("op") == "reset" and _same_error(failure, e):
            return None, 0
        return f"reset raised {type(e).__name__}: {e}", 0
    if failure is not None and failure.get("op") == "reset":
        return f"reset: the recorded one raised {failure['error']}, the replay did not", 0
    difference = _compare("reset", start, {"observation": messages, "info": info}, ignore)
    if difference:
        return difference, 0
    done = 0
    for event in steps:
        try:
            result = await env.step(event["action"])
        except Exception as e:
            return f"step {event['step']} raised {type(e).__name__}: {e}", done
        difference = _compare(f"step {event['step']}", event, {
            "observation": result.observation, "reward": result.reward, "terminated": result.terminated,
            "truncated": result.truncated, "info": result.info}, ignore)
        if difference:
            return difference, done
        done += 1
    if failure is not None and failure.get("op") == "step":
        return await _replay_failed_step(env, failure), done
    return None, done


async def _replay_failed_step(env: Env, failure: Event) -> str | None:
    """The difference in replaying the step the recording ended with, which raised: None where it raises the same."""
    try:
        await env.step(failure["action"])
    except Exception as e:
        if _same_error(failure, e):
            return None
        return f"step {failure['step']} raised {type(e).__name__}: {e}, the recorded one {failure['error']}"
    return f"step {failure['step']}: the recorded one raised {failure['error']}, the replay did not"


def _same_error(recorded: Event, e: Exception) -> bool:
    return str(recorded.get("error", "")).partition(":")[0] == type(e).__name__


def _compare(where: str, recorded: Event, replayed: dict[str, Any], ignore: frozenset[str]) -> str | None:
    for key, value in replayed.items():
        want, got = recorded.get(key), as_recorded(value)
        if key == "info" and isinstance(want, dict) and isinstance(got, dict):
            want = {k: v for k, v in want.items() if k not in ignore}
            got = {k: v for k, v in got.items() if k not in ignore}
        if want != got:
            return f"{where}: {key} was {_short(want)}, replayed {_short(got)}"
    return None


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def make_replay(name: str, **kwargs: Any) -> RecordedEnv:
    """The ``replay`` scheme of ``envkit.make``: ``replay:PATH`` plays back the recording at PATH."""
    return RecordedEnv(name.partition(":")[2], **kwargs)
