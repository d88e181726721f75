"""GuessNumberEnv: a multi-turn game of finding a secret integer from "Higher." / "Lower." hints."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from envkit import Env, Message, StepResult, Task, extract_answer, system, user
from envkit.errors import ResetNeededError

DEFAULT_SYSTEM_PROMPT = (
    "We are playing a guessing game. Each turn, reply with one whole number as your guess. "
    'I will answer "Higher." or "Lower." until you find my number.'
)

MIN_REWARD = 0.1
"""Reward for a correct guess on the last allowed turn."""


class GuessNumberEnv(Env):
    """Guess a secret integer from "Higher." / "Lower." hints; the fewer guesses, the higher the reward.

    The secret is drawn from ``[low, high]`` (seeded: the same seed gives the same secret). Each turn the last
    number in the reply (see :func:`envkit.extract_answer`) is the guess, and the env answers with a user
    message "Higher." or "Lower.". A reply without a whole number gets a feedback message and
    ``invalid_penalty`` as that turn's reward, and still uses a turn.

    A correct guess on turn ``t`` of ``max_turns`` ends the episode (``terminated``) with reward
    ``MIN_REWARD + (1 - MIN_REWARD) * (max_turns - t) / (max_turns - 1)``: 1.0 on the first turn, falling
    linearly to 0.1 on the last (1.0 when ``max_turns`` is 1). Using up ``max_turns`` without finding the number
    ends it with ``truncated=True`` and reward 0 (``invalid_penalty`` if that last reply had no number).
    The default 7 turns is exactly enough to binary-search 1..100.

    ``reset(task={"secret": n})`` replays a specific secret; tasks are not enumerable (``tasks()`` is None).
    """

    def __init__(
        self,
        *,
        low: int = 1,
        high: int = 100,
        max_turns: int = 7,
        invalid_penalty: float = -0.1,
        system_prompt: str | None = None,
    ) -> None:
        if not (isinstance(low, int) and isinstance(high, int) and low < high):
            raise ValueError(f"low and high must be integers with low < high, got low={low!r}, high={high!r}")
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if not (math.isfinite(invalid_penalty) and invalid_penalty <= 0):
            raise ValueError(f"invalid_penalty must be a finite number <= 0, got {invalid_penalty!r}")
        self.low, self.high, self.max_turns = low, high, max_turns
        self.invalid_penalty = float(invalid_penalty)
        self.reward_range = (self.invalid_penalty, 1.0)
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self._rng = random.Random()
        self._secret: int | None = None
        self.turn = 0

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Pick the secret from ``task["secret"]``, else from ``seed``, else at random, and ask for a guess."""
        if task is not None:
            secret = task.get("secret") if isinstance(task, Mapping) else None
            if not (isinstance(secret, int) and self.low <= secret <= self.high):
                raise ValueError(f"task must have an integer 'secret' in [{self.low}, {self.high}], got {task!r:.120}")
        else:
            secret = (self._rng if seed is None else random.Random(seed)).randint(self.low, self.high)
        self._secret, self.turn = secret, 0
        question = (
            f"I am thinking of a whole number from {self.low} to {self.high}. "
            f"You have {self.max_turns} guesses. What is your first guess?"
        )
        task = {"id": f"{self.low}-{self.high}-{secret}", "low": self.low, "high": self.high, "secret": secret}
        return [system(self.system_prompt), user(question)], {"task": task}

    async def step(self, action: Message) -> StepResult:
        """Score one guess: hint and continue, or end the episode on a hit or when turns run out."""
        if self._secret is None:
            raise ResetNeededError("step() needs an active episode; call reset() first.")
        self.turn += 1
        answer = extract_answer(action.get("content"))
        guess = int(answer.value) if answer is not None and answer.value.is_integer() else None
        info: dict[str, Any] = {"turn": self.turn, "guess": guess}
        if guess == self._secret:
            self._secret = None
            return StepResult([], reward=self.reward_for(self.turn), terminated=True, info={**info, "correct": True})
        if guess is None:
            reward = self.invalid_penalty
            feedback = f"I found no whole number in your reply. Reply with one number from {self.low} to {self.high}."
        else:
            reward = 0.0
            feedback = "Higher." if guess < self._secret else "Lower."
        info["correct"] = False
        if self.turn >= self.max_turns:
            info["secret"], self._secret = self._secret, None
            feedback += f" You are out of guesses; the number was {info['secret']}."
            return StepResult([user(feedback)], reward=reward, truncated=True, info=info)
        return StepResult([user(feedback)], reward=reward, info=info)

    def reward_for(self, turn: int) -> float:
        """Reward for a correct guess on ``turn`` (1-based): 1.0 on turn 1, linearly down to MIN_REWARD on the last."""
        if self.max_turns == 1:
            return 1.0
        return MIN_REWARD + (1.0 - MIN_REWARD) * (self.max_turns - turn) / (self.max_turns - 1)

    def spaces(self) -> dict[str, Any]:
        return {
            "observation": 'system prompt and the rules; then "Higher." / "Lower." (or feedback) after each guess',
            "action": "assistant message whose last whole number is the guess",
            "reward": f"{MIN_REWARD}..1.0 for a hit (fewer turns, more reward); {self.invalid_penalty} per reply "
            "without a number; 0 otherwise",
            "secret_range": [self.low, self.high],
            "max_turns": self.max_turns,
        }
