"""Envs that each break one promise `envkit check` holds an env to (served as `broken_envs:NAME` with tests/ on
PYTHONPATH). Apart from that one flaw each is a correct guessing game: of one turn, or of three where the promise
needs an episode of several (a snapshot is taken between two steps)."""

from __future__ import annotations

import random
from typing import ClassVar

import envkit
from envkit import Env, Message, Snapshot, StepResult, Task


class GuessEnv(Env):
    """Say the word: reward 1 for it, 0 for anything else; one turn. Tasks: 20 train and 10 test words."""

    reward_range = (0.0, 1.0)

    def __init__(self) -> None:
        self.word = ""
        self.closed = 0

    def opening(self, seed: int | None, task: Task | None) -> str:
        return task["word"] if task else f"w{seed}"

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self.word = self.opening(seed, task)
        return [envkit.user(f"say {self.word}")], {}

    async def step(self, action: Message) -> StepResult:
        return StepResult([], reward=self.reward(action), terminated=True)

    def reward(self, action: Message) -> float:
        return float(action.get("content") == self.word)

    async def demonstrate(self, messages: list[Message]) -> Message:
        return envkit.assistant(self.word)

    async def close(self) -> None:
        self.closed += 1

    def tasks(self, split: str = "train") -> list[Task]:
        start, count = {"train": (0, 20), "test": (100, 10)}[split]
        return [{"id": f"{split}-{i}", "word": f"t{start + i}"} for i in range(count)]


class NondeterministicEnv(GuessEnv):
    """Draws its word from the global RNG, whatever the seed."""

    def opening(self, seed: int | None, task: Task | None) -> str:
        return f"w{random.randrange(10**9)}"


class CloseTwiceEnv(GuessEnv):
    """Raises when closed a second time."""

    async def close(self) -> None:
        await super().close()
        if self.closed > 1:
            raise RuntimeError("already closed")


class LeakyEnv(GuessEnv):
    """Keeps the word on the class: every instance grades against the word of the last reset, any instance's."""

    shared: ClassVar[dict[str, str]] = {}

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        messages, info = await super().reset(seed=seed, task=task)
        LeakyEnv.shared["word"] = self.word
        return messages, info

    def reward(self, action: Message) -> float:
        return float(action.get("content") == LeakyEnv.shared["word"])


class OverlappingSplitsEnv(GuessEnv):
    """Its test split repeats a train task under another id (the reasoning-gym seed + 1 trap)."""

    def tasks(self, split: str = "train") -> list[Task]:
        tasks = super().tasks(split)
        return [*tasks, {"id": "test-extra", "word": "t3"}] if split == "test" else tasks


class OutOfRangeEnv(GuessEnv):
    """Pays 2 for the right word while declaring rewards in [0, 1]."""

    def reward(self, action: Message) -> float:
        return 2 * super().reward(action)


class ForgetfulRestoreEnv(GuessEnv):
    """Three guesses at the word; its restore puts the word back but keeps the guesses this instance had made (a
    field its author forgot), so a restored episode does not end where the original did."""

    def __init__(self) -> None:
        super().__init__()
        self.guesses = 0

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self.guesses = 0
        return await super().reset(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        self.guesses += 1
        reward = self.reward(action)
        done = reward == 1.0 or self.guesses == 3
        return StepResult([] if done else [envkit.user("guess again")], reward=reward, terminated=done)

    async def restore(self, snapshot: Snapshot) -> None:
        guesses = self.guesses
        await super().restore(snapshot)
        self.guesses = guesses
