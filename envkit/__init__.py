"""envkit: a gym-style protocol for LLM environments.

Async ``init/reset/step/close`` over chat messages, tools as OpenAI function schemas, rewards from the env, and a
registry that finds pip-installed env packages by name::

    import envkit
    env = envkit.SyncEnv(envkit.make("arithmetic"))
    messages, info = env.reset(seed=0)
    result = env.step("The answer is 7")

The protocol's modules are here at the top (core, messages, tools, tool_env, tasks, registry, ref, errors, parsing,
sync, markup, distribution, recording, imports); the rest lives in rooms: :mod:`envkit.rewards` (rubrics and LLM
judges), :mod:`envkit.agents` (agents with their own loop, their host processes, untrusted code),
:mod:`envkit.integrations` (other ecosystems' envs and trainers), :mod:`envkit.cli` (the ``envkit`` command) and
:mod:`envkit.remote` (envs in other processes). The modules' old paths (``envkit.judges``, ``envkit.agent``, ...)
still import, with a DeprecationWarning (:mod:`envkit.moved`).
"""

from envkit import errors
from envkit.agents.agent import AgentClient, AgentEnv, Command
from envkit.core import ContractChecker, Env, Snapshot, StepResult, Task, Wrapper
from envkit.messages import Message, ToolCall, assistant, system, tool_result, user
from envkit.moved import install_finder
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

install_finder()  # envkit.judges, envkit.agent, ...: the old paths of moved modules

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
