"""RemoteEnv: an env served by ``envkit serve`` on another process or host, behind the same async Env contract.

::

    env = envkit.make("http://127.0.0.1:8000/arithmetic", level=2)   # REST; kwargs go to the server's env
    env = envkit.make("ws://127.0.0.1:8000/arithmetic")              # one WebSocket per session: less overhead

``init`` opens a session (``make`` defers it to the first reset), ``close`` deletes it. ``tasks(split)`` is the
server's task list for the env made with the same kwargs as the sessions (``GET /tasks``, fetched a page at a time
as it is read), so a trainer draws remote tasks as it draws local ones. Failures raise
:class:`envkit.errors.RemoteEnvError` subclasses carrying the server's ``code`` and HTTP ``status``; codes with an
envkit meaning raise an exception that is both (``episode_done`` is a RemoteEpisodeDoneError, so also an
EpisodeDoneError). Only connection attempts are retried, with exponential backoff: a request that may have reached
the server, a step above all, is never sent twice.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import httpx
import websockets

import envkit.remote.wire as wire
from envkit.core import Env, EnvSpec, Snapshot, StepResult, Task, check_kind
from envkit.errors import (
    RemoteConnectionError,
    RemoteEnvCrashError,
    RemoteEnvError,
    RemoteEpisodeDoneError,
    RemoteInvalidActionError,
    RemoteInvalidTaskError,
    RemoteResetNeededError,
    RemoteSnapshotError,
)
from envkit.messages import Message
from envkit.remote.constants import KEEP_ALIVE_S, TOKEN_ENV
from envkit.remote.httpclient import HttpClosedError, HttpConnection
from envkit.remote.wsclient import WsClosedError, WsConnection
from envkit.tasks import LazyTasks
from envkit.tools import Tool

_ERRORS: dict[str, type[RemoteEnvError]] = {
    "reset_needed": RemoteResetNeededError,
    "episode_done": RemoteEpisodeDoneError,
    "invalid_action": RemoteInvalidActionError,
    "invalid_task": RemoteInvalidTaskError,
    "env_error": RemoteEnvCrashError,
    "env_timeout": RemoteEnvCrashError,
    "invalid_snapshot": RemoteSnapshotError,
    "snapshot_unsupported": RemoteSnapshotError,
}


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """How a RemoteEnv talks to its server."""

    token: str | None = None
    """Bearer token; None reads ``$ENVKIT_TOKEN`` (no auth when that is unset too)."""
    transport: Literal["rest", "ws"] | None = None
    """None picks by the URL scheme: http(s) -> REST, ws(s) -> WebSocket."""
    connect_timeout_s: float = 5.0
    timeout_s: float = 300.0
    """Longest wait for one answer; keep it above the server's step timeout. An expired wait is not retried."""
    connect_retries: int = 3
    """Further connection attempts after a refused or timed-out connect (the request was never sent)."""
    backoff_s: float = 0.2
    """Wait before the first retry; doubles after each."""


