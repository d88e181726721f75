"""A synchronous facade over any async Env, for scripts, notebooks-without-loops and gymnasium tooling."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, Self, TypeVar

from envkit.core import Env, Snapshot, StepResult, Task
from envkit.errors import ContractError
from envkit.messages import Message
from envkit.multi_agent import MultiAgentEnv, Turn

T = TypeVar("T")


class _Blocking:
    """A private event loop that runs an async env's calls to completion, and closes the env with it."""

    env: Env | MultiAgentEnv

    def __init__(self) -> None:
        self._runner = asyncio.Runner()
        self._closed = False

    def init(self) -> None:
        """Blocking ``init``."""
        self._run(self.env.init())

    def snapshot(self) -> Snapshot:
        """Blocking ``snapshot``."""
        return self._run(self.env.snapshot())

    def restore(self, snapshot: Snapshot) -> None:
        """Blocking ``restore``."""
        self._run(self.env.restore(snapshot))

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        """The wrapped env's tasks for ``split``."""
        return self.env.tasks(split)

    def close(self) -> None:
        """Close the env and the private loop; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.env.close())
        finally:
            self._runner.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._runner.run(coro)
        coro.close()
        raise ContractError(f"{type(self).__name__} cannot be used inside a running event loop; `await` the async "
                            "env instead.")

    def __enter__(self) -> Self:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self.env!r}>"


class SyncEnv(_Blocking):
    """Blocking ``reset/step/close`` over an async :class:`Env`; owns one private event loop.

    Use it where no event loop is running. Inside async code, await the env directly instead.
    """

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env: Env = env

    @property
    def tools(self) -> list[Any]:
        """The wrapped env's tools."""
        return self.env.tools

    @property
    def unwrapped(self) -> Env:
        """The innermost env, under every wrapper (the contract checker ``make`` adds among them)."""
        return self.env.unwrapped

    def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Blocking ``Env.reset``."""
        return self._run(self.env.reset(seed=seed, task=task))

    def step(self, action: Message | str) -> StepResult:
        """Blocking ``Env.step``; a plain string is taken as the assistant's text."""
        if isinstance(action, str):
            action = {"role": "assistant", "content": action}
        return self._run(self.env.step(action))


class SyncMultiAgentEnv(_Blocking):
    """Blocking ``reset/step/close`` over an async :class:`~envkit.multi_agent.MultiAgentEnv`."""

    def __init__(self, env: MultiAgentEnv) -> None:
        super().__init__()
        self.env: MultiAgentEnv = env

    @property
    def seats(self) -> tuple[str, ...]:
        """The env's seats."""
        return self.env.seats

    def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        """Blocking ``MultiAgentEnv.reset``."""
        return self._run(self.env.reset(seed=seed, task=task))

    def step(self, actions: dict[str, Message | str]) -> Turn:
        """Blocking ``MultiAgentEnv.step``; a plain string is taken as that seat's assistant text."""
        return self._run(self.env.step({seat: {"role": "assistant", "content": a} if isinstance(a, str) else a
                                        for seat, a in actions.items()}))
