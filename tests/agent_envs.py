"""Agents that run their own loop, as AgentEnvs named by entry point (``agent_envs:sums`` and the others below): an
openai-SDK tool loop, LangGraph, and a command-line agent process (``cli_agent.py``), each unmodified from PyPI and
pointed at the episode's endpoint as a user points it at any OpenAI-compatible server (the OpenAI Agents SDK's is
examples/train_agent_sdk.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import psutil
from cli_agent import ADD, INSTRUCTIONS, llm, run_add, tool_loop

from envkit import Task
from envkit.agents.agent import AgentClient, AgentEnv, Command
from envkit.agents.untrusted import python
from envkit.parsing import grade_number

# The loop lives in cli_agent.py, which runs in a venv without envkit; the tests import it from here.
__all__ = ["ADD", "INSTRUCTIONS", "llm", "run_add", "tool_loop"]
T = TypeVar("T")

async def hosted(task: Task, client: AgentClient) -> dict[str, Any]:
    """An agent for a host process (``agent_process=True``): by its task's id it crashes, returns what is not JSON,
    blocks its host's event loop, forges answers to the host's requests on fd 1 (itself and from a child process),
    or plays a 3-call :func:`tool_loop`; it says which process it ran in."""
    if task["id"] == "crash":
        raise RuntimeError("the agent crashed")
    if task["id"] == "set":
        return {"pid": {os.getpid()}}  # not JSON
    if task["id"] == "block":
        time.sleep(3600)  # noqa: ASYNC251 - synchronous code in an async agent: the host's event loop stops with it
    if task["id"] == "forge":
        await asyncio.sleep(0.5)  # the other episodes' requests are in flight
        forged = "".join(json.dumps({"id": rid, "result": {"pid": 0, "answer": "forged"}}) + "\n"
                         for rid in range(1000))
        os.write(1, forged.encode())
        child = await asyncio.create_subprocess_exec("sh", "-c", 'printf "%s" "$FORGED"', env={"FORGED": forged})
        await child.wait()
        return {"pid": os.getpid(), "answer": "honest"}
    return {"pid": os.getpid(), "answer": await tool_loop(task, client, turns=3)}


AGENT_PYTHON = os.environ.get("ENVKIT_AGENT_PYTHON", str(Path(__file__).parents[1] / ".venv-agent/bin/python"))
"""The test agents' interpreter (.venv-agent, `make install`): the openai SDK, runnable by an agent's own uid."""


def _questions(start: int, stop: int) -> list[Task]:
    return [{"id": f"sum-{a}-{b}", "question": f"What is {a} + {b}? End with 'The answer is N.'", "answer": a + b}
            for a in range(start, stop) for b in range(1, 4)]


def score(task: Task, text: str) -> float:
    """1 for the right sum, 0.1 for another number, 0 for none: graded, so that the bundled model's rewards in a
    group differ (it gets a one-digit sum right about 1 time in 15)."""
    if grade_number(text, task["answer"])["correct"]:
        return 1.0
    return 0.1 if re.search(r"\d", text or "") else 0.0


def sums() -> AgentEnv:
    """One-digit sums, played by :func:`tool_loop` (two calls), graded on the last reply (:func:`score`)."""
    return _env(lambda task, client: tool_loop(task, client, turns=2, max_tokens=24))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def langgraph_loop(task: Task, client: AgentClient, *, max_tokens: int = 24) -> str:
    """LangGraph's prebuilt ReAct agent on ``langchain-openai``'s ChatOpenAI (chat completions)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    chat = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key, max_tokens=max_tokens,
                      max_retries=0)
    graph = create_react_agent(chat, [tool(add)], prompt=INSTRUCTIONS)
    state = await graph.ainvoke({"messages": [("user", task["question"])]}, config={"recursion_limit": 25})
    return str(state["messages"][-1].content)


def _env(agent: Any) -> AgentEnv:
    return AgentEnv(agent=agent, grader=score, tasks={"train": _questions(1, 8), "test": _questions(8, 10)})


def langgraph_sums() -> AgentEnv:
    """:func:`sums` played by a LangGraph ReAct agent."""
    return _env(langgraph_loop)


