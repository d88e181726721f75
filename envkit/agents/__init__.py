"""Agents that run their own loop: :mod:`envkit.agents.agent` has :class:`AgentEnv` (an env an agent plays through
the capture gateway), :class:`AgentClient` and :class:`Command` (an agent that is a process);
:mod:`envkit.agents.process` the host processes a Python agent or another env runs in (:class:`HostProcess`), served
by :mod:`envkit.agents.line_server` (an agent's by :mod:`envkit.agents.host`); :mod:`envkit.agents.isolation` where
a Command runs (its own network, process tree and uid), reaching the gateway through :mod:`envkit.agents.relay`;
:mod:`envkit.agents.untrusted` how untrusted code runs, as a uid of its own, killed whole."""

from envkit.agents.agent import (
    AGENT_FIELDS,
    GRADER_FIELDS,
    AgentClient,
    AgentEnv,
    Command,
    as_async_agent,
    program_result,
    task_variables,
)
from envkit.agents.process import HostedAgent, HostProcess, agent_ref, host_process, load_agent
from envkit.agents.untrusted import EXEC_USER_ENV, SAFE_ENV, RunResult, UserPool, Workspace

__all__ = [
    "AGENT_FIELDS",
    "EXEC_USER_ENV",
    "GRADER_FIELDS",
    "SAFE_ENV",
    "AgentClient",
    "AgentEnv",
    "Command",
    "HostProcess",
    "HostedAgent",
    "RunResult",
    "UserPool",
    "Workspace",
    "agent_ref",
    "as_async_agent",
    "host_process",
    "load_agent",
    "program_result",
    "task_variables",
]
