"""Episode recordings (`envkit.make(name, record=FILE)`): every reset and step written whole as it happens, replayed
against the env by `envkit replay` (which names the first step that goes otherwise), and played back without the
env (`envkit.make("replay:FILE")`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import envkit
from envkit import Env, Message, StepResult, Task
from envkit.recording import RecordedEnvError, read_events, replay

TESTS = Path(__file__).resolve().parent
WITH_TESTS = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
              "COLUMNS": "200"}


class DriftingEnv(Env):
    """Counts the turns back to the model, but its second answer carries the clock: an env that does not repeat."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self.turn = 0
        return [envkit.user(f"count with me from {seed}")], {}

    async def step(self, action: Message) -> StepResult:
        self.turn += 1
        said = f"turn {self.turn}" + (f" at {time.time_ns()}" if self.turn == 2 else "")
        return StepResult([envkit.user(said)], reward=float(self.turn), terminated=self.turn == 3)


SLOW_S = 0.05
"""How long SlowEnv takes for a reset or a step: a sleep lasts at least that, so a measured duration is at least
that (no upper bound: a loaded machine may take any time longer)."""


class SlowEnv(Env):
    """Takes :data:`SLOW_S` to open an episode and to answer each step: an env whose durations are known."""

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        await asyncio.sleep(SLOW_S)
        return [envkit.user("wait for it")], {}

    async def step(self, action: Message) -> StepResult:
        await asyncio.sleep(SLOW_S)
        return StepResult([envkit.user("waited")], reward=1.0, terminated=False)


def call(expression: str) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                       "arguments": json.dumps({"expression": expression})}}]}


def envkit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envkit", *args], capture_output=True, text=True, timeout=120,
                          env=WITH_TESTS)


async def guesses(env: Env, seed: int, guesses: list[str]) -> list[StepResult]:
    await env.reset(seed=seed)
    out = []
    for guess in guesses:
        out.append(await env.step(envkit.assistant(guess)))
        if out[-1].done:
            break
    return out


