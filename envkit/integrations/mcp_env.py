"""MCPToolEnv: the tools of any MCP server as a tool env the generator can roll out in and the trainer can train on.

MCP gives tools, not tasks or rewards: those stay yours. A task is ``{"question": ..., "answer": ...}`` (the
keys the other envs and dataset rows use); the default grade compares the reply with ``answer``, ``grader=`` or a
``grade`` override replaces it::

    env = envkit.make("mcp+stdio:python my_server.py", tasks=[{"question": "What is 17 + 25?", "answer": 42}])
    env = envkit.make("mcp+http://127.0.0.1:9000/mcp", headers={"Authorization": "Bearer ..."},
                      grader="my_pkg.graders:exact")            # grader(reply, task) -> reward | (reward, info)
    env = MCPToolEnv("python my_server.py", tasks=tasks)         # the same as a class: subclass it to build the
                                                                 # episode (start_episode) and grade it yourself

The server is a command line (or argv list), run as a child process spoken to over stdio, or an ``http(s)://``
URL spoken to over streamable HTTP. ``init()`` starts or reaches it, finishes the MCP handshake and lists its tools,
which become the env's ``tools`` (OpenAI function schemas made from their input schemas) next to any ``@tool``
methods of a subclass. Each episode has an MCP session of its own: a ``reset`` after an episode that called tools
reconnects first, so no session state carries over (a stdio server is a fresh process; an HTTP server's own global
state is out of reach). ``close()`` ends the session and returns once a stdio server's process has exited: its stdin
closes, and one that lingers gets SIGTERM, then SIGKILL, sent to its process group. That holds when the rollout was
cancelled or timed out too: the session lives in a task of its own, which a cancelled caller still shuts down.

Calls go through ``tools/call``. Text content becomes the ``tool`` message (structured content as JSON when there
is no text; images, audio and binary resources as a line saying what they were). A result flagged ``isError``, an
unknown tool, arguments that do not fit the tool's schema, and a call that outlives ``MCPTimeouts.call_s`` come back
to the model as ``Error: ...`` and the episode goes on. A server that cannot be started or reached within
``MCPTimeouts.connect_s``, or that drops the connection, raises :class:`~envkit.errors.MCPServerError`: that
rollout fails and the others go on. Needs the ``mcp`` extra (``pip install 'envkit-rl[mcp]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import random
import shlex
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import anyio
import httpx2
from mcp import Client, StdioServerParameters, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import envkit
from envkit.core import Task
from envkit.errors import InvalidTaskError, MCPServerError, ResetNeededError, ToolCallError, ToolTimeoutError
from envkit.imports import import_ref
from envkit.messages import Message, system, user
from envkit.parsing import grade_number
from envkit.registry import EnvSpec
from envkit.tasks import check_split, check_task, pick_task
from envkit.tool_env import ToolEnv
from envkit.tools import Tool, ToolOutput

log = logging.getLogger(__name__)

GradeResult = float | tuple[float, dict[str, Any]]
Grader = Callable[[str, Task], GradeResult | Awaitable[GradeResult]]
"""``grader(reply, task)``: the reward of the final reply (or ``(reward, info)``), sync or async."""

DEFAULT_SYSTEM_PROMPT = """\
You can call these tools:
{tools}
To call one, write exactly:
<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>
Its result comes back in the next message. When you are done, give your final answer without a tool call."""
"""The system prompt of an MCPToolEnv unless told otherwise; ``{tools}`` becomes one JSON schema line per tool, so
models whose chat template leaves out ``tools`` (SmolLM2's does) still learn what they can call."""

_MAX_TOOL_PAGES = 100  # a server whose tools/list cursor never ends cannot hang init()


@dataclass(frozen=True, kw_only=True)
class MCPTimeouts:
    """How long an MCPToolEnv waits for its server."""

    connect_s: float = 30.0
    """Start the server (stdio) or reach it (HTTP), finish the handshake and list its tools; past it init() and
    reset() raise MCPServerError."""
    call_s: float = 60.0
    """One tool call; past it the model reads ``Error: the tool ... did not answer`` and the episode goes on."""
    close_s: float = 10.0
    """Shut the session down (a stdio server's stdin closes; SIGTERM after 2 s, SIGKILL 2 s later); past it the
    session is cancelled, and past that again abandoned with a warning."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"MCPTimeouts.{f.name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class MCPTarget:
    """Where the MCP server is: a command run over stdio (``argv``) or a streamable HTTP ``url``."""

    argv: tuple[str, ...] = ()
    url: str = ""

    @classmethod
    def parse(cls, server: str | Sequence[str]) -> MCPTarget:
        """An ``http(s)://`` URL, else a command line (split like a shell does) or an argv list."""
        if isinstance(server, str):
            if server.startswith(("http://", "https://")):
                return cls(url=server)
            server = shlex.split(server)
        argv = tuple(server)
        if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise ValueError(f"an MCP server is a command line like 'python my_server.py', an argv list, or an "
                             f"http(s):// URL of a streamable HTTP endpoint; got {server!r}")
        return cls(argv=argv)

    def __str__(self) -> str:
        return self.url or shlex.join(self.argv)


def match_answer(reply: str, task: Task) -> tuple[float, dict[str, Any]]:
    """The default grade: 1.0 when the reply's final number equals a numeric ``task["answer"]``, or when the reply
    contains a string ``answer`` (ignoring case)."""
    expected = task.get("answer")
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        info = grade_number(reply, expected)
        return float(info["correct"]), info
    if isinstance(expected, str):
        correct = expected.strip().casefold() in reply.casefold()
        return float(correct), {"correct": correct, "expected": expected}
    raise InvalidTaskError(f"task has no 'answer' (a number or a string) to grade against, got {expected!r:.80}: "
                           "give tasks an answer, pass grader=..., or override grade()")


def tool_text(result: types.CallToolResult) -> str:
    """What the model reads of a ``tools/call`` result: its text blocks, structured content as JSON when there is
    no text, and a line naming each block a chat cannot carry (images, audio, binary resources)."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.EmbeddedResource) and isinstance(block.resource, types.TextResourceContents):
            parts.append(block.resource.text)
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource {block.uri}" + (f": {block.name}]" if block.name else "]"))
        elif isinstance(block, types.ImageContent | types.AudioContent):
            parts.append(f"[{block.type} of type {block.mime_type}, not shown]")
        else:  # a binary embedded resource
            parts.append(f"[binary resource {getattr(block, 'resource', block)!s:.80}, not shown]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _describe(e: BaseException) -> str:
    """``Type: message`` of the innermost failure: the SDK's transports raise from task groups, which wrap it."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _Session:
    """One MCP client session, held open by a task of its own.

    The SDK's transports run in anyio task groups, which only the task that entered them may leave; an env is
    opened and closed by whichever task its caller runs in (on ``envkit serve``, one request each). So the session's
    own task enters and leaves them, and calls reach the session from any task of the loop.
    """

    def __init__(self, target: MCPTarget, *, headers: Mapping[str, str], env: Mapping[str, str], cwd: str | None,
                 timeouts: MCPTimeouts) -> None:
        self.target, self.headers, self.env, self.cwd, self.timeouts = target, headers, env, cwd, timeouts
        self.client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._scope: anyio.CancelScope | None = None
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[Client] | None = None

    @property
    def is_open(self) -> bool:
        """True between a successful ``open`` and ``close``."""
        return self.client is not None

    async def open(self) -> None:
        """Start or reach the server and finish the handshake within ``connect_s``, or raise MCPServerError."""
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._stop, self._ready, self._scope = asyncio.Event(), ready, None
        self._task = asyncio.create_task(self._hold(ready), name=f"envkit mcp session: {self.target}")
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                self.client = await asyncio.shield(ready)
        except BaseException as e:  # failed, timed out or cancelled: nothing of the session may outlive this
            await asyncio.shield(self.close())
            if ready.done() and not ready.cancelled():
                ready.exception()  # read, so asyncio does not report it: what is raised here says it all
            if isinstance(e, TimeoutError):
                raise MCPServerError(f"the MCP server {self.target} did not finish the handshake within "
                                     f"{self.timeouts.connect_s:g} s (MCPTimeouts.connect_s)") from e
            raise

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        """Enter the transport and the client session, hand the client over, and wait until closed."""
        try:
            with anyio.CancelScope() as self._scope:
                async with contextlib.AsyncExitStack() as stack:
                    client = await stack.enter_async_context(await self._client(stack))
                    ready.set_result(client)
                    await self._stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(MCPServerError(f"cannot start or reach the MCP server {self.target}: "
                                                   f"{_describe(e)}"))
            else:
                log.info("the session with the MCP server %s ended with %s", self.target, _describe(e))
        finally:
            if not ready.done():
                ready.set_exception(MCPServerError(f"the session with the MCP server {self.target} was cancelled "
                                                   "before the handshake finished"))

    async def _client(self, stack: contextlib.AsyncExitStack) -> Client:
        server: Any
        if self.target.url:
            # The session's read timeout bounds each call; the HTTP client's own must not cut a slow tool short.
            http = await stack.enter_async_context(
                httpx2.AsyncClient(headers=dict(self.headers), timeout=httpx2.Timeout(self.timeouts.connect_s,
                                                                                      read=None)))
            server = streamable_http_client(self.target.url, http_client=http)
        else:
            server = StdioServerParameters(command=self.target.argv[0], args=list(self.target.argv[1:]),
                                           env=dict(self.env) or None, cwd=self.cwd)
        return Client(server, read_timeout_seconds=self.timeouts.call_s,
                      client_info=types.Implementation(name="envkit", version=envkit.__version__))

    async def close(self) -> None:
        """End the session and wait (``close_s``, then as long again after cancelling it) for its transport to shut
        down: for a stdio server, until its process has exited. Safe to call twice."""
        task, self._task, self.client = self._task, None, None
        if task is None:
            return
        self._stop.set()
        if self._scope is None:  # the task has not started yet: nothing to tear down
            task.cancel()
        elif self._ready is not None and not self._ready.done():  # still connecting: no reason to wait
            self._scope.cancel()
        for attempt in range(2):
            await asyncio.wait({task}, timeout=self.timeouts.close_s)
            if task.done():
                return
            if attempt == 0 and self._scope is not None:
                self._scope.cancel()  # an anyio cancel keeps the SDK's shielded process teardown intact
        log.warning("the session with the MCP server %s did not shut down within %g s; abandoning it", self.target,
                    2 * self.timeouts.close_s)

    def _connected(self) -> Client:
        if self.client is None:
            raise MCPServerError(f"no session with the MCP server {self.target}: call init() or reset() first")
        return self.client

    async def list_tools(self) -> list[types.Tool]:
        """Every tool the server lists, page by page."""
        client, tools, cursor = self._connected(), [], None
        for _ in range(_MAX_TOOL_PAGES):
            try:
                page = await self._request("tools/list", client.list_tools(cursor=cursor))
            except MCPError as e:
                raise MCPServerError(f"the MCP server {self.target} refused tools/list: {e.message}") from e
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                return tools
        raise MCPServerError(f"the MCP server {self.target} lists tools over more than {_MAX_TOOL_PAGES} pages")

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """One ``tools/call``: protocol errors and timeouts are the model's (ToolCallError), a lost connection is
        the server's (MCPServerError)."""
        try:
            return await self._request(f"tools/call {name!r}", self._connected().call_tool(name, arguments))
        except MCPError as e:
            if e.code == types.REQUEST_TIMEOUT:
                raise ToolTimeoutError(f"the tool {name!r} did not answer within {self.timeouts.call_s:g} s") from e
            raise ToolCallError(e.message) from e

    async def _request(self, what: str, request: Awaitable[Any]) -> Any:
        try:
            return await request
        except MCPError as e:
            if e.code == types.CONNECTION_CLOSED:
                raise MCPServerError(f"the MCP server {self.target} closed the connection during {what}") from e
            raise
        except Exception as e:  # the transport broke under the request: the server is gone or unreachable
            raise MCPServerError(f"{what} on the MCP server {self.target} failed: {_describe(e)}") from e


class MCPToolEnv(ToolEnv):
    """A ToolEnv whose tools come from an MCP server (stdio command or streamable HTTP URL); tasks and grading are
    yours: ``tasks=``/``reset(task=...)`` with ``{"question", "answer"}``, ``grader=`` or a ``grade`` override."""

    def __init__(
        self,
        server: str | Sequence[str],
        *,
        tasks: Sequence[Task] | Mapping[str, Sequence[Task]] | None = None,
        grader: Grader | str | None = None,
        system_prompt: str | None = None,
        max_turns: int | None = None,
        allowed_tools: Sequence[str] | None = None,
        headers: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeouts: MCPTimeouts | Mapping[str, float] | None = None,
    ) -> None:
        """``server``: ``"python my_server.py"``, ``["python", "my_server.py"]`` or ``"http://host:port/mcp"``.

        ``tasks``: a list (the train split) or ``{"train": [...], "test": [...]}``. ``grader``: a callable or a
        ``"module:function"`` path. ``system_prompt``: None for :data:`DEFAULT_SYSTEM_PROMPT`, "" for none; a
        ``{tools}`` in it becomes the tools' schemas.
        ``allowed_tools``: expose only these of the server's tools. ``headers``: sent with every HTTP request
        (e.g. a bearer token). ``env`` and ``cwd``: a stdio server's extra environment variables (the SDK passes it
        only a safe few of ours, PATH among them) and working directory.
        """
        super().__init__(max_turns=max_turns)
        self.target = MCPTarget.parse(server)
        if self.target.url and (env or cwd):
            raise ValueError("env= and cwd= configure a stdio server's process; this one is a URL")
        if not self.target.url and headers:
            raise ValueError("headers= go with an HTTP server's requests; this one is a stdio command")
        self._task_lists: dict[str, list[Task]] | None = None
        if tasks is not None:
            self._task_lists = ({check_split(k): list(v) for k, v in tasks.items()} if isinstance(tasks, Mapping)
                                else {"train": list(tasks)})
        self.grader = _load_grader(grader)
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.allowed_tools = None if allowed_tools is None else list(allowed_tools)
        if isinstance(timeouts, Mapping):
            timeouts = MCPTimeouts(**timeouts)
        self.timeouts = timeouts or MCPTimeouts()
        self.tools = list(type(self).tools)  # type: ignore[misc]  # @tool methods; the server's join them in init()
        self.task: Task | None = None
        """The episode's task (what ``grade`` grades against)."""
        self._session = _Session(self.target, headers=headers or {}, env=env or {}, cwd=cwd, timeouts=self.timeouts)
        self._remote: dict[str, Tool] = {}
        self._episode_called = False
        self._rng = random.Random()
        self.spec = EnvSpec(name=f"mcp+{self.target.url}" if self.target.url else f"mcp+stdio:{self.target}",
                            entry_point="envkit.integrations.mcp_env:MCPToolEnv", kwargs={"server": str(self.target)},
                            description=f"the tools of the MCP server {self.target}", source="mcp")

    async def init(self) -> None:
        """Start or reach the server, finish the MCP handshake and list its tools (idempotent)."""
        if self._session.is_open:
            return
        await self._session.open()
        try:
            listed = await self._session.list_tools()
        except BaseException:
            await asyncio.shield(self._session.close())
            raise
        self._remote = {t.name: Tool(t.name, t.description or "", dict(t.input_schema)) for t in listed}
        if self.allowed_tools is not None:
            missing = [n for n in self.allowed_tools if n not in self._remote]
            if missing:
                await self._session.close()
                raise ValueError(f"allowed_tools names {missing} that the MCP server {self.target} does not have; "
                                 f"it has: {', '.join(self._remote) or 'no tools'}")
            self._remote = {n: self._remote[n] for n in self.allowed_tools}
        local = {t.name: t for t in type(self).tools}
        clash = sorted(set(local) & set(self._remote))
        if clash:
            await self._session.close()
            raise ValueError(f"{type(self).__name__} defines tools the MCP server {self.target} has too: {clash}; "
                             "rename the methods or leave those out with allowed_tools=")
        self.tools = [*local.values(), *self._remote.values()]  # type: ignore[misc]
        self._episode_called = False

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        # A fresh session per episode: whatever the last episode's calls left in the session goes with it.
        if self._episode_called:
            await self._session.close()
        await self.init()
        return await super().reset(seed=seed, task=task)

    async def close(self) -> None:
        """End the MCP session (a stdio server's process goes with it)."""
        await self._session.close()

    def tasks(self, split: str = "train") -> Sequence[Task] | None:
        """The tasks given as ``tasks=`` for ``split`` (None when none were given)."""
        if self._task_lists is None:
            return None
        return self._task_lists.get(check_split(split), [])

    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[Message], dict]:
        """The system prompt and the task's ``question``; the task is ``task``, else ``tasks()[seed % n]``.

        Override it to build the opening from the server (``await self.run_tool(name, arguments)``, then
        ``self.opening(question)``), setting ``self.task`` when the default ``grade`` should grade against it.
        """
        if task is None:
            tasks = self.tasks("train")
            if not tasks:
                raise InvalidTaskError(f"{type(self).__name__} has no tasks to pick from: pass tasks=[{{'question': "
                                       "..., 'answer': ...}] or reset(task=...)")
            task = pick_task(tasks, seed, self._rng)
        if self.grader is None and type(self).grade is MCPToolEnv.grade:
            check_task(task, question=str, answer=(int, float, str))
        else:
            check_task(task, question=str)
        self.task = task
        return self.opening(task["question"]), {"task": task}

    def opening(self, question: str) -> list[Message]:
        """The system prompt (its ``{tools}`` replaced by the tools' schemas, one JSON line each) and ``question``."""
        if not self.system_prompt:
            return [user(question)]
        schemas = "\n".join(json.dumps(t.to_openai()["function"]) for t in self.tools)
        return [system(self.system_prompt.replace("{tools}", schemas)), user(question)]

    async def grade(self, answer: str) -> tuple[float, dict[str, Any]]:
        """``grader(answer, task)`` when given, else :func:`match_answer` against the task's ``answer``."""
        if self.task is None:
            raise ResetNeededError("step() needs an active episode; call reset() first.")
        if self.grader is None:
            return match_answer(answer, self.task)
        out = self.grader(answer, self.task)
        if inspect.isawaitable(out):
            out = await out
        return (float(out[0]), dict(out[1])) if isinstance(out, tuple) else (float(out), {})

    async def run_tool(self, name: str, arguments: Any) -> str | ToolOutput:
        """Run ``name`` on the MCP server (``@tool`` methods run here); its error results raise ToolCallError."""
        spec = self._remote.get(name)
        if spec is None:
            return await super().run_tool(name, arguments)
        problem = spec.validate_arguments(arguments)
        if problem:
            raise ToolCallError(problem)
        self._episode_called = True
        result = await self._session.call_tool(name, arguments)
        text = tool_text(result)
        if result.is_error:
            raise ToolCallError(text or f"the tool {name!r} failed")
        return text


