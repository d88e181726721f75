"""The sessions of one served env: :class:`EnvServer` makes, steps and closes their envs under the limits (step
timeout, capacity, idle reaper) and classifies what an env raises; the REST routes, the fast REST step and the
WebSocket endpoint all call its operations."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import envkit
from envkit.core import Env
from envkit.errors import (
    EnvError,
    EnvLoadError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidTaskError,
    ResetNeededError,
    SnapshotError,
    ToolCallError,
)
from envkit.json_limits import json_problem
from envkit.multi_agent import MultiAgentEnv
from envkit.remote import OPERATOR_KWARGS, wire
from envkit.remote.deadlines import Canceller, Deadlines
from envkit.remote.protocol import PROTOCOL_VERSION, ApiError
from envkit.remote.server.config import ServerLimits
from envkit.remote.server.metrics import Metrics
from envkit.remote.server.snapshots import SnapshotSeal, snapshot_key
from envkit.remote.server.workers import FLUSH_S, LocalSlots, WorkerSlots
from envkit.table import Table
from envkit.tasks import task_counts
from envkit.tool_env import ToolEnv
from envkit.tools import Tool, ToolOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVER_CHOSEN = frozenset({"checked", "sandbox"}) | OPERATOR_KWARGS
"""Kwargs a session may not set: where and how the server runs its envs, and the operator's (OPERATOR_KWARGS)."""
TASK_LISTS_KEPT = 16
"""Task lists kept per server, one per (kwargs, split): a client cannot make the server hold more by varying kwargs."""

_CONTRACT_CODES: dict[type[Exception], str] = {
    InvalidTaskError: "invalid_task",
    InvalidActionError: "invalid_action",
    EpisodeDoneError: "episode_done",
    ResetNeededError: "reset_needed",
    SnapshotError: "snapshot_unsupported",
}
"""The answer's code for each error of the Env contract an env call may raise, in the order they are matched; anything
else an env raises is ``env_error``."""
_CONTRACT_ERRORS = tuple(_CONTRACT_CODES)


def _contract_code(e: Exception) -> str:
    """The answer's code for ``e``, an error of the contract: that of the first of :data:`_CONTRACT_CODES` it is."""
    return next(code for kind, code in _CONTRACT_CODES.items() if isinstance(e, kind))


@dataclass(eq=False)
class _Session:
    id: str
    env: Env
    created: float
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    episode: Literal["none", "active", "done", "failed"] = "none"
    episodes: int = 0
    steps: int = 0


def internal_error(e: Exception) -> ApiError:
    """The answer to a bug in the server itself (logged with its traceback)."""
    log.error("internal error", exc_info=e)
    return ApiError("internal_error", f"{type(e).__name__}: {e}")


def encode(body: Any) -> bytes:
    """The JSON of an answer's body; a value JSON cannot carry is the env's fault (``env_error``)."""
    try:
        return wire.dumps(body)
    except (TypeError, ValueError) as e:
        raise ApiError("env_error", f"the env returned a value JSON cannot carry: {e}") from e


def plain_step_action(frame: bytes | str, keys: frozenset[str]) -> dict[str, Any] | None:
    """The action of the commonest request, a step with a text-only assistant message, parsed without pydantic:
    ``frame`` must be a JSON object with exactly ``keys`` (a WebSocket frame's op is ``"step"``).

    None sends the frame through full validation, which gives the same answer for these frames, just slower.
    """
    try:
        parsed = wire.loads(frame)
    except ValueError:
        return None
    if type(parsed) is not dict or parsed.keys() != keys or parsed.get("op", "step") != "step":
        return None
    action = parsed["action"]
    if (type(action) is dict and action.keys() <= {"role", "content"} and action.get("role") == "assistant"
            and type(action.get("content")) is str):
        return action
    return None