async def test_concurrent_episodes_are_recorded_whole_and_replay_the_same(tmp_path: Path):
    """Eight guess-number episodes at once and a calculator episode with tool calls, in one file: every line is a
    whole event, each episode's steps in order; `envkit replay` plays each again and finds them the same."""
    path = tmp_path / "episodes.jsonl"
    envs = [envkit.make("guess-number", record=path) for _ in range(8)]
    await asyncio.gather(*(guesses(env, seed, ["50", "25", "75", "hmm"]) for seed, env in enumerate(envs)))
    calculator = envkit.make("calculator", record=path)
    await calculator.reset(seed=1)
    await calculator.step(call("6*7"))
    await calculator.step(envkit.assistant("The answer is 42."))
    await asyncio.gather(*(env.close() for env in [*envs, calculator]))

    events = read_events(path)
    assert len(events) == len(path.read_text().splitlines())
    by_episode: dict[str, list[dict]] = {}
    for event in events:
        by_episode.setdefault(event["episode"], []).append(event)
    assert len(by_episode) == 9
    for steps in by_episode.values():
        assert steps[0]["kind"] == "reset" and [e["step"] for e in steps[1:]] == list(range(1, len(steps)))
        assert all(isinstance(e["duration_s"], float) for e in steps)  # its value: test_a_slow_step_records_...
    tool_episode = next(s for s in by_episode.values() if s[0]["env"] == "calculator")
    assert tool_episode[0]["tools"][0]["function"]["name"] == "calculator"
    assert tool_episode[1]["action"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert tool_episode[1]["observation"][0]["role"] == "tool" and "42" in tool_episode[1]["observation"][0]["content"]

    out = envkit_cli("replay", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("same") == 9 and "differs" not in out.stdout


async def test_a_slow_step_records_how_long_it_took(tmp_path: Path):
    """Each reset and step line carries the time the env took: an env that sleeps 50 ms a call is recorded at 50 ms
    or more."""
    path = tmp_path / "slow.jsonl"
    env = envkit.make("test_recording:SlowEnv", record=path)
    await env.reset(seed=0)
    for _ in range(2):
        await env.step(envkit.assistant("and?"))
    await env.close()
    events = read_events(path)
    assert [e["kind"] for e in events] == ["reset", "step", "step"]
    assert all(e["duration_s"] >= SLOW_S for e in events), [e["duration_s"] for e in events]


def test_replay_names_the_step_where_an_env_stops_repeating(tmp_path: Path):
    """A deliberately nondeterministic env (its second answer carries the clock) is recorded and replayed: the replay
    says the episode differs at step 2, in the observation, and exits 1."""
    path = tmp_path / "drift.jsonl"
    with envkit.SyncEnv(envkit.make("test_recording:DriftingEnv", record=path)) as env:
        env.reset(seed=7)
        for word in ("one", "two", "three"):
            env.step(word)
    out = envkit_cli("replay", str(path), "--json")
    assert out.returncode == 1, out.stderr
    [result] = json.loads(out.stdout)
    assert result["steps"] == 1 and result["difference"].startswith("step 2: observation was ")
    table = envkit_cli("replay", str(path))
    assert "differs at step 2: observation" in table.stdout and "1 of 1 episode(s)" in table.stderr


async def test_a_recording_plays_back_without_its_env(tmp_path: Path):
    """`replay:FILE` answers the recorded opening and steps for the recorded actions, tools included; an action the
    recording does not have is refused with the step named (or answered anyway with strict=False)."""
    path = tmp_path / "episodes.jsonl"
    env = envkit.make("guess-number", record=path)
    original = await guesses(env, 3, ["50", "25", "75"])
    opening = (await env.reset(seed=4))[0]
    await env.close()
    played = envkit.make(f"replay:{path}")
    assert (await played.reset(seed=4))[0] == opening
    again = await guesses(played, 3, ["50", "25", "75"])
    assert [(r.observation, r.reward, r.done) for r in again] == [(r.observation, r.reward, r.done) for r in original]
    await played.reset(seed=3)
    await played.step(envkit.assistant("50"))
    with pytest.raises(RecordedEnvError, match="step 2: the action differs from the recorded one"):
        await played.step(envkit.assistant("26"))
    loose = envkit.make(f"replay:{path}", strict=False)
    await loose.reset(seed=3)
    assert (await loose.step(envkit.assistant("99"))).observation == original[0].observation
    with pytest.raises(RecordedEnvError, match=r"no episode .* starts from seed 9"):
        await loose.reset(seed=9)


async def test_a_failed_step_and_a_restored_snapshot_replay_too(tmp_path: Path):
    """A step that raised is recorded as an error, and its replay raising the same is no difference; an episode
    continued from a snapshot replays from its parent's start."""
    path = tmp_path / "episodes.jsonl"
    crashy = envkit.make("remote_envs:ScriptedEnv", record=path)
    await crashy.reset(seed=1)
    await crashy.step(envkit.assistant("hello"))
    with pytest.raises(RuntimeError):
        await crashy.step(envkit.assistant("crash"))
    await crashy.close()
    first, second = (envkit.make("guess-number", record=path) for _ in range(2))
    await first.reset(seed=5)
    await first.step(envkit.assistant("50"))
    snapshot = await first.snapshot()
    await first.step(envkit.assistant("25"))
    await second.restore(snapshot)
    await second.step(envkit.assistant("75"))
    await second.step(envkit.assistant("60"))
    await asyncio.gather(first.close(), second.close())
    restore = next(e for e in read_events(path) if e["kind"] == "restore")
    assert restore["after_step"] == 1
    results = {r.episode: r for r in await replay(path, make=envkit.make)}
    assert all(r.difference is None for r in results.values()), results
    assert results[restore["episode"]].steps == 3 and results[restore["parent"]].steps == 2