def _load_grader(grader: Grader | str | None) -> Grader | None:
    """``grader`` itself, or the function a ``"module:function"`` path names (configs and ``--kwargs`` are text)."""
    if grader is None or callable(grader):
        return grader
    try:
        found = import_ref(grader) if ":" in grader else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"grader {grader!r} could not be loaded: {type(e).__name__}: {e}") from e
    if not callable(found):
        raise ValueError(f"grader must be a callable or a 'module:function' path, got {grader!r}")
    return found


def make_mcp(name: str, **kwargs: Any) -> MCPToolEnv:
    """The ``mcp`` scheme of ``envkit.make``: ``mcp+stdio:COMMAND LINE`` runs the command as a stdio server,
    ``mcp+http://HOST:PORT/PATH`` (or ``mcp+https``) is a streamable HTTP endpoint; kwargs go to
    :class:`MCPToolEnv`."""
    transport, _, rest = name.partition(":")
    if transport == "mcp+stdio":
        return MCPToolEnv(shlex.split(rest), **kwargs)
    if transport in ("mcp+http", "mcp+https"):
        return MCPToolEnv(f"{transport.removeprefix('mcp+')}:{rest}", **kwargs)
    raise ValueError(f"{name!r} names no MCP transport: use mcp+stdio:COMMAND LINE (e.g. 'mcp+stdio:python "
                         "my_server.py') or mcp+http://HOST:PORT/PATH (or mcp+https://...)")