class EnvServer:
    """The sessions of one served env and the operations on them; REST and WebSocket handlers both call these."""

    def __init__(self, env: str, *, env_kwargs: dict[str, Any] | None = None, limits: ServerLimits | None = None,
                 slots: LocalSlots | None = None) -> None:
        self.env_name = env
        self.env_kwargs = dict(env_kwargs or {})
        self.limits = limits or ServerLimits()
        self.slots = slots or LocalSlots()
        """Session capacity: this process's, or with ``--workers N`` the whole server's (a WorkerSlots)."""
        self.rest_sessions = self.slots.workers == 1
        self.sessions: dict[str, _Session] = {}
        self.metrics = Metrics()
        self._closing: set[asyncio.Task[None]] = set()
        self.deadlines = Deadlines()
        """Step timeouts and idle WebSockets: a timer per call would cost more than a fast env's step."""
        self._probe = envkit.make(env, **self.env_kwargs)  # fail fast on a bad name or kwargs; describes the env
        self.seats: tuple[str, ...] = self._probe.seats if isinstance(self._probe, MultiAgentEnv) else ()
        """A multi-agent env's seats (a session per seat, see :meth:`create`); () for a single-agent env."""
        self.tables: dict[str, Table] = {}
        """The open episodes of a multi-agent env, by id."""
        self.is_tool_env = isinstance(self._probe.unwrapped, ToolEnv)
        """Whether the env's tools are functions :meth:`run_tool` can call (``envkit serve --mcp``)."""
        self._task_lists: dict[tuple[str, str], Sequence[dict[str, Any]]] = {}
        self._seal = SnapshotSeal(snapshot_key())
        spec = self._probe.spec
        self.info = {
            "env": env,
            "description": spec.description if spec else "",
            "env_version": spec.version if spec else None,
            "envkit_version": envkit.__version__,
            "protocol_version": PROTOCOL_VERSION,
            "tools": [t.to_openai() for t in _tools(self._probe, None)],
            "tasks": task_counts(self._probe),  # type: ignore[arg-type]
            "spaces": (self._probe.spaces() if isinstance(self._probe, Env)
                       else {"seats": "a session per seat: its observations and actions as a single-agent env's"}),
            **({"seats": list(self.seats), "seat_tools": {seat: [t.to_openai() for t in _tools(self._probe, seat)]
                                                         for seat in self.seats}} if self.seats else {}),
        }

    # ---- lifecycle -------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the idle reaper; on exit close every session's env."""
        await self._probe.close()
        await self.slots.open()
        background = [asyncio.create_task(self._reap_forever(), name="envkit-reaper")]
        if isinstance(self.slots, WorkerSlots):
            background.append(asyncio.create_task(self._publish_forever(self.slots), name="envkit-metrics"))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            sessions, self.sessions = list(self.sessions.values()), {}
            await asyncio.gather(*(self._close_env(s, "shutdown") for s in sessions))
            await asyncio.gather(*self._closing, return_exceptions=True)
            await self.slots.close()

    async def _reap_forever(self) -> None:
        ttl = self.limits.session_ttl_s
        interval = min(max(ttl / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if now - s.last_used > ttl and not s.lock.locked():
                    self._drop_in_background(s, "expired")

    async def _publish_forever(self, slots: WorkerSlots) -> None:
        while True:
            await asyncio.to_thread(slots.write_metrics, self.metrics.snapshot())
            await asyncio.sleep(FLUSH_S)

    async def metrics_text(self) -> str:
        """``/metrics``: this process's numbers, or with several workers the sum of all of theirs."""
        if not isinstance(self.slots, WorkerSlots):
            return self.metrics.render(len(self.sessions), self.limits.max_sessions)
        others = await asyncio.to_thread(self.slots.other_metrics)
        per_worker = await asyncio.to_thread(self.slots.counts)
        total = Metrics.summed([self.metrics.snapshot(), *others])
        return total.render(sum(per_worker.values()), self.limits.max_sessions, per_worker)

    def _drop_in_background(self, s: _Session, reason: str) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        task = asyncio.create_task(self._close_env(s, reason))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_env(self, s: _Session, reason: str) -> None:
        """Close the session's env and give its slot back."""
        self.metrics.sessions_closed[reason] += 1
        try:
            await self._call(s.env.close())
        except ApiError as e:
            self.metrics.errors[e.code] += 1
            log.error("closing session %s (%s): %s", s.id, reason, e.message)
        finally:
            await self.slots.release()
            for table_id, table in list(self.tables.items()):
                if table.closed:
                    del self.tables[table_id]

    async def _call(self, coro: Awaitable[T]) -> T:
        """Await an env call under the step timeout; classify what it raises."""
        expire = Canceller()
        self.deadlines.add(expire, self.limits.step_timeout_s, expire)
        try:
            return await coro
        except asyncio.CancelledError as e:
            if not expire.expired:
                raise
            raise ApiError("env_timeout", f"the env did not answer within {self.limits.step_timeout_s:g} s "
                                          "(ServerLimits.step_timeout_s)") from e
        except _CONTRACT_ERRORS as e:
            raise ApiError(_contract_code(e), str(e)) from e
        except ApiError:
            raise
        except Exception as e:
            raise self._env_crash(e) from e
        finally:
            self.deadlines.discard(expire)
            if expire.expired:
                expire.task.uncancel()

    def _env_crash(self, e: BaseException) -> ApiError:
        log.error("env %s raised", self.env_name, exc_info=e)
        kind = "broke the contract" if isinstance(e, EnvError) else "raised"
        return ApiError("env_error", f"the env {kind}: {type(e).__name__}: {e}")

    # ---- operations ------------------------------------------------------------------------------------------

    async def create(self, kwargs: dict[str, Any], *, seat: str | None = None, table: str | None = None
                     ) -> dict[str, Any]:
        """Make a new env for a new session; answers its id and tools. A multi-agent env's session plays ``seat`` of
        a new episode's table, or of ``table``."""
        self._check_kwargs(kwargs)
        self._check_seat(kwargs, seat, table)
        if not await self.slots.admit(self.limits.max_sessions):  # held from here until _close_env
            raise ApiError("capacity", f"the server is at its limit of {self.limits.max_sessions} sessions "
                                       "(ServerLimits.max_sessions); delete sessions or retry later")
        seated: dict[str, Any] = {}
        try:
            if seat is None:
                env: Env = self._make(kwargs)  # type: ignore[assignment]  # single-agent: _check_seat said so
            else:
                table = table or self._open_table(kwargs)
                env = self.tables[table].view(seat)
                seated = {"seat": seat, "table": table}
        except BaseException:
            await self.slots.release()
            raise
        now = time.monotonic()
        session = _Session(id=secrets.token_urlsafe(16), env=env, created=now, last_used=now)
        try:
            await self._call(env.init())
        except BaseException:
            await asyncio.shield(self._close_env(session, "failed"))
            raise
        self.sessions[session.id] = session
        self.metrics.sessions_created += 1
        return {"session_id": session.id, "env": self.env_name, "tools": [t.to_openai() for t in env.tools], **seated}

    def _check_seat(self, kwargs: dict[str, Any], seat: str | None, table: str | None) -> None:
        """A multi-agent env's session names a free seat (and a known table, with no kwargs: the table's env has
        its own); a single-agent env's names neither."""
        if not self.seats:
            if seat is not None or table is not None:
                raise ApiError("invalid_kwargs", f"env {self.env_name!r} has no seats: create its sessions without "
                                                 "seat or table")
            return
        if seat not in self.seats:
            raise ApiError("invalid_kwargs", f"env {self.env_name!r} is multi-agent: each session plays one of its "
                                             f"seats {list(self.seats)} (seat=...), got {seat!r}")
        if table is None:
            return
        if table not in self.tables or self.tables[table].closed:
            workers = (f"; this server runs {self.slots.workers} worker processes, and a table lives in one: serve "
                       "multi-agent envs with --workers 1" if self.slots.workers > 1 else "")
            raise ApiError("table_not_found", f"no open table {table!r} (unknown, or its episode is over){workers}")
        if kwargs:
            raise ApiError("invalid_kwargs", "a seat joining a table takes no kwargs: the table's env was made with "
                                             "its first seat's")
        if seat in self.tables[table].taken:
            raise ApiError("seat_taken", f"seat {seat!r} of table {table!r} is played by another session")

    def _open_table(self, kwargs: dict[str, Any]) -> str:
        """A new episode's table of the served multi-agent env made with ``kwargs``; its id."""
        env = self._make(kwargs)
        assert isinstance(env, MultiAgentEnv)
        table_id = secrets.token_urlsafe(16)
        self.tables[table_id] = Table(env)
        return table_id

    async def run_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one tool call in an env of its own, made and initialised for it and closed after (``envkit serve
        --mcp``): ``(text, failed)``, failed for the model's mistakes (unknown tool, bad arguments, the tool raised).
        The env's own failures raise ApiError, as a session's would."""
        start = time.perf_counter()
        try:
            created = await self.create({})
            s = self.sessions[created["session_id"]]
            try:
                async with s.lock:
                    return await self._call(_run_tool(s.env.unwrapped, name, arguments))
            finally:
                self._drop_in_background(s, "mcp")  # no await here: a cancelled call still closes its env
        except ApiError as e:
            self.metrics.errors[e.code] += 1
            raise
        finally:
            self.metrics.observe("tool_call", "mcp", time.perf_counter() - start)

    def get(self, session_id: str) -> _Session:
        """The open session ``session_id``."""
        session = self.sessions.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        return session

    def _not_found(self, session_id: str) -> ApiError:
        return ApiError("session_not_found", f"no session {session_id!r} (unknown, deleted, or closed after "
                                             f"{self.limits.session_ttl_s:g} s idle); create a new one")

    async def reset(self, session_id: str, seed: int | None, task: dict[str, Any] | None) -> dict[str, Any]:
        """Start an episode in the session."""
        s = self.get(session_id)
        if task is not None and (problem := json_problem(task, where="task")):
            raise ApiError("invalid_task", problem)
        async with s.lock:
            self._check_open(s)
            s.episode = "failed"  # until the env answers
            try:
                messages, info = await self._call(s.env.reset(seed=seed, task=task))
            finally:
                s.last_used = time.monotonic()
            s.episode, s.episodes = "active", s.episodes + 1
            return {"observation": messages, "info": info}

    async def step(self, session_id: str, action: dict[str, Any]) -> dict[str, Any]:
        """Apply one assistant message in the session's episode."""
        s = self.get(session_id)
        if problem := json_problem(action, where="action"):  # before the env: no env need guard its text
            raise ApiError("invalid_action", problem)
        async with s.lock:
            self._check_open(s)
            if s.episode != "active":
                raise self._not_active(s)
            try:
                result = await self._call(s.env.step(action))  # type: ignore[arg-type]
            except ApiError as e:
                if e.code in ("env_error", "env_timeout"):
                    s.episode = "failed"
                raise
            finally:
                s.last_used = time.monotonic()
            s.steps += 1
            if result.terminated or result.truncated:
                s.episode = "done"
            return {"observation": result.observation, "reward": float(result.reward),
                    "terminated": result.terminated, "truncated": result.truncated, "info": result.info}

    def state(self, session_id: str) -> dict[str, Any]:
        """Where the session stands."""
        s = self.get(session_id)
        now = time.monotonic()
        return {"session_id": s.id, "env": self.env_name, "episode_active": s.episode == "active",
                "episodes": s.episodes, "steps": s.steps, "idle_s": now - s.last_used, "age_s": now - s.created}

    async def snapshot(self, session_id: str) -> dict[str, Any]:
        """The session's env state as a sealed token (``Env.snapshot``), mid-episode included."""
        s = self.get(session_id)
        async with s.lock:
            self._check_open(s)
            try:
                snapshot = await self._call(s.env.snapshot())
            finally:
                s.last_used = time.monotonic()
            return {"snapshot": self._seal.seal(self.env_name, snapshot, s.episode)}

    async def restore(self, session_id: str, token: str) -> dict[str, Any]:
        """Put the session's env in the state a snapshot token holds (``Env.restore``); answers its state."""
        s = self.get(session_id)
        snapshot, episode = self._seal.open(token, self.env_name)
        async with s.lock:
            self._check_open(s)
            s.episode = "failed"  # until the env answers
            try:
                await self._call(s.env.restore(snapshot))
            finally:
                s.last_used = time.monotonic()
            s.episode = episode  # type: ignore[assignment]  # sealed from a session's own
        return self.state(session_id)

    async def delete(self, session_id: str, reason: str = "deleted") -> None:
        """Close the session's env and forget the session."""
        s = self.get(session_id)
        del self.sessions[session_id]
        async with s.lock:  # let a running step finish first
            await self._close_env(s, reason)

    def _check_open(self, s: _Session) -> None:
        if self.sessions.get(s.id) is not s:  # deleted or reaped while this request waited for the lock
            raise self._not_found(s.id)

    @staticmethod
    def _not_active(s: _Session) -> ApiError:
        if s.episode == "done":
            return ApiError("episode_done", "step() after the episode ended (terminated or truncated); reset first")
        if s.episode == "failed":
            return ApiError("reset_needed", "the last reset or step of this session failed; reset to go on")
        return ApiError("reset_needed", "step() before reset(); reset the session first")

    @staticmethod
    def _check_kwargs(kwargs: dict[str, Any]) -> None:
        chosen = sorted(SERVER_CHOSEN & kwargs.keys())
        if chosen:  # where and how the env runs is the operator's choice (a client must not start containers here)
            raise ApiError("invalid_kwargs", f"{', '.join(chosen)} cannot be set by a session: the server chooses it "
                                             "(envkit serve's own options)")

    def _make(self, kwargs: dict[str, Any]) -> Env | MultiAgentEnv:
        """The served env with a client's ``kwargs`` over the served ones."""
        try:
            return envkit.make(self.env_name, **{**self.env_kwargs, **kwargs})
        except EnvLoadError as e:
            raise ApiError("invalid_kwargs", str(e)) from e

    async def tasks(self, split: str, offset: int, limit: int, kwargs: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
        """One page of the task list for ``split`` of the served env made with ``kwargs`` (the ``/tasks`` body):
        the tasks a session created with the same kwargs plays."""
        kwargs = kwargs or {}
        key = (wire.dumps(dict(sorted(kwargs.items()))).decode(), split)
        if key not in self._task_lists:
            self._check_kwargs(kwargs)
            env = self._make(kwargs) if kwargs else self._probe
            try:
                listed = await asyncio.to_thread(self._list_tasks, env, split)
            finally:
                if env is not self._probe:
                    await env.close()
            if len(self._task_lists) >= TASK_LISTS_KEPT:
                del self._task_lists[next(iter(self._task_lists))]
            self._task_lists[key] = listed
        tasks = self._task_lists[key]
        page = [dict(tasks[i]) for i in range(min(offset, len(tasks)), min(offset + limit, len(tasks)))]
        return {"split": split, "total": len(tasks), "offset": offset, "tasks": page, "kwargs": kwargs}

    def _list_tasks(self, env: Env | MultiAgentEnv, split: str) -> Sequence[dict[str, Any]]:
        try:
            tasks = env.tasks(split)
        except ValueError as e:
            raise ApiError("invalid_split", str(e)) from e
        if tasks is None:
            raise ApiError("no_tasks", f"env {self.env_name!r} does not list its tasks; draw its episodes by seed "
                                       "instead")
        return tasks if isinstance(tasks, Sequence) else list(tasks)

    async def answer(self, op: str, transport: str, work: Awaitable[Any], status: int = 200) -> tuple[int, bytes]:
        """Await one operation and return the answer's status and body (204 and no body for None, an error's
        status and body for an ApiError, ``internal_error`` for anything else), counting its latency and any
        error."""
        start = time.perf_counter()
        try:
            body = await work
            return (204, b"") if body is None else (status, encode(body))
        except Exception as e:
            err = e if isinstance(e, ApiError) else internal_error(e)
            self.metrics.errors[err.code] += 1
            return err.status, err.encoded()
        finally:
            self.metrics.observe(op, transport, time.perf_counter() - start)

    async def server_info(self) -> dict[str, Any]:
        """The ``/info`` body: ``sessions`` counts the whole server's, ``worker`` says which process answered."""
        limits = self.limits
        worker = {"pid": os.getpid(), "workers": self.slots.workers, "sessions": len(self.sessions)}
        return {**self.info, "sessions": await self.slots.total(), "worker": worker,
                "max_sessions": limits.max_sessions, "session_ttl_s": limits.session_ttl_s,
                "step_timeout_s": limits.step_timeout_s, "max_request_bytes": limits.max_request_bytes,
                "rest_sessions": self.rest_sessions}


def _tools(env: Env | MultiAgentEnv, seat: str | None) -> list[Tool]:
    """An env's tools: a single-agent env's, or one seat's of a multi-agent env (none without a seat)."""
    if isinstance(env, MultiAgentEnv):
        return env.tools(seat) if seat is not None else []
    return env.tools


async def _run_tool(env: Env, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    if not isinstance(env, ToolEnv):
        raise TypeError(f"{type(env).__name__} is not a ToolEnv: its tools run inside step(), not one by one")
    try:
        out = await env.run_tool(name, arguments)
    except ToolCallError as e:
        return str(e), True
    return (out.text, out.status != "ok") if isinstance(out, ToolOutput) else (out, False)
