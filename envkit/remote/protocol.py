"""The wire format of ``envkit serve``: request and response bodies shared by the server and RemoteEnv.

Sessions are explicit. Over REST::

    POST   /sessions                  {"kwargs": {...}}           -> 201 SessionCreated
    POST   /sessions/{id}/reset       {"seed": 0, "task": null}   -> ResetResult
    POST   /sessions/{id}/step        {"action": {assistant msg}} -> StepResultBody
    GET    /sessions/{id}                                         -> SessionState
    DELETE /sessions/{id}                                         -> 204
    POST   /sessions/{id}/snapshot                                -> SnapshotToken (the env's state, signed)
    POST   /sessions/{id}/restore     {"snapshot": token}         -> SessionState (the session now in that state)
    GET    /tasks?split=train&offset=0&limit=256                  -> TaskPage (the served env's task list)
    POST   /exec                      {"argv": [...], ...}        -> ExecResult (sandbox servers only)
    POST   /exec/scrub                                            -> ScrubResult (sandbox servers only)
    GET    /exec/files                                            -> the exec dir as a tar (sandbox servers only)
    PUT    /exec/files                tar                         -> 204, the exec dir now holds it (sandbox servers)

Over one WebSocket per session (``/ws``), each text frame is one request ``{"op": ..., ...}`` with the same fields
as the REST body, answered in order by one frame holding the REST response body: ``create`` (``kwargs``), ``reset``
(``seed``, ``task``), ``step`` (``action``), ``state``, ``snapshot``, ``restore`` (``snapshot``), ``delete``.
Closing the socket deletes its session.

A multi-agent env (``/info`` lists its ``seats``) is played with a session per seat: ``create`` with ``seat`` makes a
new episode's table and answers its ``table`` id; the other seats ``create`` with ``seat`` and that ``table``. Each
session then resets and steps as any other, and sees its own seat's view only: its reset answers once it is its
seat's turn, and each step once it is its turn again or the episode is over (envkit/table.py).

Every error, REST or WebSocket, is ``{"error": {"code": ..., "message": ..., "status": ...}}``; :data:`ERROR_STATUS`
gives the HTTP status of each code (a WebSocket error frame carries it too).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change to these bodies or routes; ``/info`` reports it."""

ERROR_STATUS: dict[str, int] = {
    "bad_request": 400,  # the body is not JSON (or not UTF-8)
    "unauthorized": 401,  # missing or wrong bearer token
    "not_found": 404,  # no such route
    "session_not_found": 404,  # unknown, deleted or expired session id
    "table_not_found": 404,  # a multi-agent episode's table that is unknown, over, or in another worker process
    "seat_taken": 409,  # a seat of a table another session plays
    "method_not_allowed": 405,
    "reset_needed": 409,  # step before reset, or after a step that failed
    "episode_done": 409,  # step after terminated/truncated
    "rest_unavailable": 409,  # REST sessions on a multi-worker server (use the WebSocket transport)
    "request_timeout": 408,  # the request's headers and body did not arrive within ServerLimits.request_timeout_s
    "payload_too_large": 413,
    "validation_error": 422,  # the body does not fit the schema
    "invalid_action": 422,  # not a well-formed assistant message
    "invalid_task": 422,  # the env refused the task passed to reset
    "invalid_kwargs": 422,  # the env could not be constructed with the session's kwargs
    "invalid_split": 422,  # /tasks for a split the env does not have
    "invalid_snapshot": 422,  # a snapshot token this server did not seal (altered, another key, another env)
    "no_tasks": 404,  # /tasks of an env that does not list its tasks (draw episodes by seed)
    "internal_error": 500,  # a bug in the server itself
    "snapshot_unsupported": 501,  # the env's state cannot be snapshotted (Env.snapshot raised SnapshotError)
    "env_error": 500,  # the env raised or broke the contract: reported, contained, the session lives on
    "capacity": 503,  # max concurrent sessions (or open connections) reached
    "env_timeout": 504,  # the env did not answer within the step timeout
}


class ApiError(Exception):
    """An error answer: ``code`` is one of :data:`ERROR_STATUS`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = ERROR_STATUS[code]

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}

    def encoded(self) -> bytes:
        """The JSON error body, encoded."""
        return json.dumps(self.body()).encode()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Body):
    """A request body: strict, so a seed sent as ``"1"`` or ``true`` is refused rather than read as a number."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorDetail(_Body):
    """What went wrong: a stable machine-readable ``code``, a human-readable ``message``, the HTTP ``status``."""

    code: str
    message: str
    status: int


class ErrorBody(_Body):
    """The body of every error answer."""

    error: ErrorDetail


