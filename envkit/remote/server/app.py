"""The FastAPI app of ``envkit serve``: :func:`create_app` puts the error handlers and the REST routes (server,
sessions, ``/exec`` in sandboxes, ``/mcp`` with ``--mcp``) on an :class:`~envkit.remote.server.sessions.EnvServer`,
behind the :class:`~envkit.remote.server.guard.Guard` middleware."""

from __future__ import annotations

import base64
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import envkit
import envkit.agents.untrusted as untrusted
from envkit.errors import SnapshotError
from envkit.remote import wire
from envkit.remote.protocol import (
    ERROR_STATUS,
    PROTOCOL_VERSION,
    ApiError,
    CreateSession,
    ErrorBody,
    ExecRequest,
    ExecResult,
    Health,
    ResetRequest,
    ResetResult,
    ScrubResult,
    ServerInfo,
    SessionCreated,
    SessionState,
    SnapshotToken,
    StepRequest,
    StepResultBody,
    TaskPage,
)
from envkit.remote.server.config import ServerLimits
from envkit.remote.server.guard import Guard
from envkit.remote.server.openenv import PREFIX as OPENENV_PREFIX
from envkit.remote.server.openenv import SCHEMA as OPENENV_SCHEMA
from envkit.remote.server.sessions import EnvServer, encode, internal_error
from envkit.remote.server.workers import LocalSlots

MAX_TASK_PAGE = 1024


def create_app(env: str, *, env_kwargs: dict[str, Any] | None = None, token: str | None = None,
               limits: ServerLimits | None = None, slots: LocalSlots | None = None,
               workspace: untrusted.Workspace | None = None, mcp: bool = False, loopback: bool = True) -> FastAPI:
    """The FastAPI app serving ``env`` (a registered name or ``module:Class``); see the package docstring.
    With ``workspace``, also ``/exec``, ``/exec/scrub`` and ``/exec/files`` (commands next to the env, in a
    sandbox, and their files for a snapshot); with ``mcp``, also ``/mcp``, the env's tools as an MCP server
    (:mod:`.mcp`; ``loopback``: the server binds only loopback)."""
    server = EnvServer(env, env_kwargs=env_kwargs, limits=limits, slots=slots)
    mcp_sessions: AbstractAsyncContextManager[Any] = nullcontext()
    if mcp:
        from envkit.remote.server.mcp import MCP_PATH, mcp_endpoint  # the mcp extra: imported only when asked for

        endpoint, manager = mcp_endpoint(server, loopback=loopback)
        mcp_sessions = manager.run()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with server.running(), mcp_sessions:
            yield

    # The package docstring says what the server guarantees; its first paragraph heads the OpenAPI page.
    summary = sys.modules[__package__].__doc__.split("\n\n")[0]
    app = FastAPI(title=f"envkit serve {env}", version=envkit.__version__, lifespan=lifespan,
                  description=summary + f" Protocol version {PROTOCOL_VERSION}.")
    app.state.env_server = server
    _add_error_handlers(app, server)
    _add_server_routes(app, server)
    _add_session_routes(app, server)
    if workspace is not None:
        _add_exec_routes(app, server, workspace)
    if mcp:
        app.add_route(MCP_PATH, endpoint, include_in_schema=False)
    app.add_middleware(Guard, server=server, token=token, files=workspace is not None)
    return app


def _answer(body: Any, status: int = 200) -> Response:
    return Response(encode(body), status_code=status, media_type="application/json")


def _json(status: int, payload: bytes) -> Response:
    if status == 204:
        return Response(status_code=204)
    # 503 is `capacity`: sessions or connections free up, so a client may come back
    return Response(payload, status_code=status, media_type="application/json",
                    headers={"retry-after": "1"} if status == 503 else None)


def _error(server: EnvServer, err: ApiError) -> Response:
    server.metrics.errors[err.code] += 1
    return _json(err.status, err.encoded())


async def _timed(server: EnvServer, op: str, work: Awaitable[Any], status: int = 200) -> Response:
    return _json(*await server.answer(op, "rest", work, status))


def _responses(*codes: str) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for code in ("unauthorized", "payload_too_large", "bad_request", "validation_error", *codes):
        status = ERROR_STATUS[code]
        entry = out.setdefault(status, {"model": ErrorBody, "description": ""})
        entry["description"] = ", ".join(filter(None, (entry["description"], code)))
    return out


