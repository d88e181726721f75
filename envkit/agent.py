"""AgentEnv: an env whose episodes an agent plays with its own loop, talking to the policy over the OpenAI API.

An SDK agent (OpenAI Agents, LangGraph, smolagents, pydantic-ai) or a coding CLI runs its own loop: it decides when
to call the model, which tools to run and when it is done. It cannot be stepped. Such an env instead hands its agent
an OpenAI-compatible endpoint for the episode (:class:`AgentClient`) and grades what the agent returns::

    async def solve(task, client):                     # any agent: here the openai SDK, one call
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
        reply = await llm.chat.completions.create(model=client.model, messages=[...])
        return reply.choices[0].message.content

    env = AgentEnv(agent=solve, grader=lambda task, answer: float(answer == task["answer"]), tasks=[...])

An agent that is a program (a coding CLI, a script using any SDK) is a :class:`Command`: it runs as a process with
``OPENAI_BASE_URL``/``OPENAI_API_KEY`` pointing at the episode's endpoint and the task as JSON on stdin, and what it
prints is the result; at its deadline, or when the rollout ends, it is killed with every process it started::

    env = AgentEnv(agent=Command(["my-agent", "--quiet"], timeout_s=120), grader=...)

A generator serves each episode through its capture gateway (:mod:`generators.gateway`), which records the exact
token ids every call sampled: the trainer trains on them as on any env's rollouts. ``reset`` picks the task (the
opening messages describe it for reports), :meth:`run` plays it, :meth:`grade` scores the result; ``step`` is not
used, since the model's turns happen inside the agent.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envkit.agent_process import HostedAgent, agent_ref
from envkit.core import Env, StepResult, Task
from envkit.errors import AgentProcessError, ResetNeededError
from envkit.messages import Message, user
from envkit.rubrics import Episode, Rubric, Score, load_rubric
from envkit.tasks import check_task, pick_task
from envkit.untrusted import SAFE_ENV, kill_orphans, owner_tag, run, setpriv_path


@dataclass(frozen=True, slots=True)
class AgentClient:
    """Where an agent reaches the policy for one episode: an OpenAI-compatible ``base_url`` (ending in ``/v1``),
    the episode's ``api_key``, and the ``model`` name to request. ``episode_url`` carries the key in the path, for
    agents that cannot set one (``OPENAI_BASE_URL`` alone)."""

    base_url: str
    api_key: str
    model: str
    episode_url: str

    def environ(self) -> dict[str, str]:
        """The variables an agent process reads: the OpenAI SDK's and most CLIs', and the Anthropic SDK's (whose
        base URL is the server's root; the gateway also serves ``/v1/messages``)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
                "ANTHROPIC_BASE_URL": self.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": self.api_key}


Agent = Callable[[Task, AgentClient], Awaitable[Any]]
"""``async (task, client) -> result``: plays one episode against ``client``."""
Grader = Callable[[Task, Any], float | Awaitable[float]]
"""``(task, result) -> reward``."""
TASK_ENV = "ENVKIT_TASK"
"""The variable a :class:`Command` agent finds its task in (as JSON; always on its stdin)."""
TASK_ENV_LIMIT = 64 * 1024
"""Larger tasks are on stdin only: Linux refuses to start a process with one environment string past 128 KiB."""
OWNER_ENV = "ENVKIT_AGENT_OWNER"
"""Set in a :class:`Command`'s environment to the process that started it, so its processes can be found and killed
if that process is itself killed outright (see :meth:`Command.__call__`)."""
_orphans_reaped = False


@dataclass(frozen=True)
class Command:
    """An agent that is a process: ``argv`` runs with :meth:`AgentClient.environ` and :data:`TASK_ENV` (up to
    :data:`TASK_ENV_LIMIT`) set, the task as JSON on stdin, in a session of its own; its stdout, stripped, is the
    result (past ``output_limit`` bytes the rollout fails rather than grade a cut answer). Past ``timeout_s``, or when
    its rollout is cancelled, it is killed with every process in its group (one that calls ``setsid()`` escapes: run
    untrusted agents in a container). It inherits this process's environment unless ``inherit_env`` is False (then
    only PATH, LANG, HOME), plus ``env``.

    If the process running the rollouts is killed outright (SIGKILL, the OOM killer: an env worker lost), the agent
    process dies with it (a parent-death signal, where util-linux ``setpriv`` is installed), and what it started is
    killed by the first ``Command`` of the next process of this user (:data:`OWNER_ENV` names its owner)."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = 300.0
    inherit_env: bool = True
    output_limit: int = 1 << 20

    async def __call__(self, task: Task, client: AgentClient) -> str:
        """Run the process for ``task``; raises :class:`~envkit.errors.AgentProcessError` if it fails or hangs."""
        global _orphans_reaped
        if not _orphans_reaped:  # in the background: no rollout waits on a scan of /proc
            _orphans_reaped = True
            threading.Thread(target=kill_orphans, args=(OWNER_ENV,), name="envkit-orphans", daemon=True).start()
        document = json.dumps(task)
        env = {**(os.environ if self.inherit_env else SAFE_ENV), **self.env, **client.environ(),
               **task_variables(document), OWNER_ENV: owner_tag()}
        setpriv = setpriv_path()
        argv = [setpriv, "--pdeathsig", "KILL", "--", *self.argv] if setpriv else list(self.argv)
        result = await run(argv, stdin=document.encode(), timeout_s=self.timeout_s,
                           output_limit=self.output_limit, cwd=self.cwd, env=env)
        if result.timed_out:
            raise AgentProcessError(f"agent command {self.argv[0]!r} ran past {self.timeout_s:g} s and was killed "
                                    "with its processes")
        return program_result(f"agent command {self.argv[0]!r}", result.exit_code, result.stdout, result.stderr,
                              self.output_limit)


def task_variables(document: str) -> dict[str, str]:
    """:data:`TASK_ENV` holding the task's JSON ``document``, unless it is past :data:`TASK_ENV_LIMIT`."""
    return {TASK_ENV: document} if len(document) <= TASK_ENV_LIMIT else {}


