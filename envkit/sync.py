"""A synchronous facade over any async Env, for scripts, notebooks-without-loops and gymnasium tooling."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from envkit.core import Env, Snapshot, StepResult, Task
from envkit.errors import ContractError
from envkit.messages import Message

T = TypeVar("T")


class SyncEnv:
    """Blocking ``reset/step/close`` over an async :class:`Env`; owns one private event loop.

    Use it where no event loop is running. Inside async code, await the env directly instead.
    """

    def __init__(self, env: Env) -> None:
        self.env = env
        self._runner = asyncio.Runner()
        self._closed = False

    @property
    def tools(self) -> list[Any]:
        """The wrapped env's tools."""
        return self.env.tools

    @property
    def unwrapped(self) -> Env:
        """The innermost env, under every wrapper (the contract checker ``make`` adds among them)."""
        return self.env.unwrapped

    def init(self) -> None:
        """Blocking ``Env.init``."""
        self._run(self.env.init())

    def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Blocking ``Env.reset``."""
        return self._run(self.env.reset(seed=seed, task=task))

    def step(self, action: Message | str) -> StepResult:
        """Blocking ``Env.step``; a plain string is taken as the assistant's text."""
        if isinstance(action, str):
            action = {"role": "assistant", "content": action}
        return self._run(self.env.step(action))

    def snapshot(self) -> Snapshot:
        """Blocking ``Env.snapshot``."""
        return self._run(self.env.snapshot())

    def restore(self, snapshot: Snapshot) -> None:
        """Blocking ``Env.restore``."""
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
        raise ContractError("SyncEnv cannot be used inside a running event loop; `await` the async env instead.")

    def __enter__(self) -> SyncEnv:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncEnv{self.env!r}>"
