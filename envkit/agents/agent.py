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
prints is the result; at its deadline, or when the rollout ends, it is killed with every process it started. It runs
isolated where the machine allows (:mod:`envkit.agents.isolation`: a network, process tree and, as root, uid of its
own) with a clean environment::

    env = AgentEnv(agent=Command(["my-agent", "--quiet"], timeout_s=120), grader=...)

The agent sees the task's question-like fields only (:data:`AGENT_FIELDS`, or the env's ``agent_fields``); the
grader gets the whole task, answer included.

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
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envkit.agents.client import AgentClient
from envkit.agents.isolation import announce, blocked_for_others, forward, isolated_argv, isolation, relayed
from envkit.agents.process import HostedAgent, agent_ref
from envkit.agents.untrusted import SAFE_ENV, kill_orphans, owner_tag, run, setpriv_path, users
from envkit.core import Env, StepResult, Task
from envkit.errors import AgentProcessError, ResetNeededError
from envkit.messages import Message, user
from envkit.rewards.rubrics import Episode, Rubric, Score, load_rubric
from envkit.tasks import check_task, pick_task

Agent = Callable[[Task, AgentClient], Awaitable[Any]]
"""``async (task, client) -> result``: plays one episode against ``client``."""
Grader = Callable[[Task, Any], float | Awaitable[float]]
"""``(task, result) -> reward``."""
TASK_ENV = "ENVKIT_TASK"
"""The variable a :class:`Command` agent finds its task in (as JSON; always on its stdin)."""
TASK_ENV_LIMIT = 64 * 1024
"""Larger tasks are on stdin only: Linux refuses to start a process with one environment string past 128 KiB."""
AGENT_FIELDS = ("id", "question", "prompt", "instruction", "instructions", "messages", "context", "input")
"""The task fields an agent sees unless its env names others (``AgentEnv(agent_fields=...)``)."""
GRADER_FIELDS = frozenset({"answer", "answers", "solution", "target", "expected", "reference", "ground_truth",
                           "label", "tests", "hidden_tests"})