_ENV_FAULTS = ("env_error", "env_timeout")


def _add_error_handlers(app: FastAPI, server: EnvServer) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> Response:
        return _error(server, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return _error(server, ApiError("bad_request", "the body is not valid JSON"))
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type:
            got = content_type or "no content type"
            return _error(server, ApiError("bad_request", "send the body as JSON with 'Content-Type: "
                                                          f"application/json' (got {got!r})"))
        text = "; ".join(f"{'.'.join(str(x) for x in p.get('loc', ()))}: {p.get('msg')}" for p in problems[:5])
        return _error(server, ApiError("validation_error", text or "the body does not fit the schema"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}.get(exc.status_code)
        if code is None:
            code = "bad_request" if exc.status_code < 500 else "internal_error"
        err = ApiError(code, str(exc.detail))
        err.status = exc.status_code
        return _error(server, err)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        return _error(server, internal_error(exc))


def _add_server_routes(app: FastAPI, server: EnvServer) -> None:
    @app.get("/health", response_model=Health, tags=["server"])
    async def health() -> dict[str, str]:
        """Liveness; needs no token."""
        return {"status": "ok"}

    @app.get(OPENENV_PREFIX + "/health", tags=["openenv"])
    async def openenv_health() -> dict[str, str]:
        """OpenEnv's liveness answer, for its clients and providers (the WebSocket is ``/openenv/ws``)."""
        return {"status": "healthy"}

    @app.get(OPENENV_PREFIX + "/schema", tags=["openenv"])
    async def openenv_schema() -> dict[str, Any]:
        """The action, observation and state of ``/openenv/ws`` as JSON schemas, as OpenEnv's ``/schema``."""
        return OPENENV_SCHEMA

    @app.get("/info", response_model=ServerInfo, responses=_responses(), tags=["server"])
    async def info() -> Response:
        """The served env (name, version, tools, task counts, spaces), protocol version, limits, open sessions."""
        return _answer(await server.server_info())

    @app.get("/metrics", response_class=PlainTextResponse, responses=_responses(), tags=["server"])
    async def metrics() -> PlainTextResponse:
        """Prometheus text format: sessions, requests, errors by code, latency histograms."""
        return PlainTextResponse(await server.metrics_text())

    @app.get("/tasks", response_model=TaskPage, responses=_responses("invalid_split", "no_tasks", "invalid_kwargs"),
             tags=["server"])
    async def tasks(split: str = "train", offset: int = Query(0, ge=0),
                    limit: int = Query(256, ge=1, le=MAX_TASK_PAGE),
                    kwargs: str = Query("{}", description="JSON object: the kwargs a session would be created "
                                                          "with (over the served ones)")) -> Response:
        """A page of the tasks for ``split`` of the served env made with ``kwargs``; 404 ``no_tasks`` when the env
        does not list them."""
        try:
            return _answer(await server.tasks(split, offset, limit, _json_object(kwargs)))
        except ApiError as e:
            return _error(server, e)


def _add_session_routes(app: FastAPI, server: EnvServer) -> None:
    @app.post("/sessions", status_code=201, response_model=SessionCreated,
              responses=_responses("invalid_kwargs", "capacity", "rest_unavailable", "table_not_found", "seat_taken",
                                   *_ENV_FAULTS), tags=["sessions"])
    async def create_session(body: CreateSession | None = None) -> Response:
        """Create a session with its own env instance (``kwargs`` override the served defaults)."""
        if not server.rest_sessions:
            return _error(server, ApiError("rest_unavailable", "this server runs several worker processes, so a "
                                                               "REST session could be routed to another one: use the "
                                                               "WebSocket transport (ws://...) or run envkit serve "
                                                               "with --workers 1"))
        body = body or CreateSession()
        return await _timed(server, "create", server.create(body.kwargs, seat=body.seat, table=body.table), 201)

    @app.post("/sessions/{session_id}/reset", response_model=ResetResult,
              responses=_responses("session_not_found", "invalid_task", *_ENV_FAULTS), tags=["sessions"])
    async def reset_session(session_id: str, body: ResetRequest | None = None) -> Response:
        """Start an episode: the same seed or task gives the same start."""
        body = body or ResetRequest()
        return await _timed(server, "reset", server.reset(session_id, body.seed, body.task))

    @app.post("/sessions/{session_id}/step", response_model=StepResultBody,
              responses=_responses("session_not_found", "reset_needed", "episode_done", "invalid_action",
                                   *_ENV_FAULTS), tags=["sessions"])
    async def step_session(session_id: str, body: StepRequest) -> Response:
        """Apply one assistant message."""
        return await _timed(server, "step", server.step(session_id, body.action.model_dump(exclude_unset=True)))

    @app.get("/sessions/{session_id}", response_model=SessionState, responses=_responses("session_not_found"),
             tags=["sessions"])
    async def session_state(session_id: str) -> Response:
        """Where the session stands: episode active, counts, idle time."""
        try:
            return _answer(server.state(session_id))
        except ApiError as e:
            return _error(server, e)

    @app.post("/sessions/{session_id}/snapshot", response_model=SnapshotToken,
              responses=_responses("session_not_found", "snapshot_unsupported", *_ENV_FAULTS), tags=["sessions"])
    async def snapshot_session(session_id: str) -> Response:
        """The session's env state, mid-episode included, as a token signed by this server."""
        return await _timed(server, "snapshot", server.snapshot(session_id))

    @app.post("/sessions/{session_id}/restore", response_model=SessionState,
              responses=_responses("session_not_found", "invalid_snapshot", "snapshot_unsupported", *_ENV_FAULTS),
              tags=["sessions"])
    async def restore_session(session_id: str, body: SnapshotToken) -> Response:
        """Put the session's env in a snapshot's state: its next steps go as the snapshotted session's did."""
        return await _timed(server, "restore", server.restore(session_id, body.snapshot))

    @app.delete("/sessions/{session_id}", status_code=204, responses=_responses("session_not_found"),
                tags=["sessions"])
    async def delete_session(session_id: str) -> Response:
        """Close the session's env and forget the session."""
        return await _timed(server, "delete", server.delete(session_id))


def _add_exec_routes(app: FastAPI, server: EnvServer, workspace: untrusted.Workspace) -> None:
    @app.post("/exec", response_model=ExecResult, responses=_responses(), tags=["sandbox"])
    async def exec_command(body: ExecRequest) -> Response:
        """Run a command as the exec user in the exec dir, one at a time; nothing it starts outlives it."""
        try:
            stdin = base64.b64decode(body.stdin_b64, validate=True)
        except ValueError:
            return _error(server, ApiError("validation_error", "stdin_b64 is not base64"))
        # A missing program is the command's own failure (exit 127 from env), as in a shell.
        result = await workspace.run(body.argv, stdin=stdin, timeout_s=body.timeout_s,
                                     output_limit=body.output_limit)
        return _answer(result.decoded())

    @app.post("/exec/scrub", response_model=ScrubResult, responses=_responses(), tags=["sandbox"])
    async def exec_scrub() -> Response:
        """Kill the exec user's processes and delete its files; answers what is left (empty lists: clean)."""
        processes, files = await workspace.scrub()
        return _answer({"processes": processes, "files": files})

    @app.get("/exec/files", responses={200: {"content": {"application/x-tar": {}}}, **_responses("env_error")},
             tags=["sandbox"])
    async def exec_files() -> Response:
        """The exec dir's files as an uncompressed tar, read as the exec user (a sandbox's part of a snapshot)."""
        try:
            archive = await workspace.pack()
        except SnapshotError as e:
            return _error(server, ApiError("env_error", str(e)))
        return Response(archive, media_type="application/x-tar")

    @app.put("/exec/files", status_code=204, responses=_responses("invalid_snapshot"), tags=["sandbox"])
    async def exec_replace_files(request: Request) -> Response:
        """Kill the exec user's processes and replace the exec dir's files with the tar in the body (written as
        the exec user; members that would land outside the dir, devices and hard links are refused)."""
        try:
            await workspace.unpack(await request.body())
        except SnapshotError as e:
            return _error(server, ApiError("invalid_snapshot", str(e)))
        return Response(status_code=204)


def _json_object(text: str) -> dict[str, Any]:
    """A query parameter that carries a JSON object."""
    try:
        value = wire.loads(text)
    except ValueError as e:
        raise ApiError("invalid_kwargs", f"kwargs is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise ApiError("invalid_kwargs", f"kwargs must be a JSON object, got {type(value).__name__}")
    return value