class FunctionCallBody(BaseModel):
    """The function part of a tool call (``arguments`` is a JSON-encoded string, as in the OpenAI API)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str = "{}"


class ToolCallBody(BaseModel):
    """One tool call of an assistant message."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ActionBody(BaseModel):
    """An assistant message: the action of ``step``. Extra keys (e.g. ``reasoning_content``) are passed through."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCallBody] | None = None


class CreateSession(_Request):
    """``POST /sessions``: make a new env, with ``kwargs`` over the served defaults. A multi-agent env's session
    plays one ``seat``: without ``table`` it makes a new episode's table, with it joins that table (no kwargs)."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    seat: str | None = None
    table: str | None = None


class SessionCreated(_Body):
    """A new session: its id, the env it runs, and the tools the model may call (OpenAI function schemas); a
    multi-agent env's also its seat and its table's id (what the other seats join with)."""

    session_id: str
    env: str
    tools: list[dict[str, Any]]
    seat: str | None = None
    table: str | None = None


class ResetRequest(_Request):
    """``POST /sessions/{id}/reset``: the same seed or task gives the same episode start."""

    seed: int | None = None
    task: dict[str, Any] | None = None


class ResetResult(_Body):
    """The opening messages of an episode and the env's info dict."""

    observation: list[dict[str, Any]]
    info: dict[str, Any]


class StepRequest(_Request):
    """``POST /sessions/{id}/step``."""

    action: ActionBody


class StepResultBody(_Body):
    """``envkit.StepResult`` on the wire."""

    observation: list[dict[str, Any]]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class SnapshotToken(_Request):
    """A session's env state (``POST /sessions/{id}/snapshot``), sealed by the server: ``restore`` takes it back
    into any session of a server with the same key. Opaque."""

    snapshot: str = Field(min_length=1)


class TaskPage(_Body):
    """``GET /tasks``: tasks ``offset .. offset + len(tasks)`` of the ``total`` in ``split``, as the env lists them
    when made with ``kwargs`` over the served ones (the echo tells a client the server applied them)."""

    split: str
    total: int
    offset: int
    tasks: list[dict[str, Any]]
    kwargs: dict[str, Any] = Field(default_factory=dict)


class SessionState(_Body):
    """Where a session stands."""

    session_id: str
    env: str
    episode_active: bool
    episodes: int
    steps: int
    idle_s: float
    age_s: float


class ExecRequest(_Request):
    """``POST /exec``: run ``argv`` as the server's exec user in its exec dir; killed whole at ``timeout_s``."""

    argv: list[str] = Field(min_length=1)
    stdin_b64: str = ""
    """Standard input, base64-encoded."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    output_limit: int = Field(64 * 1024, ge=0, le=64 << 20)
    """Largest stdout and stderr kept; the rest is read and dropped."""


class ExecResult(_Body):
    """What one ``/exec`` produced (output decoded as UTF-8, undecodable bytes replaced); also what every
    ``Sandbox.exec`` returns, whatever runs the command."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stdout: str
    stderr: str
    exit_code: int
    """The command's exit status; -1 when it was killed at its deadline."""
    timed_out: bool
    truncated: bool
    """True when stdout or stderr went past the output limit and was cut."""
    duration_s: float


class ScrubResult(_Body):
    """``POST /exec/scrub``: what survived killing the exec user's processes and emptying the exec dir and /tmp."""

    processes: list[int]
    """Processes other than the server and the container's init."""
    files: list[str]
    """Paths the exec user still owns under the exec dir or /tmp (at most 20)."""


class Health(_Body):
    """``GET /health``; needs no token."""

    status: Literal["ok"] = "ok"


class WorkerInfo(_Body):
    """Which worker process answered a ``GET /info``."""

    pid: int
    workers: int
    """Worker processes of this server (``envkit serve --workers N``)."""
    sessions: int
    """Sessions open in this worker."""


class ServerInfo(_Body):
    """``GET /info``: what this server runs and how full it is."""

    env: str
    description: str
    env_version: str | None
    envkit_version: str
    protocol_version: int
    tools: list[dict[str, Any]]
    tasks: dict[str, int | None]
    spaces: dict[str, Any]
    sessions: int
    """Open sessions of the whole server (all worker processes)."""
    worker: WorkerInfo
    max_sessions: int
    session_ttl_s: float
    step_timeout_s: float
    max_request_bytes: int
    rest_sessions: bool


class WsRequest(BaseModel):
    """One WebSocket request frame; ``op`` picks which of the other fields are read."""

    model_config = ConfigDict(extra="forbid", strict=True)

    op: Literal["create", "reset", "step", "state", "snapshot", "restore", "delete"]
    kwargs: dict[str, Any] = Field(default_factory=dict)
    seat: str | None = None
    table: str | None = None
    seed: int | None = None
    task: dict[str, Any] | None = None
    action: ActionBody | None = None
    snapshot: str | None = None