def error_from_body(body: Any, status: int | None) -> RemoteEnvError:
    """The exception for a server's error answer (``{"error": {"code", "message"}}``)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict) or not isinstance(detail.get("code"), str):
        return RemoteEnvError(f"unexpected answer from the env server: {str(body)[:200]}", code="http_error",
                              status=status)
    code = detail["code"]
    return _ERRORS.get(code, RemoteEnvError)(str(detail.get("message", "")), code=code,
                                             status=status if status is not None else detail.get("status"))


async def retry_connect(attempt: Any, config: RemoteConfig, where: str) -> Any:
    """Await ``attempt()`` again (with backoff) while it fails to connect; the last failure raises."""
    delay = config.backoff_s
    for tries_left in range(config.connect_retries, -1, -1):
        try:
            return await attempt()
        except (httpx.ConnectError, httpx.ConnectTimeout, OSError, TimeoutError) as e:
            if tries_left == 0:
                raise RemoteConnectionError(f"cannot connect to {where} after {config.connect_retries + 1} "
                                            f"attempts: {type(e).__name__}: {e}", code="connect_error") from e
            await asyncio.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


class _Rest:
    """REST transport: one keep-alive connection, reopened when the server has closed it; a session is an id in
    the URL."""

    # Reopen a connection idle this long rather than race the server's keep-alive close, which would lose a
    # request that may not be sent twice.
    REUSE_IDLE_S = KEEP_ALIVE_S * 2 / 3

    def __init__(self, base: str, config: RemoteConfig, headers: dict[str, str]) -> None:
        self.base, self.config = base, config
        self.headers = {**headers, "content-type": "application/json"}
        self.conn: HttpConnection | None = None
        self.last_used = 0.0
        self.session_path = ""

    async def _connection(self) -> HttpConnection:
        now = asyncio.get_running_loop().time()
        if self.conn is not None and (self.conn.closed or now - self.last_used > self.REUSE_IDLE_S):
            await self.conn.close()
            self.conn = None
        if self.conn is None:
            self.conn = await retry_connect(lambda: HttpConnection.connect(
                self.base, headers=self.headers, timeout_s=self.config.connect_timeout_s), self.config, self.base)
        self.last_used = now
        return self.conn

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        conn = await self._connection()
        try:
            status, content = await conn.request(method, path, None if body is None else wire.dumps(body),
                                                 self.config.timeout_s)
        except TimeoutError as e:
            raise RemoteEnvError(f"no answer from {self.base}{path} within {self.config.timeout_s:g} s (not "
                                 "retried: the server may have acted on it)", code="timeout") from e
        except HttpClosedError as e:
            raise RemoteEnvError(f"{method} {self.base}{path} failed: {e}", code="connection_lost") from e
        if status == 204:
            return None
        try:
            payload = wire.loads(content)
        except ValueError:
            payload = content.decode(errors="replace")
        if status >= 400:
            raise error_from_body(payload, status)
        return payload

    async def open(self, kwargs: dict[str, Any], **seated: str | None) -> dict[str, Any]:
        created = await self._request("POST", "/sessions", {"kwargs": kwargs, **_given(seated)})
        self.session_path = f"/sessions/{quote(created['session_id'], safe='')}"
        return created

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "state":
            return await self._request("GET", self.session_path)
        return await self._request("POST", f"{self.session_path}/{op}", body)

    async def close(self) -> None:
        try:
            if self.session_path:
                await self._request("DELETE", self.session_path)
        except RemoteEnvError as e:
            if e.code not in ("session_not_found", "connect_error", "connection_lost"):
                raise
        finally:
            if self.conn is not None:
                await self.conn.close()
                self.conn = None


async def ws_exchange(ws: WsConnection, frame: dict[str, Any], timeout_s: float) -> Any:
    """Send one JSON frame and return the decoded answer; RemoteEnvError ``timeout`` or ``connection_lost`` if none.

    Either failure leaves the connection closed (see :meth:`WsConnection.request`). Nothing is retried, since the
    server may have acted on the request.
    """
    try:
        raw = await ws.request(wire.dumps(frame), timeout_s)
    except TimeoutError as e:
        raise RemoteEnvError(f"no answer from {ws.url} within {timeout_s:g} s (not retried: the server may have "
                             "acted on it; the WebSocket session is closed)", code="timeout") from e
    except WsClosedError as e:
        raise RemoteEnvError(f"{e}; its session is gone", code="connection_lost") from e
    return wire.loads(raw)


class WsSession:
    """A session that is one WebSocket connection (``envkit serve``'s ``/ws``, OpenEnv's): once a request times out
    or the connection drops, the session is gone with it."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.ws: WsConnection | None = None

    async def exchange(self, frame: dict[str, Any], timeout_s: float) -> Any:
        """``frame``'s decoded answer (see :func:`ws_exchange`)."""
        if self.ws is None:
            raise RemoteEnvError(f"the {self.what} session is closed", code="connection_lost")
        try:
            return await ws_exchange(self.ws, frame, timeout_s)
        except RemoteEnvError:
            self.ws = None  # timed out (closed) or gone: so is the session
            raise


class _WebSocket:
    """WebSocket transport: one connection per session, one frame per request, answers in order."""

    def __init__(self, base: str, config: RemoteConfig, headers: dict[str, str]) -> None:
        self.url, self.config, self.headers = f"{base}/ws", config, headers
        self.session = WsSession("WebSocket")

    async def _connect(self) -> WsConnection:
        # No compression (frames are small JSON; deflate costs more CPU than it saves on a LAN) and no keepalive
        # pings of our own (a busy server must not lose sessions to missed pongs; requests time out instead).
        try:
            return await WsConnection.connect(self.url, headers=self.headers, timeout_s=self.config.connect_timeout_s)
        except websockets.InvalidStatus as e:
            try:
                body: Any = json.loads(e.response.body or b"")
            except json.JSONDecodeError:
                body = (e.response.body or b"").decode(errors="replace")
            raise error_from_body(body, e.response.status_code) from e

    async def _exchange(self, frame: dict[str, Any]) -> dict[str, Any]:
        answer = await self.session.exchange(frame, self.config.timeout_s)
        if "error" in answer:
            raise error_from_body(answer, None)
        return answer

    async def open(self, kwargs: dict[str, Any], **seated: str | None) -> dict[str, Any]:
        self.session.ws = await retry_connect(self._connect, self.config, self.url)
        return await self._exchange({"op": "create", "kwargs": kwargs, **_given(seated)})

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._exchange({"op": op, **body})

    async def close(self) -> None:
        if self.session.ws is None:
            return
        try:
            await self._exchange({"op": "delete"})
        except RemoteEnvError as e:
            if e.code not in ("session_not_found", "connection_lost"):
                raise
        finally:
            ws, self.session.ws = self.session.ws, None
            if ws is not None:
                await ws.close()


