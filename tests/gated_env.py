"""An arithmetic env whose first task drawn in a process holds its episodes until a file exists: the async trainer
test (served as ``gated_env:GatedArithmetic`` with tests/ on PYTHONPATH) makes one group finish late, on purpose."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from envkit_arithmetic import ArithmeticEnv

from envkit import Message, StepResult, Task


class GatedArithmetic(ArithmeticEnv):
    """Arithmetic, but every episode of the first task this process resets waits in ``step`` until ``gate`` exists."""

    held: ClassVar[str | None] = None

    def __init__(self, *, gate: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = Path(gate)
        self.task_id: str | None = None

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self.task_id = (task or {}).get("id")
        if GatedArithmetic.held is None:
            GatedArithmetic.held = self.task_id
        return await super().reset(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        # The gate is a file another process writes, so there is no Event to wait on.
        while self.task_id == GatedArithmetic.held and not self.gate.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        return await super().step(action)
