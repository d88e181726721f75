"""The Env contract: what every envkit environment is, in one file.

An environment is an async, gym-style episode over chat messages::

    env = envkit.make("arithmetic")          # or construct your Env subclass directly
    await env.init()                         # acquire resources once (make() defers it to the first reset)
    messages, info = await env.reset(seed=0) # first observation: a list of chat messages
    result = await env.step({"role": "assistant", "content": "The answer is 7"})
    result.observation, result.reward, result.terminated, result.truncated, result.info
    await env.close()                        # idempotent

Every subclass must implement ``reset`` and ``step``; it may set ``tools`` (OpenAI function tools the model can
call), override ``init``/``close`` for resources, ``tasks(split)`` when its task set is enumerable, and
``demonstrate`` when it can show how a task is solved (supervised data before RL).
``make()`` wraps every env in :class:`ContractChecker`, which enforces call order and validates both sides.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from envkit.errors import (
    EnvClosedError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidStepResultError,
    ResetNeededError,
)
from envkit.messages import Message, is_message, validate_action

if TYPE_CHECKING:
    from envkit.registry import EnvSpec
    from envkit.tools import Tool

Task = dict[str, Any]
"""One task: a JSON-serializable dict, conventionally with a unique ``"id"``."""


@dataclass(slots=True)
class StepResult:
    """What ``Env.step`` returns.

    ``terminated`` means the task ended (solved, failed, game over); ``truncated`` means a budget ran out
    (turns, tokens, time) before it did. Either one ends the episode.
    """

    observation: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """True when the episode is over (terminated or truncated)."""
        return self.terminated or self.truncated


class Env(abc.ABC):
    """Base class of every environment. The docstrings of its methods are the contract."""

    tools: ClassVar[list[Tool]] = []
    """Tools the model may call, as :class:`envkit.Tool` (rendered to OpenAI function schemas)."""

    spec: EnvSpec | None = None
    """The registry spec this env was made from; set by ``envkit.make``."""

    reward_range: tuple[float, float] = (-math.inf, math.inf)
    """The least and the greatest reward one step can give (``envkit check`` holds the env to it)."""

    async def init(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Acquire expensive resources (connections, containers, datasets) once, before the first reset."""

    @abc.abstractmethod
    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start a new episode and return ``(messages, info)``.

        ``messages`` are the opening chat messages (system prompt, question). The same ``seed`` or the same
        ``task`` must give the same episode start: GRPO compares samples of one group against each other.
        ``task`` takes precedence over ``seed``; with neither, the env picks a task at random.
        """

    @abc.abstractmethod
    async def step(self, action: Message) -> StepResult:
        """Apply one assistant message and return the env's reply as a :class:`StepResult`.

        ``action`` is an assistant message (``content`` and/or ``tool_calls``). May only be called after
        ``reset`` and before the episode is done.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release resources. Must be safe to call more than once."""

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        """The env's tasks for ``split`` ("train", "test", ...), or None when tasks are not enumerable."""
        return None

    def spaces(self) -> dict[str, Any]:
        """Describe observation and action spaces (for ``envkit info`` and the gymnasium bridge)."""
        return {"observation": "list of chat messages", "action": "assistant message"}

    async def demonstrate(self, messages: list[Message]) -> Message:
        """An expert's next assistant message in the current episode, ``messages`` being the chat so far (from the
        opening messages on). Optional: envs that cannot demonstrate raise NotImplementedError.

        A generator plays the demonstration as the model's turn and steps the env with it for real, so the env's
        replies (tool outputs included) in the resulting supervised data are genuine. Tool calls go in
        ``tool_calls``: the generator writes them in the model's own format.
        """
        raise NotImplementedError(f"{type(self).__name__} offers no demonstrations (it does not override "
                                  "Env.demonstrate)")

    @property
    def unwrapped(self) -> Env:
        """The innermost env, below any wrappers."""
        return self

    async def __aenter__(self) -> Env:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        name = self.spec.name if self.spec else type(self).__name__
        return f"<{type(self).__name__} {name!r}>"


