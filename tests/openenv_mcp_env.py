"""An MCP-type OpenEnv env (OpenEnv 0.10's ``MCPEnvironment``) for tests/test_openenv.py, served by OpenEnv's own
server from the 0.10 venv: ``uvicorn --factory openenv_mcp_env:create_app``. Its tools are ``add`` and ``submit``;
submitting the sum earns 1 and ends the episode. It lists its tasks through the Task API: ``a + b`` with ``a = i``
and ``b = i + 1`` for task ``i``, 5 train tasks and 3 test ones (offset by 100); without a task, 2 + 3."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app as openenv_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State


class QuestionObservation(Observation):
    prompt: str = ""


class AdderEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("adder")
        self.submitted: int | None = None
        self.answer = 5

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer."""
            self.submitted = answer
            return "submitted"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str | None = None,
              index: int | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.submitted = None
        task = self.get_task(split, index) if split is not None and index is not None else {"a": 2, "b": 3}
        self.answer = task["a"] + task["b"]
        return QuestionObservation(prompt=f"What is {task['a']} + {task['b']}? Use the tools.", done=False,
                                   reward=0.0, metadata={"answer": self.answer})

    def list_splits(self) -> list[str]:
        return ["train", "test"]

    def num_tasks(self, split: str) -> int:
        return {"train": 5, "test": 3}[split]

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_tasks(split):
            raise IndexError(index)
        offset = 100 if split == "test" else 0
        return {"id": f"{split}-{index}", "a": offset + index, "b": offset + index + 1}

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return [self.get_task(split, i) for i in range(self.num_tasks(split))]

    def get_task_range(self, split: str, start: int | None = None, stop: int | None = None) -> list[dict[str, Any]]:
        return self.list_tasks(split)[start:stop]

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """OpenEnv's server steps through this one (``step`` is the synchronous API)."""
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and self.submitted is not None:
            observation.reward, observation.done = float(self.submitted == self.answer), True
        return observation

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def create_app() -> Any:
    """OpenEnv's server with the adder env, one instance per WebSocket session."""
    return openenv_app(AdderEnv, CallToolAction, CallToolObservation, env_name="adder", max_concurrent_envs=64)