def cli_sums() -> AgentEnv:
    """:func:`sums` played by ``cli_agent.py``, a command-line agent run as a process per episode."""
    return _env(Command([AGENT_PYTHON, str(Path(__file__).with_name("cli_agent.py")), "--max-tokens", "24",
                         "--turns", "2"], timeout_s=120))


def docker_sums() -> AgentEnv:
    """:func:`sums` played by ``docker_agent.py`` (two calls, standard library) in a Docker container per episode
    that reaches nothing but its gateway (sandboxes.agent.DockerCommand)."""
    from sandboxes.agent import DockerCommand

    inside = "/agent/docker_agent.py"
    return _env(DockerCommand(["python3", inside], mounts={str(Path(__file__).with_name("docker_agent.py")): inside},
                              timeout_s=120))


def scout_sums(report: str, addresses: list[str], token: str) -> AgentEnv:
    """:func:`sums` on a container cluster's node, played by two agent processes that scout as they play: an
    isolated ``Command`` asks the question, a ``DockerCommand`` container asks it again (two calls through the
    gateway), and each also tries a TCP connection to ``addresses`` and to the gateway's shared port, reads the file
    ``token`` and looks for other episodes' keys in /proc. What each got is appended to ``report`` (JSON lines)."""
    from urllib.parse import urlsplit

    from sandboxes.agent import DockerCommand

    agent, inside = str(Path(__file__).with_name("docker_agent.py")), "/agent/docker_agent.py"

    async def play(task: Task, client: AgentClient) -> str:
        argv = ["scout", token, *addresses, urlsplit(client.base_url).netloc]
        seen = {"command": json.loads(await Command([python(), agent, *argv], timeout_s=120)(task, client)),
                "docker": json.loads(await DockerCommand(["python3", inside, *argv], mounts={agent: inside},
                                                         timeout_s=120)(task, client))}
        await asyncio.to_thread(_append, report, json.dumps(seen))
        return seen["docker"]["answer"]

    return _env(play)


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def where() -> AgentEnv:
    """A probe of where an agent env runs: one call, and the reward is the pid of the process that played and
    graded the episode (the same one, or the reward is -1)."""

    async def play(task: Task, client: AgentClient) -> int:
        await llm(client).chat.completions.create(model=client.model, max_tokens=4,
                                                  messages=[{"role": "user", "content": task["question"]}])
        return os.getpid()

    return AgentEnv(agent=play, grader=lambda task, pid: float(pid if pid == os.getpid() else -1),
                    tasks=_questions(1, 3))


HANG = """
import json, os, subprocess, sys
task = json.load(sys.stdin)
sleep = [sys.executable, "-c", "import time; time.sleep(3600)", "envkit-hang-" + task["id"]]
subprocess.Popen(sleep)
os.execv(sys.executable, sleep)
"""


def hang() -> AgentEnv:
    """An agent process that starts a child and hangs, both with ``envkit-hang-TASK_ID`` on their command line
    (:func:`marked` finds them): a probe of what a cancelled rollout leaves behind."""
    return AgentEnv(agent=Command([python(), "-c", HANG], timeout_s=3600), grader=lambda task, text: 0.0,
                    tasks=_questions(1, 2))


def marked(marker: str) -> list[psutil.Process]:
    """The live processes of this host with ``marker`` on their command line."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if marker in (process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


async def watching(markers: list[str], work: Awaitable[T]) -> tuple[T, dict[str, list[psutil.Process]]]:
    """What ``work`` returns, and the processes marked with each of ``markers`` seen while it ran (an isolated
    agent's own pids are its namespace's: these are the host's)."""
    seen: dict[str, list[psutil.Process]] = {m: [] for m in markers}
    task = asyncio.ensure_future(work)
    while not task.done():
        for marker in markers:
            seen[marker] += [p for p in await asyncio.to_thread(marked, marker) if p not in seen[marker]]
        await asyncio.wait([task], timeout=0.2)
    return task.result(), seen


def sums_until(flag: str) -> AgentEnv:
    """:func:`sums`, until the file ``flag`` exists; from then on an agent that never calls the gateway (a fault
    tests/faults.py switches on at the moment it picks)."""

    async def play(task: Task, client: AgentClient) -> str:
        if await asyncio.to_thread(os.path.exists, flag):
            await asyncio.Event().wait()  # never calls, never returns
        return await tool_loop(task, client, turns=2, max_tokens=24)

    return _env(play)