class Wrapper(Env):
    """An env that forwards to another; subclass it to change one part of the behaviour."""

    def __init__(self, env: Env) -> None:
        self.env = env

    @property
    def tools(self) -> list[Tool]:  # type: ignore[override]
        return self.env.tools

    @property
    def spec(self) -> EnvSpec | None:  # type: ignore[override]
        return self.env.spec

    @spec.setter
    def spec(self, value: EnvSpec | None) -> None:
        self.env.spec = value

    @property
    def reward_range(self) -> tuple[float, float]:  # type: ignore[override]
        return self.env.reward_range

    @property
    def unwrapped(self) -> Env:
        return self.env.unwrapped

    async def init(self) -> None:
        await self.env.init()

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        return await self.env.reset(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        return self.env.tasks(split)

    def spaces(self) -> dict[str, Any]:
        return self.env.spaces()

    async def demonstrate(self, messages: list[Message]) -> Message:
        return await self.env.demonstrate(messages)

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes the wrapper lacks: expose the wrapped env's extras (e.g. env.max_turns).
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self.env!r}>"


class ContractChecker(Wrapper):
    """Enforces the contract around any env: call order on the way in, result shapes on the way out.

    ``init`` runs lazily before the first reset if the caller skipped it; ``step`` before ``reset`` or after the
    episode ended raises a :class:`~envkit.errors.ContractError`; malformed actions raise InvalidActionError; a
    malformed return value from the env raises InvalidStepResultError naming the env.
    """

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self._initialized = False
        self._has_reset = False
        self._episode_active = False
        self._closed = False

    async def init(self) -> None:
        if not self._initialized:
            await self.env.init()
            self._initialized = True

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        if self._closed:
            raise EnvClosedError("reset() called on a closed env. Make a new one with envkit.make().")
        if not self._initialized:
            await self.init()
        out = await self.env.reset(seed=seed, task=task)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise InvalidStepResultError(
                f"{self.env!r}.reset() must return (messages, info), got {type(out).__name__}: {out!r:.120}"
            )
        _check_messages(self.env, "reset", out[0])
        self._has_reset = True
        self._episode_active = True
        return out

    async def step(self, action: Message) -> StepResult:
        if not self._episode_active:
            if self._closed:
                raise EnvClosedError("step() called on a closed env. Make a new one with envkit.make().")
            if self._has_reset:
                raise EpisodeDoneError(
                    "step() called after the episode ended (terminated or truncated). Call reset() to start a new one."
                )
            raise ResetNeededError("step() called before reset(). Call `await env.reset(...)` first.")
        validate_action(action)
        result = await self.env.step(action)
        if not isinstance(result, StepResult):
            raise InvalidStepResultError(
                f"{self.env!r}.step() must return envkit.StepResult, got {type(result).__name__}"
            )
        _check_messages(self.env, "step", result.observation)
        if isinstance(result.reward, bool) or not isinstance(result.reward, int | float):
            raise InvalidStepResultError(f"{self.env!r}.step() reward must be a number, got {result.reward!r}")
        if not math.isfinite(result.reward):
            raise InvalidStepResultError(f"{self.env!r}.step() reward must be finite, got {result.reward!r}")
        if result.terminated or result.truncated:
            self._episode_active = False
        return result

    async def demonstrate(self, messages: list[Message]) -> Message:
        if not self._episode_active:
            raise ResetNeededError("demonstrate() needs an episode in progress: call reset() first.")
        action = await self.env.demonstrate(messages)
        try:
            return validate_action(action)
        except InvalidActionError as e:
            raise InvalidStepResultError(f"{self.env!r}.demonstrate() must return an assistant message: {e}") from e

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._episode_active = False
            await self.env.close()


def _check_messages(env: Env, method: str, messages: Any) -> None:
    if not isinstance(messages, list) or not all(is_message(m) for m in messages):
        raise InvalidStepResultError(
            f"{env!r}.{method}() must return a list of chat messages "
            f"({{'role': 'user'|'assistant'|'system'|'tool', 'content': str}}), got {messages!r:.160}"
        )