class RemoteTaskList(LazyTasks):
    """A server's task list for one split of the env made with ``kwargs``, fetched in pages of ``page_size`` on
    first access (blocking HTTP: read it from a thread in async code)."""

    def __init__(self, base_url: str, split: str, *, headers: dict[str, str], config: RemoteConfig,
                 kwargs: dict[str, Any] | None = None, page_size: int = 256) -> None:
        self.url, self.split, self.page_size = f"{base_url}/tasks", split, page_size
        self._kwargs_json = wire.dumps(kwargs or {}).decode()
        self.kwargs = wire.loads(self._kwargs_json)  # as the server will read them back
        self._headers = headers
        self._timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self._retries = config.connect_retries
        self._pages: dict[int, list[Task]] = {}
        self._name = f"{self.url} split {split!r}"
        self._len = self._page(0)

    def _page(self, index: int) -> int:
        params: dict[str, Any] = {"split": self.split, "offset": index * self.page_size, "limit": self.page_size}
        if self.kwargs:
            params["kwargs"] = self._kwargs_json
        try:
            # httpx retries a refused or timed-out connect (with backoff), as a session's connect is retried
            with httpx.Client(transport=httpx.HTTPTransport(retries=self._retries), headers=self._headers,
                              timeout=self._timeout) as client:
                response = client.get(self.url, params=params)
        except httpx.HTTPError as e:
            raise RemoteConnectionError(f"GET {self.url} failed: {type(e).__name__}: {e}", code="connect_error") from e
        try:
            body = response.json()
        except json.JSONDecodeError:
            body = response.text
        if response.status_code != 200:
            raise error_from_body(body, response.status_code)
        # A page must be what was asked for: a short or malformed one would surface later as a wrong task.
        offset = index * self.page_size
        total = body.get("total") if isinstance(body, dict) else None
        tasks = body.get("tasks") if isinstance(body, dict) else None
        if (type(total) is not int or total < 0 or not isinstance(tasks, list)
                or len(tasks) != max(0, min(self.page_size, total - offset))
                or not all(isinstance(t, dict) for t in tasks)):
            raise RemoteEnvError(f"GET {self.url} (offset {offset}) answered no valid task page: {str(body)[:200]}",
                                 code="bad_answer", status=response.status_code)
        if body.get("kwargs", {}) != self.kwargs:
            raise RemoteEnvError(f"{self.url} lists the tasks of its env as served, not with the kwargs "
                                 f"{self.kwargs}, which sessions are made with (an envkit server older than this "
                                 "client): upgrade it, or serve the env with these kwargs and make() it without them",
                                 code="kwargs_ignored", status=response.status_code)
        self._pages[index] = tasks
        return total

    def _task(self, i: int) -> Task:
        page, k = divmod(i, self.page_size)
        if page not in self._pages:
            self._page(page)
        return self._pages[page][k]