"""Fields no agent may be given: what grades it."""
NEVER_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Never passed to an agent process implicitly, even with ``inherit_env``: they would undo the venv it runs in."""
OWNER_ENV = "ENVKIT_AGENT_OWNER"
"""Set in a :class:`Command`'s environment to the process that started it, so its processes can be found and killed
if that process is itself killed outright (see :meth:`Command.__call__`)."""
_orphans_reaped = False


@dataclass(frozen=True)
class Command:
    """An agent that is a process: ``argv`` runs with :meth:`AgentClient.environ` and :data:`TASK_ENV` (up to
    :data:`TASK_ENV_LIMIT`) set, the task as JSON on stdin; its stdout, stripped, is the result (past
    ``output_limit`` bytes the rollout fails rather than grade a cut answer). Past ``timeout_s``, or when its
    rollout is cancelled, it is killed with every process it started.

    With ``isolate`` (the default) it runs where :func:`~envkit.agents.isolation.isolation` allows: a network, a
    process tree and, as root, a uid of its own, reaching nothing but its episode's gateway port; in a directory of
    its own (``HOME``, and the working directory unless ``cwd`` is given). As root its program must be runnable by
    other users (a venv under root's 0700 home is not). ``isolate=False`` runs it as this user on this host's network:
    for trusted code only.

    Its environment is :data:`~envkit.agents.untrusted.SAFE_ENV`, the endpoint's variables, the task and ``env``;
    ``inherit_env=True`` adds this process's whole environment (tokens included: trusted code only) but for
    :data:`NEVER_INHERITED`.

    Unisolated, if the process running the rollouts is killed outright (SIGKILL, the OOM killer: an env worker
    lost), the agent process dies with it (a parent-death signal, where util-linux ``setpriv`` is installed), and
    what it started is killed by the first ``Command`` of the next process of this user (:data:`OWNER_ENV` names
    its owner); one that calls ``setsid()`` escapes the group kill. Isolated, its namespace dies with it."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = 300.0
    inherit_env: bool = False
    output_limit: int = 1 << 20
    isolate: bool = True

    async def __call__(self, task: Task, client: AgentClient) -> str:
        """Run the process for ``task``; raises :class:`~envkit.errors.AgentProcessError` if it fails or hangs."""
        mode = await asyncio.to_thread(isolation) if self.isolate else None
        if self.isolate:
            announce(mode)
        document = json.dumps(task)
        if mode is None:
            result = await self._unisolated(document, client)
        else:
            result = await self._isolated(mode, document, client)
        if result.timed_out:
            raise AgentProcessError(f"agent command {self.argv[0]!r} ran past {self.timeout_s:g} s and was killed "
                                    "with its processes")
        return program_result(f"agent command {self.argv[0]!r}", result.exit_code, result.stdout, result.stderr,
                              self.output_limit)

    def _environ(self, endpoint: Mapping[str, str], document: str, home: str | None) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if k not in NEVER_INHERITED} if self.inherit_env else {}
        return {**SAFE_ENV, **inherited, **({"HOME": home} if home else {}), **self.env, **endpoint,
                **task_variables(document)}

    async def _unisolated(self, document: str, client: AgentClient) -> Any:
        global _orphans_reaped
        if not _orphans_reaped:  # in the background: no rollout waits on a scan of /proc
            _orphans_reaped = True
            threading.Thread(target=kill_orphans, args=(OWNER_ENV,), name="envkit-orphans", daemon=True).start()
        env = {**self._environ(client.environ(), document, None), OWNER_ENV: owner_tag()}
        setpriv = setpriv_path()
        argv = [setpriv, "--pdeathsig", "KILL", "--", *self.argv] if setpriv else list(self.argv)
        return await run(argv, stdin=document.encode(), timeout_s=self.timeout_s, output_limit=self.output_limit,
                         cwd=self.cwd, env=env)

    async def _isolated(self, mode: str, document: str, client: AgentClient) -> Any:
        async with AsyncExitStack() as stack:
            # The socket's directory is this process's alone: only the relay, which starts as this user, opens it.
            workdir = Path(tempfile.mkdtemp(prefix="envkit-agent-"))
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
            server = await forward(workdir / "gateway.sock", client.channel_url or client.base_url)
            stack.callback(server.close)
            uid = await stack.enter_async_context(users.lease()) if mode == "user" else None
            home = _agent_home(workdir, uid)
            env = self._environ(relayed(client.environ()), document, home)
            if uid is not None and (why := blocked_for_others(self.argv[0], env["PATH"])):
                raise AgentProcessError(f"agent command {self.argv[0]!r} cannot run as its own user (uid {uid}): "
                                        f"{why}. Install it where other users can run it (a venv outside /root), "
                                        "or pass isolate=False for trusted code")
            argv = isolated_argv(mode, workdir / "gateway.sock", list(self.argv), uid)
            return await run(argv, stdin=document.encode(), timeout_s=self.timeout_s,
                             output_limit=self.output_limit, cwd=self.cwd or home, env=env, user=uid,
                             switch_user=False)


def _agent_home(workdir: Path, uid: int | None) -> str:
    """The agent's own directory in ``workdir``, beside the gateway's socket: ``uid``'s where there is one, which
    may enter ``workdir`` but not open the socket (0600: the relay's, which starts as this process's user)."""
    home = workdir / "home"
    home.mkdir(mode=0o700)
    if uid is not None:
        os.chown(home, uid, uid)
        workdir.chmod(0o711)
        (workdir / "gateway.sock").chmod(0o600)
    return str(home)


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
    event loop's episodes; :mod:`envkit.agents.process`): its CPU work then runs beside the capture gateway instead
    of in turns with it, and an agent that blocks its event loop stalls only its host. The agent must be a
    module-level function (the host imports it by name) and return JSON.

    ``rubric`` (:mod:`envkit.rewards.rubrics`) scores each episode from the grade and the agent's result.

    The agent is given the task's ``agent_fields`` (:data:`AGENT_FIELDS` by default) and nothing else: an answer
    in its task would be read, and learned to be read. None of them may be a grader's (:data:`GRADER_FIELDS`)."""

    def __init__(self, *, agent: Agent | None = None, grader: Grader | None = None,
                 tasks: Sequence[Task] | dict[str, Sequence[Task]] | None = None, agent_process: bool = False,
                 rubric: Rubric | str | None = None, agent_fields: Sequence[str] = AGENT_FIELDS) -> None:
        if graders := sorted(GRADER_FIELDS.intersection(agent_fields)):
            raise ValueError(f"agent_fields {graders} are what grades the agent: only the grader may see them")
        self.agent_fields = tuple(agent_fields)
        """The task fields the agent is given."""
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
        return await self._agent(self.agent_task(), client)

    def agent_task(self) -> Task:
        """What the agent is told of the current task: its :attr:`agent_fields`."""
        return {k: v for k, v in self._current().items() if k in self.agent_fields}

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
        :class:`~envkit.rewards.rubrics.EnvReward` is the grade)."""
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
