"""What ``envkit serve`` takes: :class:`ServeConfig` (the env, address, token, workers, exec user) and the
:class:`ServerLimits` one server holds to."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")


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
    mcp: bool = False
    """Also serve the env's tools as an MCP server (streamable HTTP at ``/mcp``; the ``mcp`` extra), one fresh env
    instance per tool call (:mod:`envkit.remote.server.mcp`)."""

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