class RemoteEnv(Env):
    """An env on an ``envkit serve`` server: ``url`` is ``http(s)://host:port/NAME`` or ``ws(s)://host:port/NAME``."""

    def __init__(self, url: str, *, remote: RemoteConfig | None = None, env_kwargs: dict[str, Any] | None = None,
                 seat: str | None = None, table: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
            raise ValueError(f"RemoteEnv needs a URL like http://host:port/NAME or ws://host:port/NAME, got {url!r}")
        self.url = url
        self.name = parts.path.strip("/")
        self.config = remote or RemoteConfig()
        self.env_kwargs = dict(env_kwargs or {})
        self.seat = seat
        """The seat of a served multi-agent env this session plays (envkit/table.py); None for a single-agent env."""
        self.table = table
        """The id of the multi-agent episode the seat joins, or (known after init) the one its session made."""
        transport = self.config.transport or ("ws" if parts.scheme in ("ws", "wss") else "rest")
        secure = parts.scheme in ("https", "wss")
        scheme = {"rest": "https" if secure else "http", "ws": "wss" if secure else "ws"}[transport]
        self.base_url = f"{scheme}://{parts.netloc}"
        token = self.config.token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._transport_cls = _WebSocket if transport == "ws" else _Rest
        self._headers = headers
        self._transport: _Rest | _WebSocket | None = None
        self.session_id: str | None = None
        self.tools = []  # type: ignore[misc]  # the server's, once the session exists
        self.spec = EnvSpec(name=url, entry_point="envkit.remote.client:RemoteEnv", kwargs=self.env_kwargs,
                            description=f"{self.name or 'env'} served at {self.base_url}", source="remote")

    async def init(self) -> None:
        """Open the session on the server (idempotent)."""
        if self._transport is not None:
            return
        transport = self._transport_cls(self.base_url, self.config, self._headers)
        try:
            created = await transport.open(self.env_kwargs, seat=self.seat, table=self.table)
            if self.name and created["env"] != self.name:
                raise RemoteEnvError(f"{self.base_url} serves {created['env']!r}, not {self.name!r}",
                                     code="env_mismatch")
        except BaseException:
            await transport.close()
            raise
        self._transport, self.session_id = transport, created["session_id"]
        self.table = created.get("table")
        self.tools = [Tool.from_openai(t) for t in created["tools"]]  # type: ignore[misc]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start an episode on the server."""
        await self.init()
        assert self._transport is not None
        body = await self._transport.call("reset", {"seed": seed, "task": task})
        return body["observation"], body["info"]

    async def step(self, action: Message) -> StepResult:
        """Send one assistant message; never retried."""
        if self._transport is None:
            raise RemoteResetNeededError("step() before reset(): the remote session is not open", code="reset_needed")
        body = await self._transport.call("step", {"action": action})
        return StepResult(body["observation"], body["reward"], terminated=body["terminated"],
                          truncated=body["truncated"], info=body["info"])

    def tasks(self, split: str = "train") -> Sequence[Task] | None:
        """The server env's task list for ``split`` with this env's kwargs, or None when it does not list tasks.

        Blocking HTTP, paged lazily: in async code call it through ``asyncio.to_thread``."""
        http = self.base_url.replace("ws", "http", 1) if self.base_url.startswith("ws") else self.base_url
        try:
            return RemoteTaskList(http, split, headers=self._headers, config=self.config, kwargs=self.env_kwargs)
        except RemoteEnvError as e:
            if e.code == "no_tasks":
                return None
            if e.code == "invalid_split":
                raise ValueError(str(e)) from e
            raise

    @property
    def snapshot_kind(self) -> str:
        """The served env's: its snapshots restore into a session of that env on any server with the same key,
        over either transport."""
        return f"envkit-serve:{self.name}"

    async def snapshot(self) -> Snapshot:
        """The session's env state as the server's signed token: it restores into any session of this env on a
        server with the same key (``$ENVKIT_SNAPSHOT_KEY``), this one included."""
        await self.init()
        assert self._transport is not None
        body = await self._transport.call("snapshot", {})
        return Snapshot(self.snapshot_kind, body["snapshot"])

    async def restore(self, snapshot: Snapshot) -> None:
        """Put the session's env in ``snapshot``'s state (the server checks the token's signature)."""
        check_kind(self, snapshot)
        await self.init()
        assert self._transport is not None
        await self._transport.call("restore", {"snapshot": snapshot.state})

    async def state(self) -> dict[str, Any]:
        """The server's view of this session (episode active, counts, idle time)."""
        await self.init()
        assert self._transport is not None
        return await self._transport.call("state", {})

    async def close(self) -> None:
        """Delete the session (idempotent)."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.close()

    def __repr__(self) -> str:
        return f"<RemoteEnv {self.url!r} session={self.session_id}>"


def _given(fields: dict[str, str | None]) -> dict[str, str]:
    """The fields that are set (a server older than seats refuses ones it does not know)."""
    return {k: v for k, v in fields.items() if v is not None}


def make_remote(name: str, **kwargs: Any) -> RemoteEnv:
    """The ``http``, ``https``, ``ws`` and ``wss`` schemes of ``envkit.make``: ``remote=RemoteConfig(...)`` configures
    the client, the other kwargs go to the server's env."""
    return RemoteEnv(name, remote=kwargs.pop("remote", None), env_kwargs=kwargs)
