"""An MCP-type OpenEnv env (OpenEnv 0.10's ``MCPEnvironment``) for tests/test_openenv.py, served by OpenEnv's own
server from the 0.10 venv: ``uvicorn --factory openenv_mcp_env:create_app``. Its tools are ``add`` and ``submit``;
submitting 5 (2 + 3) earns 1 and ends the episode."""

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

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.submitted = None
        return QuestionObservation(prompt="What is 2 + 3? Use the tools.", done=False, reward=0.0,
                                   metadata={"answer": 5})

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """OpenEnv's server steps through this one (``step`` is the synchronous API)."""
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and self.submitted is not None:
            observation.reward, observation.done = float(self.submitted == 5), True
        return observation

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def create_app() -> Any:
    """OpenEnv's server with the adder env, one instance per WebSocket session."""
    return openenv_app(AdderEnv, CallToolAction, CallToolObservation, env_name="adder", max_concurrent_envs=64)