def program_result(what: str, exit_code: int, stdout: bytes, stderr: bytes, output_limit: int) -> str:
    """An agent program's answer, its stdout stripped; :class:`~envkit.errors.AgentProcessError` (naming ``what``)
    when it exited non-zero, or filled ``output_limit`` (its stdout cut there: the answer would be graded cut)."""
    if exit_code != 0:
        raise AgentProcessError(f"{what} exited {exit_code}: {stderr.decode(errors='replace').strip()[-500:]}")
    if len(stdout) >= output_limit:
        raise AgentProcessError(f"{what} wrote {output_limit} bytes or more to stdout; its answer would be graded cut")
    return stdout.decode(errors="replace").strip()


class AgentEnv(Env):
    """An env played by an agent with its own loop (see the module docstring). Pass ``agent=`` and ``grader=``, or
    subclass and override :meth:`run` and :meth:`grade`.

    ``agent_process=True`` runs a Python agent in a host process of its own (one per agent, serving all of this
    event loop's episodes; :mod:`envkit.agent_process`): its CPU work then runs beside the capture gateway instead
    of in turns with it, and an agent that blocks its event loop stalls only its host. The agent must be a
    module-level function (the host imports it by name) and return JSON.

    ``rubric`` (:mod:`envkit.rubrics`) scores each episode from the grade and the agent's result."""

    def __init__(self, *, agent: Agent | None = None, grader: Grader | None = None,
                 tasks: Sequence[Task] | dict[str, Sequence[Task]] | None = None, agent_process: bool = False,
                 rubric: Rubric | str | None = None) -> None:
        self._agent = None if agent is None else HostedAgent(agent_ref(agent)) if agent_process else \
            as_async_agent(agent)
        self._grader = grader
        self.rubric = None if rubric is None else load_rubric(rubric)
        """Scores the episode from what :meth:`grade` gave (see :meth:`score`)."""
        self._tasks = {"train": list(tasks)} if isinstance(tasks, Sequence) else dict(tasks or {})
        self._rng = random.Random()
        self.task: Task | None = None
        """The task of the current episode (set by ``reset``)."""

    def tasks(self, split: str = "train") -> Sequence[Task] | None:
        """The tasks given for ``split``, or None."""
        return self._tasks.get(split)

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Pick the episode's task: ``task``, else one of the train tasks by ``seed``."""
        if task is None:
            task = pick_task(self._tasks.get("train") or [], seed, self._rng)
        self.task = dict(check_task(task))
        return [user(str(task.get("prompt", task.get("question", task))))], {"task": task}

    async def step(self, action: Message) -> StepResult:
        """Not used: an agent env's model turns happen inside its agent."""
        raise NotImplementedError(f"{type(self).__name__} is played by its agent: roll it out with a generator "
                                  "(generators.Generator), which serves the agent through its capture gateway")

    async def run(self, client: AgentClient) -> Any:
        """Play the current task against ``client``; returns what :meth:`grade` scores."""
        if self._agent is None:
            raise NotImplementedError(f"{type(self).__name__} has no agent: pass agent= or override run()")
        return await self._agent(self._current(), client)

    async def grade(self, result: Any) -> float:
        """The reward of the episode whose agent returned ``result``."""
        if self._grader is None:
            raise NotImplementedError(f"{type(self).__name__} has no grader: pass grader= or override grade()")
        reward = self._grader(self._current(), result)
        if inspect.isawaitable(reward):
            reward = await reward
        return float(reward)

    async def score(self, result: Any) -> Score:
        """The episode's reward and its breakdown: :meth:`grade`, through :attr:`rubric` where there is one (its
        :class:`~envkit.rubrics.EnvReward` is the grade)."""
        reward = await self.grade(result)
        if self.rubric is None:
            return Score(reward)
        return await self.rubric.score(Episode(self._current(), [], reward, {}, result))

    def _current(self) -> Task:
        if self.task is None:
            raise ResetNeededError("an agent episode needs a task: call reset() first")
        return self.task


def as_async_agent(fn: Callable[[Task, AgentClient], Any]) -> Agent:
    """``fn`` as an :data:`Agent`: async callables as they are, plain ones in a worker thread (a synchronous SDK
    must not block the event loop the gateway answers it from)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return fn

    async def agent(task: Task, client: AgentClient) -> Any:
        result = await asyncio.to_thread(fn, task, client)
        return await result if inspect.isawaitable(result) else result  # e.g. a lambda returning a coroutine

    return agent
