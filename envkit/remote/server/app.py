"""``envkit serve``: any registered env behind a FastAPI server, one isolated env instance per session.

The routes and bodies are in :mod:`envkit.remote.protocol`; :class:`envkit.remote.RemoteEnv` is the client. What the
server guarantees:

- isolation: each session owns its env instance; requests on one session run one at a time;
- containment: an env that raises answers ``500 env_error``, one that hangs past ``step_timeout_s`` answers
  ``504 env_timeout``; either way only that episode ends (reset to go on) and the other sessions never notice;
- limits: ``max_sessions`` (``503 capacity``), ``max_request_bytes`` (``413``), an idle TTL after which the
  reaper closes the env, and a bearer token on every route but ``/health``;
- every error is ``{"error": {"code", "message", "status"}}`` with a 4xx status for client mistakes;
- shutdown (SIGINT/SIGTERM) closes every env.

Envs run in the server's event loop (they are async): an env that blocks the loop with synchronous work stalls
every session, so CPU-heavy envs should offload to threads themselves, or the server runs ``--workers N``.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import envkit
from envkit import untrusted
from envkit.core import Env
from envkit.errors import (
    EnvError,
    EnvLoadError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidTaskError,
    ResetNeededError,
)
from envkit.remote import wire
from envkit.remote.deadlines import Canceller, Deadlines
from envkit.remote.protocol import (
    ERROR_STATUS,
    PROTOCOL_VERSION,
    ApiError,
    CreateSession,
    ErrorBody,
    ExecRequest,
    ExecResponse,
    Health,
    ResetRequest,
    ResetResult,
    ScrubResult,
    ServerInfo,
    SessionCreated,
    SessionState,
    StepRequest,
    StepResultBody,
    TaskPage,
    WsRequest,
)
from envkit.remote.server.guard import GuardedHttp, descriptor_budget
from envkit.remote.server.workers import FLUSH_S, RUN_DIR_ENV, LocalSlots, WorkerSlots
from envkit.tasks import task_counts

MAX_TASK_PAGE = 1024

log = logging.getLogger("envkit.remote.server")
T = TypeVar("T")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TOKEN_ENV = "ENVKIT_TOKEN"
LOG_LEVELS = ("debug", "info", "warning", "error")
_CONFIG_ENV = "ENVKIT_SERVE_CONFIG"  # hands the config to each worker process when --workers > 1
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """What one server allows; the defaults suit a trainer's rollout workers on one host."""

    max_sessions: int = 256
    """Concurrent sessions; one more answers ``503 capacity``."""
    session_ttl_s: float = 600.0
    """A session idle this long is closed by the reaper (its env too)."""
    step_timeout_s: float = 60.0
    """Longest ``init``/``reset``/``step``/``close`` of an env; past it the call answers ``504 env_timeout``."""
    max_request_bytes: int = 1 << 20
    """Largest request body or WebSocket frame; a bigger one answers ``413`` (REST) or closes the socket (1009)."""
    max_connections: int = 4096
    """Open connections (HTTP and WebSocket) per process; one more answers ``503 capacity`` and is closed. Lowered
    at start, with a warning, where the descriptor limit (``ulimit -n``) cannot hold them."""
    request_timeout_s: float = 10.0
    """A request's headers and body must arrive within this from its first byte (or from connecting); past it the
    server answers ``408 request_timeout`` and closes the connection."""
    idle_timeout_s: float = 60.0
    """A WebSocket that holds no session and sends nothing this long is closed (1001); one that holds a session is
    closed, and the session deleted, after ``session_ttl_s`` without a frame."""

    def __post_init__(self) -> None:
        for name in ("max_sessions", "session_ttl_s", "step_timeout_s", "max_request_bytes", "max_connections",
                     "request_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything ``envkit serve`` takes."""

    env: str
    """A registered env name or a ``package.module:EnvClass`` entry point."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor defaults for every session; a session's own ``kwargs`` override them."""
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    """Bearer token required on every route but ``/health``; None serves without auth."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    workers: int = 1
    """Processes sharing the port. Sessions live in one process, so with more than one only WebSocket sessions
    (one connection each) are served; REST session creation answers ``409 rest_unavailable``."""
    log_level: str = "warning"
    exec_user: int | None = None
    """Serve ``/exec`` and ``/exec/scrub``, running commands as this uid (sandbox images; needs root with
    CAP_SETUID, CAP_SETGID and CAP_KILL). None: no such routes."""
    exec_dir: str = "/work"
    """Where ``/exec`` commands run; their files persist there until ``/exec/scrub``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 1 <= self.port <= 65535):
            raise ValueError(f"the port must be an integer from 1 to 65535, got {self.port!r}")
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"workers must be an integer of at least 1, got {self.workers!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.exec_user is not None and not (isinstance(self.exec_user, int) and self.exec_user > 0):
            raise ValueError(f"exec_user must be a uid other than root's (a positive integer), got {self.exec_user!r}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict of this config."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServeConfig:
        """Rebuild a config from ``to_json()`` output."""
        return cls(**{**data, "limits": ServerLimits(**data["limits"])})


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


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.sum += seconds
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # the first bucket with seconds <= le


class _Metrics:
    """Counters and latency histograms, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self.sessions_created = 0
        self.sessions_closed: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[str] = Counter()
        self.latency: dict[tuple[str, str], _Histogram] = {}

    def observe(self, op: str, transport: str, seconds: float) -> None:
        self.requests[op, transport] += 1
        hist = self.latency.get((op, transport))
        if hist is None:
            hist = self.latency[op, transport] = _Histogram()
        hist.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        """These numbers as JSON (what a worker publishes for the others to sum)."""
        return {"sessions_created": self.sessions_created, "sessions_closed": dict(self.sessions_closed),
                "requests": [[op, t, n] for (op, t), n in self.requests.items()], "errors": dict(self.errors),
                "latency": [[op, t, h.counts, h.sum] for (op, t), h in self.latency.items()]}

    @classmethod
    def summed(cls, snapshots: Sequence[dict[str, Any]]) -> _Metrics:
        """The metrics of several workers added up."""
        total = cls()
        for snap in snapshots:
            total.sessions_created += snap["sessions_created"]
            total.sessions_closed.update(snap["sessions_closed"])
            total.errors.update(snap["errors"])
            for op, t, n in snap["requests"]:
                total.requests[op, t] += n
            for op, t, counts, seconds in snap["latency"]:
                hist = total.latency.setdefault((op, t), _Histogram())
                hist.counts = [a + b for a, b in zip(hist.counts, counts, strict=True)]
                hist.sum += seconds
        return total

    def render(self, sessions: int, max_sessions: int, per_worker: dict[int, int] | None = None) -> str:
        """The Prometheus text; ``per_worker`` (sessions by worker pid) adds the workers' gauges."""
        lines = [
            "# HELP envkit_sessions Open sessions.", "# TYPE envkit_sessions gauge", f"envkit_sessions {sessions}",
            "# HELP envkit_sessions_max Session capacity.", "# TYPE envkit_sessions_max gauge",
            f"envkit_sessions_max {max_sessions}",
            "# HELP envkit_sessions_created_total Sessions created.", "# TYPE envkit_sessions_created_total counter",
            f"envkit_sessions_created_total {self.sessions_created}",
            "# HELP envkit_sessions_closed_total Sessions closed, by reason.",
            "# TYPE envkit_sessions_closed_total counter",
        ]
        if per_worker is not None:
            lines += ["# HELP envkit_workers Worker processes serving.", "# TYPE envkit_workers gauge",
                      f"envkit_workers {len(per_worker)}",
                      "# HELP envkit_worker_sessions Open sessions per worker process.",
                      "# TYPE envkit_worker_sessions gauge"]
            lines += [f'envkit_worker_sessions{{worker="{pid}"}} {n}' for pid, n in sorted(per_worker.items())]
        lines += [f'envkit_sessions_closed_total{{reason="{r}"}} {n}' for r, n in sorted(self.sessions_closed.items())]
        lines += ["# HELP envkit_requests_total Session operations served, by op and transport.",
                  "# TYPE envkit_requests_total counter"]
        lines += [f'envkit_requests_total{{op="{op}",transport="{t}"}} {n}'
                  for (op, t), n in sorted(self.requests.items())]
        lines += ["# HELP envkit_errors_total Error answers, by code.", "# TYPE envkit_errors_total counter"]
        lines += [f'envkit_errors_total{{code="{c}"}} {n}' for c, n in sorted(self.errors.items())]
        lines += ["# HELP envkit_op_seconds Latency of session operations (env time included).",
                  "# TYPE envkit_op_seconds histogram"]
        for (op, t), hist in sorted(self.latency.items()):
            labels = f'op="{op}",transport="{t}"'
            cumulative = 0
            for bound, count in zip((*_LATENCY_BUCKETS, math.inf), hist.counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else repr(bound)
                lines.append(f'envkit_op_seconds_bucket{{{labels},le="{le}"}} {cumulative}')
            lines.append(f"envkit_op_seconds_sum{{{labels}}} {hist.sum:.6f}")
            lines.append(f"envkit_op_seconds_count{{{labels}}} {cumulative}")
        return "\n".join(lines) + "\n"


def _encode(body: Any) -> bytes:
    try:
        return wire.dumps(body)
    except (TypeError, ValueError) as e:
        raise ApiError("env_error", f"the env returned a value JSON cannot carry: {e}") from e


def _plain_step_action(frame: bytes | str, keys: frozenset[str]) -> dict[str, Any] | None:
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


_WS_STEP, _REST_STEP = frozenset({"op", "action"}), frozenset({"action"})


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
        self.metrics = _Metrics()
        self._closing: set[asyncio.Task[None]] = set()
        self.deadlines = Deadlines()
        """Step timeouts and idle WebSockets: a timer per call would cost more than a fast env's step."""
        self._probe = envkit.make(env, **self.env_kwargs)  # fail fast on a bad name or kwargs; describes the env
        self._task_lists: dict[str, Sequence[dict[str, Any]]] = {}
        spec = self._probe.spec
        self.info = {
            "env": env,
            "description": spec.description if spec else "",
            "env_version": spec.version if spec else None,
            "envkit_version": envkit.__version__,
            "protocol_version": PROTOCOL_VERSION,
            "tools": [t.to_openai() for t in self._probe.tools],
            "tasks": task_counts(self._probe),
            "spaces": self._probe.spaces(),
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
        total = _Metrics.summed([self.metrics.snapshot(), *others])
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
        except InvalidTaskError as e:
            raise ApiError("invalid_task", str(e)) from e
        except InvalidActionError as e:
            raise ApiError("invalid_action", str(e)) from e
        except EpisodeDoneError as e:
            raise ApiError("episode_done", str(e)) from e
        except ResetNeededError as e:
            raise ApiError("reset_needed", str(e)) from e
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

    async def create(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Make a new env for a new session; answers its id and tools."""
        if not await self.slots.admit(self.limits.max_sessions):  # held from here until _close_env
            raise ApiError("capacity", f"the server is at its limit of {self.limits.max_sessions} sessions "
                                       "(ServerLimits.max_sessions); delete sessions or retry later")
        try:
            env = envkit.make(self.env_name, **{**self.env_kwargs, **kwargs})
        except BaseException as e:
            await self.slots.release()
            if isinstance(e, EnvLoadError):
                raise ApiError("invalid_kwargs", str(e)) from e
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
        return {"session_id": session.id, "env": self.env_name, "tools": [t.to_openai() for t in env.tools]}

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

    def tasks(self, split: str, offset: int, limit: int) -> dict[str, Any]:
        """One page of the served env's task list for ``split`` (the ``/tasks`` body)."""
        if split not in self._task_lists:
            try:
                tasks = self._probe.tasks(split)
            except ValueError as e:
                raise ApiError("invalid_split", str(e)) from e
            if tasks is None:
                raise ApiError("no_tasks", f"env {self.env_name!r} does not list its tasks; draw its episodes by "
                                           "seed instead")
            self._task_lists[split] = tasks if isinstance(tasks, Sequence) else list(tasks)
        tasks = self._task_lists[split]
        page = [dict(tasks[i]) for i in range(min(offset, len(tasks)), min(offset + limit, len(tasks)))]
        return {"split": split, "total": len(tasks), "offset": offset, "tasks": page}

    async def answer(self, op: str, transport: str, work: Awaitable[Any], status: int = 200) -> tuple[int, bytes]:
        """Await one operation and return the answer's status and body (204 and no body for None, an error's
        status and body for an ApiError), counting its latency and any error."""
        start = time.perf_counter()
        try:
            body = await work
            return (204, b"") if body is None else (status, _encode(body))
        except ApiError as e:
            self.metrics.errors[e.code] += 1
            return e.status, e.encoded()
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


# ---- ASGI middleware: auth and body size, before FastAPI parses anything ---------------------------------------


async def _send_json(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class _Guard:
    """Bearer-token check (all routes but /health) and the request body limit, as plain ASGI middleware.

    It also answers ``/ws`` itself, ahead of FastAPI's routing and exception middleware: a WebSocket session's
    task resumes through every ASGI layer above its handler once per frame, and those layers cost about a tenth of
    the server's CPU per step of a fast env.
    """

    def __init__(self, app: ASGIApp, *, server: EnvServer, token: str | None) -> None:
        self.app = app
        self.server = server
        self.ws = _WsEndpoint(server)
        self.token = token.encode() if token else None
        self.max_bytes = server.limits.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.token is not None and scope["path"] != "/health" and not self._authorized(scope):
            err = ApiError("unauthorized", "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                           f"(the token given to envkit serve via --token or {TOKEN_ENV})")
            self.server.metrics.errors[err.code] += 1
            if scope["type"] == "websocket":
                return await self._deny_websocket(scope, send, err)
            return await _send_json(send, err.status, err.encoded(), [(b"www-authenticate", b"Bearer")])
        if scope["type"] == "http":
            return await self._limit_body(scope, receive, send)
        if scope["path"] == "/ws":
            return await self.ws(scope, receive, send)
        return await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token or b"")
        return False

    @staticmethod
    async def _deny_websocket(scope: Scope, send: Send, err: ApiError) -> None:
        if "websocket.http.response" in scope.get("extensions", {}):
            payload = err.encoded()
            await send({"type": "websocket.http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": payload})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": err.code})

    async def _limit_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large = ApiError("payload_too_large", f"request body over {self.max_bytes} bytes "
                                                  "(ServerLimits.max_request_bytes)")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                self.server.metrics.errors[too_large.code] += 1
                return await _send_json(send, too_large.status, too_large.encoded())
        # Read the whole body first (bodies are small): a chunked upload cannot slip past the limit.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                self.server.metrics.errors[too_large.code] += 1
                return await _send_json(send, too_large.status, too_large.encoded())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        if scope["method"] == "POST" and await self._fast_step(scope, body, send):
            return

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


    async def _fast_step(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Answer ``POST /sessions/{id}/step`` with a plain text action past FastAPI's routing and validation
        (about two thirds of the server's CPU per REST step of a fast env); False leaves the request to FastAPI."""
        path: str = scope["path"]
        session_id = path[len("/sessions/"):-len("/step")]
        if not path.startswith("/sessions/") or not path.endswith("/step") or not session_id or "/" in session_id:
            return False
        if not any(name == b"content-type" and b"json" in value for name, value in scope["headers"]):
            return False
        action = _plain_step_action(body, _REST_STEP)
        if action is None:
            return False
        await _send_json(send, *await self.server.answer("step", "rest", self.server.step(session_id, action)))
        return True


# ---- the app ---------------------------------------------------------------------------------------------------


def _responses(*codes: str) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for code in ("unauthorized", "payload_too_large", "bad_request", "validation_error", *codes):
        status = ERROR_STATUS[code]
        entry = out.setdefault(status, {"model": ErrorBody, "description": ""})
        entry["description"] = ", ".join(filter(None, (entry["description"], code)))
    return out


_ENV_FAULTS = ("env_error", "env_timeout")


def create_app(env: str, *, env_kwargs: dict[str, Any] | None = None, token: str | None = None,
               limits: ServerLimits | None = None, slots: LocalSlots | None = None,
               workspace: untrusted.Workspace | None = None) -> FastAPI:
    """The FastAPI app serving ``env`` (a registered name or ``module:Class``); see the module docstring.
    With ``workspace``, also ``/exec`` and ``/exec/scrub`` (commands next to the env, in a sandbox)."""
    server = EnvServer(env, env_kwargs=env_kwargs, limits=limits, slots=slots)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with server.running():
            yield

    app = FastAPI(title=f"envkit serve {env}", version=envkit.__version__, lifespan=lifespan,
                  description=__doc__.split("\n\n")[0] + f" Protocol version {PROTOCOL_VERSION}.")
    app.state.env_server = server

    def answer(body: Any, status: int = 200) -> Response:
        return Response(_encode(body), status_code=status, media_type="application/json")

    def error(err: ApiError) -> Response:
        server.metrics.errors[err.code] += 1
        headers = {"retry-after": "1"} if err.code == "capacity" else None
        return Response(err.encoded(), status_code=err.status, media_type="application/json",
                        headers=headers)

    async def timed(op: str, work: Awaitable[Any], status: int = 200) -> Response:
        code, payload = await server.answer(op, "rest", work, status)
        if code == 204:
            return Response(status_code=204)
        return Response(payload, status_code=code, media_type="application/json",
                        headers={"retry-after": "1"} if code == 503 else None)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> Response:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error(ApiError("bad_request", "the body is not valid JSON"))
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type:
            return error(ApiError("bad_request", f"send the body as JSON with 'Content-Type: application/json' "
                                                 f"(got {content_type or 'no content type'!r})"))
        text = "; ".join(f"{'.'.join(str(x) for x in p.get('loc', ()))}: {p.get('msg')}" for p in problems[:5])
        return error(ApiError("validation_error", text or "the body does not fit the schema"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}.get(exc.status_code)
        if code is None:
            code = "bad_request" if exc.status_code < 500 else "internal_error"
        err = ApiError(code, str(exc.detail))
        err.status = exc.status_code
        return error(err)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        log.error("internal error", exc_info=exc)
        return error(ApiError("internal_error", f"{type(exc).__name__}: {exc}"))

    @app.get("/health", response_model=Health, tags=["server"])
    async def health() -> dict[str, str]:
        """Liveness; needs no token."""
        return {"status": "ok"}

    @app.get("/info", response_model=ServerInfo, responses=_responses(), tags=["server"])
    async def info() -> Response:
        """The served env (name, version, tools, task counts, spaces), protocol version, limits, open sessions."""
        return answer(await server.server_info())

    @app.get("/metrics", response_class=PlainTextResponse, responses=_responses(), tags=["server"])
    async def metrics() -> PlainTextResponse:
        """Prometheus text format: sessions, requests, errors by code, latency histograms."""
        return PlainTextResponse(await server.metrics_text())

    @app.get("/tasks", response_model=TaskPage, responses=_responses("invalid_split", "no_tasks"), tags=["server"])
    async def tasks(split: str = "train", offset: int = Query(0, ge=0),
                    limit: int = Query(256, ge=1, le=MAX_TASK_PAGE)) -> Response:
        """A page of the served env's tasks for ``split``; 404 ``no_tasks`` when the env does not list them."""
        try:
            return answer(server.tasks(split, offset, limit))
        except ApiError as e:
            return error(e)

    @app.post("/sessions", status_code=201, response_model=SessionCreated,
              responses=_responses("invalid_kwargs", "capacity", "rest_unavailable", *_ENV_FAULTS), tags=["sessions"])
    async def create_session(body: CreateSession | None = None) -> Response:
        """Create a session with its own env instance (``kwargs`` override the served defaults)."""
        if not server.rest_sessions:
            return error(ApiError("rest_unavailable", "this server runs several worker processes, so a REST session "
                                                      "could be routed to another one: use the WebSocket transport "
                                                      "(ws://...) or run envkit serve with --workers 1"))
        return await timed("create", server.create(body.kwargs if body else {}), 201)

    @app.post("/sessions/{session_id}/reset", response_model=ResetResult,
              responses=_responses("session_not_found", "invalid_task", *_ENV_FAULTS), tags=["sessions"])
    async def reset_session(session_id: str, body: ResetRequest | None = None) -> Response:
        """Start an episode: the same seed or task gives the same start."""
        body = body or ResetRequest()
        return await timed("reset", server.reset(session_id, body.seed, body.task))

    @app.post("/sessions/{session_id}/step", response_model=StepResultBody,
              responses=_responses("session_not_found", "reset_needed", "episode_done", "invalid_action",
                                   *_ENV_FAULTS), tags=["sessions"])
    async def step_session(session_id: str, body: StepRequest) -> Response:
        """Apply one assistant message."""
        return await timed("step", server.step(session_id, body.action.model_dump(exclude_unset=True)))

    @app.get("/sessions/{session_id}", response_model=SessionState, responses=_responses("session_not_found"),
             tags=["sessions"])
    async def session_state(session_id: str) -> Response:
        """Where the session stands: episode active, counts, idle time."""
        try:
            return answer(server.state(session_id))
        except ApiError as e:
            return error(e)

    @app.delete("/sessions/{session_id}", status_code=204, responses=_responses("session_not_found"),
                tags=["sessions"])
    async def delete_session(session_id: str) -> Response:
        """Close the session's env and forget the session."""
        return await timed("delete", server.delete(session_id))

    if workspace is not None:
        @app.post("/exec", response_model=ExecResponse, responses=_responses(), tags=["sandbox"])
        async def exec_command(body: ExecRequest) -> Response:
            """Run a command as the exec user in the exec dir, one at a time; nothing it starts outlives it."""
            try:
                stdin = base64.b64decode(body.stdin_b64, validate=True)
            except ValueError:
                return error(ApiError("validation_error", "stdin_b64 is not base64"))
            # A missing program is the command's own failure (exit 127 from env), as in a shell.
            result = await workspace.run(body.argv, stdin=stdin, timeout_s=body.timeout_s,
                                         output_limit=body.output_limit)
            return answer(result.decoded())

        @app.post("/exec/scrub", response_model=ScrubResult, responses=_responses(), tags=["sandbox"])
        async def exec_scrub() -> Response:
            """Kill the exec user's processes and delete its files; answers what is left (empty lists: clean)."""
            processes, files = await workspace.scrub()
            return answer({"processes": processes, "files": files})

    app.add_middleware(_Guard, server=server, token=token)
    return app


class _WsEndpoint:
    """``/ws``: one session per connection, frames ``{"op": "create"|"reset"|"step"|"state"|"delete", ...}``.

    A plain ASGI app that :class:`_Guard` calls, not a FastAPI route: Starlette's WebSocket wrapper (state checks on
    every frame) and the route's exception-handling send wrapper took about 3 µs of the server's 31 µs of CPU per
    step of a fast env.
    """

    def __init__(self, server: EnvServer) -> None:
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        handler = _WsSession(self.server)
        limits, deadlines = self.server.limits, self.server.deadlines
        idle = Canceller()
        try:
            while True:
                deadlines.add(idle, limits.session_ttl_s if handler.session_id else limits.idle_timeout_s, idle)
                try:
                    message = await receive()
                finally:
                    deadlines.discard(idle)
                if message["type"] != "websocket.receive":
                    break
                await send({"type": "websocket.send", "text": await handler.handle(message.get("text"))})
        except asyncio.CancelledError:
            if not idle.expired:
                raise
            idle.task.uncancel()
            await send({"type": "websocket.close", "code": 1001, "reason": "idle: no frame within the timeout"})
        except OSError:  # the client went away while we answered
            pass
        finally:
            await handler.close()


class _WsSession:
    """The state of one WebSocket connection: at most one session, deleted when the connection ends."""

    def __init__(self, server: EnvServer) -> None:
        self.server = server
        self.session_id: str | None = None

    async def handle(self, text: str | None) -> str:
        start = time.perf_counter()
        op = "invalid"
        try:
            if text is None:
                raise ApiError("bad_request", "send JSON text frames, not binary ones")
            action = _plain_step_action(text, _WS_STEP)
            if action is not None and self.session_id is not None:
                op = "step"
                return _encode(await self.server.step(self.session_id, action)).decode()
            try:
                req = WsRequest.model_validate_json(text)
            except ValidationError as e:
                if any(p.get("type") == "json_invalid" for p in e.errors()):
                    raise ApiError("bad_request", "the frame is not valid JSON") from e
                problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors()[:5])
                raise ApiError("validation_error", problems) from e
            op = req.op
            return _encode(await self._run(req)).decode()
        except ApiError as e:
            self.server.metrics.errors[e.code] += 1
            return e.encoded().decode()
        except Exception as e:
            log.error("internal error", exc_info=e)
            err = ApiError("internal_error", f"{type(e).__name__}: {e}")
            self.server.metrics.errors[err.code] += 1
            return err.encoded().decode()
        finally:
            self.server.metrics.observe(op, "ws", time.perf_counter() - start)

    async def _run(self, req: WsRequest) -> dict[str, Any]:
        server = self.server
        if req.op == "create":
            if self.session_id is not None and self.session_id in server.sessions:
                raise ApiError("validation_error", "this connection already has a session; delete it first")
            created = await server.create(req.kwargs)
            self.session_id = created["session_id"]
            return created
        if self.session_id is None:
            raise ApiError("session_not_found", "this connection has no session; send {\"op\": \"create\"} first")
        if req.op == "reset":
            return await server.reset(self.session_id, req.seed, req.task)
        if req.op == "step":
            if req.action is None:
                raise ApiError("validation_error", "step needs an 'action' (an assistant message)")
            return await server.step(self.session_id, req.action.model_dump(exclude_unset=True))
        if req.op == "state":
            return server.state(self.session_id)
        session_id, self.session_id = self.session_id, None
        await server.delete(session_id)
        return {"deleted": session_id}

    async def close(self) -> None:
        if self.session_id is not None and self.session_id in self.server.sessions:
            await self.server.delete(self.session_id, "disconnected")


# ---- running it ------------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _app_from_environ() -> FastAPI:
    """The app of one worker process (``--workers N``), built from the config the parent put in the environment."""
    config = ServeConfig.from_json(json.loads(os.environ[_CONFIG_ENV]))
    _guard_connections(config.limits)
    return create_app(config.env, env_kwargs=config.env_kwargs, token=config.token, limits=config.limits,
                      slots=WorkerSlots(os.environ[RUN_DIR_ENV], config.workers))


def _guard_connections(limits: ServerLimits) -> None:
    """Arm this process's HTTP protocol with the read deadline and the connection cap its descriptors allow."""
    GuardedHttp.configure(request_timeout_s=limits.request_timeout_s,
                          max_connections=descriptor_budget(limits.max_connections, limits.max_sessions))


_CREDENTIALS = re.compile(r"(?i)(authorization:?\s*(?:bearer\s+)?|bearer\s+)\S+")


class RedactSecrets(logging.Filter):
    """Blanks bearer credentials (right or wrong) and the given secrets in every record a handler writes:
    uvicorn logs a WebSocket handshake's headers, ``Authorization`` included, at debug level."""

    def __init__(self, secrets: Sequence[str] = ()) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def redact(self, text: str) -> str:
        """``text`` with every credential and secret replaced by ``[redacted]``."""
        text = _CREDENTIALS.sub(r"\1[redacted]", text)
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
        return True


def _log_config(level: str, secrets: Sequence[str]) -> dict[str, Any]:
    """uvicorn's logging setup with every handler behind :class:`RedactSecrets`, and the root logger (envkit, the
    env, websockets) on the same handler and level."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": RedactSecrets, "secrets": list(secrets)}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["root"] = {"handlers": ["default"], "level": level.upper()}
    return config


def serve(config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM, then close every env. Warns when bound beyond loopback without a token."""
    import uvicorn

    if not is_loopback(config.host) and not config.token:
        log.warning("envkit serve is listening on %s without a token: anyone who can reach this port can run the "
                    "env. Set %s or pass --token.", config.host, TOKEN_ENV)
    common: dict[str, Any] = {
        "host": config.host, "port": config.port, "log_level": config.log_level, "access_log": False,
        "ws_max_size": config.limits.max_request_bytes, "timeout_keep_alive": 75, "lifespan": "on",
        "log_config": _log_config(config.log_level, [config.token or ""]), "http": GuardedHttp,
    }
    if config.exec_user is not None and not config.token:
        raise ValueError("--exec-user serves /exec, which runs any command: it needs a token ($ENVKIT_TOKEN)")
    _guard_connections(config.limits)  # workers check again: each has descriptors of its own
    if config.workers == 1:
        workspace = untrusted.Workspace(config.exec_user, config.exec_dir) if config.exec_user is not None else None
        app = create_app(config.env, env_kwargs=config.env_kwargs, token=config.token, limits=config.limits,
                         workspace=workspace)
        uvicorn.run(app, **common)
        return
    if config.exec_user is not None:
        raise ValueError("--exec-user serves one workspace, so it needs --workers 1")
    _ = EnvServer(config.env, env_kwargs=config.env_kwargs, limits=config.limits)  # fail here, not in N workers
    with tempfile.TemporaryDirectory(prefix="envkit-serve-") as run_dir:
        os.environ[_CONFIG_ENV] = json.dumps(config.to_json())
        os.environ[RUN_DIR_ENV] = run_dir
        try:
            uvicorn.run("envkit.remote.server.app:_app_from_environ", factory=True, workers=config.workers, **common)
        finally:
            os.environ.pop(_CONFIG_ENV, None)
            os.environ.pop(RUN_DIR_ENV, None)
