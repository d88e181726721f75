"""envkit: a gym-style protocol for LLM environments.

Async ``init/reset/step/close`` over chat messages, tools as OpenAI function schemas, rewards from the env, and a
registry that finds pip-installed env packages by name::

    import envkit
    env = envkit.SyncEnv(envkit.make("arithmetic"))
    messages, info = env.reset(seed=0)
    result = env.step("The answer is 7")
"""

from envkit import errors
from envkit.agent import AgentClient, AgentEnv, Command
from envkit.core import ContractChecker, Env, Snapshot, StepResult, Task, Wrapper
from envkit.messages import Message, ToolCall, assistant, system, tool_result, user
from envkit.parsing import Answer, extract_answer, parse_number
from envkit.ref import EnvRef
from envkit.registry import (
    BrokenEnv,
    EnvSpec,
    Registry,
    broken_envs,
    list_envs,
    make,
    register,
    registry,
    spec,
)
from envkit.sync import SyncEnv
from envkit.tool_env import ToolEnv
from envkit.tools import Tool, ToolOutput, parse_tool_calls, tool, tool_calls_of

__version__ = "0.1.0"

__all__ = [
    "AgentClient",
    "AgentEnv",
    "Answer",
    "BrokenEnv",
    "Command",
    "ContractChecker",
    "Env",
    "EnvRef",
    "EnvSpec",
    "Message",
    "Registry",
    "Snapshot",
    "StepResult",
    "SyncEnv",
    "Task",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolOutput",
    "Wrapper",
    "__version__",
    "assistant",
    "broken_envs",
    "errors",
    "extract_answer",
    "list_envs",
    "make",
    "parse_number",
    "parse_tool_calls",
    "register",
    "registry",
    "spec",
    "system",
    "tool",
    "tool_calls_of",
    "tool_result",
    "user",
]
