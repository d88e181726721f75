"""The Sandbox interface shared by the Docker and local-process runtimes, its limits, results and errors.

A sandbox runs one ``envkit serve`` server (for an env image or an installed env) and can run commands next to it.
Its lifecycle is explicit: ``created -> running -> closed``; ``start`` twice, ``exec`` before ``start`` or anything
after ``close`` raises :class:`SandboxStateError`. ``close`` is idempotent and removes everything ``start`` made,
also after a failed or cancelled start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import secrets
import socket
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from envkit.agents.untrusted import process_start_ticks
from envkit.errors import EnvkitError
from envkit.remote import SNAPSHOT_KEY_ENV
from envkit.remote.protocol import ExecResult

SANDBOX_ENV = "ENVKIT_SANDBOX"
"""Set inside every sandbox to its kind (``docker`` or ``local``); envs that run model code check it."""
SERVER_PORT = 8000
"""Port ``envkit serve`` listens on inside an env image (OpenEnv's providers expect the same)."""
EXEC_UID = 1000
"""The uid ``exec`` runs as in a container: not the server's (root, holding only CAP_SETUID, CAP_SETGID and CAP_KILL
to run and kill it), so it cannot read the env packages, signal the server or read its /proc."""
EXEC_DIR = "/work"
"""Where ``exec`` runs in a container; its files stay there until the sandbox is scrubbed."""


@functools.cache
def snapshot_key() -> str:
    """The snapshot key of every sandbox server this process starts (``$ENVKIT_SNAPSHOT_KEY``, else one made now): a
    snapshot of an env in one sandbox restores into another."""
    return os.environ.get(SNAPSHOT_KEY_ENV) or secrets.token_hex(32)


class SandboxError(EnvkitError):
    """A sandbox could not be started, used or cleaned up (infrastructure fault)."""


class SandboxStartError(SandboxError):
    """The sandbox's server did not come up: the container or process failed, or missed the health deadline."""


class SandboxLost(SandboxError):
    """The sandbox serving an env died under it (its container OOM-killed or exited, its process gone): the
    episode it served fails, saying so; a pool replaces it."""


class SandboxStateError(SandboxError):
    """A sandbox method was called in the wrong lifecycle state (e.g. ``exec`` before ``start``)."""


class SandboxUnavailableError(SandboxError):
    """The requested runtime is not usable here (no Docker engine, no docker SDK)."""


class State(Enum):
    """Where a sandbox is in its lifecycle."""

    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandbox (the local runtime applies only ``output_limit_bytes``)."""

    cpus: float = 1.0
    memory_mb: int = 512
    """Memory and swap together: a process past it is OOM-killed inside the sandbox."""
    pids: int = 128
    """Processes and threads together: a fork bomb stops here."""
    network: bool = False
    """False: an internal bridge whose traffic this host never forwards, names resolve nowhere; only the host reaches
    the server. True: the default bridge, the server port published on 127.0.0.1."""
    tmpfs_mb: int = 64
    """Size of the writable ``/work`` and ``/tmp`` (the root filesystem is read-only)."""
    tmpfs_inodes: int = 16384
    """Files and directories each of ``/work`` and ``/tmp`` may hold (without a bound, millions of empty files fit)."""
    output_limit_bytes: int = 64 * 1024
    """Largest stdout and stderr kept per ``exec``; the rest is read and dropped."""

    def __post_init__(self) -> None:
        if (self.cpus <= 0 or self.memory_mb < 16 or self.pids < 8 or self.tmpfs_mb < 1 or self.tmpfs_inodes < 16
                or self.output_limit_bytes < 0):
            raise ValueError(f"SandboxLimits out of range: {self}")


def exec_argv(code_or_cmd: str | Sequence[str]) -> list[str]:
    """A string is Python source run with ``python3 -c``; a sequence is an argv run as is."""
    if isinstance(code_or_cmd, str):
        return ["python3", "-I", "-c", code_or_cmd]
    argv = list(code_or_cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"exec needs Python source (str) or a non-empty argv (list of str), got {code_or_cmd!r}")
    return argv


def serve_command(env: str, options: Sequence[str] = ()) -> list[str]:
    """A sandbox image's command: ``envkit serve`` for ``env`` on the container's every interface, with ``options``
    (``serve_options``)."""
    return ["envkit", "serve", env, "--host", "0.0.0.0", "--port", str(SERVER_PORT), *options]


def serve_options(env: str, server_kwargs: dict[str, Any] | None) -> list[str]:
    """``envkit serve``'s ``--kwargs`` option for the kwargs the sandbox's server is started with (none: no option)."""
    if not server_kwargs:
        return []
    try:
        return ["--kwargs", json.dumps(server_kwargs)]
    except (TypeError, ValueError) as e:
        raise TypeError(f"{', '.join(sorted(server_kwargs))} of sandboxed env {env!r} go to the server the sandbox "
                        f"starts, so must be JSON (an opponent as 'module:attr', 'policy' or an endpoint dict): {e}"
                        ) from e


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Hold the host-wide lock ``name``: processes that would build or create the same engine object take turns."""
    with open(Path(tempfile.gettempdir()) / f"envkit-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def owner_id() -> str:
    """This process's owner id ``host:pid:start``, carried by every container it starts (see the reaper)."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_ticks(os.getpid())}"


# ``exec(..., timeout=)`` is the sandbox's own kill deadline, enforced where the code runs (ASYNC109 is about
# callers' deadlines, which asyncio.timeout around the call still gives them).
class Sandbox(ABC):
    """One isolated ``envkit serve`` server plus command execution next to it; an async context manager."""

    kind: str = ""
    limits: SandboxLimits
    url: str = ""
    """``http://host:port`` of the server once running."""
    token: str | None = None
    """Bearer token the server requires (None: none)."""

    def __init__(self) -> None:
        self.state = State.CREATED
        self.started_at = 0.0
        self.uses = 0
        """How many times a pool handed this sandbox out."""

    @abstractmethod
    async def start(self) -> None:
        """Start the server and wait until ``/health`` answers; on any failure nothing is left behind."""

    @abstractmethod
    async def exec(self, code_or_cmd: str | Sequence[str], *, timeout: float = 10.0,  # noqa: ASYNC109
                   stdin: str | bytes = b"") -> ExecResult:
        """Run Python source (str) or an argv (list) in the sandbox; killed after ``timeout`` seconds."""

    @abstractmethod
    async def scrub(self) -> bool:
        """Kill every process ``exec`` left, delete its files; True when nothing is left (a pool checks each
        release with this and replaces a sandbox that is not clean)."""

    @abstractmethod
    async def save_files(self) -> bytes:
        """The files ``exec`` left in its working directory, as a tar (a snapshot's part that is not the env's
        state); SnapshotError when they cannot be read whole."""

    @abstractmethod
    async def load_files(self, archive: bytes) -> None:
        """Kill what ``exec`` left running and make its working directory hold ``archive``'s files (from
        :meth:`save_files` of any sandbox); SnapshotError for an archive whose members would land elsewhere."""

    @abstractmethod
    async def close(self) -> None:
        """Stop and remove everything the sandbox made (idempotent)."""

    async def lost(self) -> str | None:
        """Why this sandbox can no longer serve (its container or process is gone: OOM-killed, exited), naming it
        and where it ran; None while it runs."""
        return None

    async def alive(self) -> bool:
        """True when the server still answers ``/health``."""
        if self.state is not State.RUNNING:
            return False
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def age_s(self) -> float:
        """Seconds since the server became healthy (0 before)."""
        return time.monotonic() - self.started_at if self.started_at else 0.0

    def _require(self, *states: State) -> None:
        if self.state not in states:
            wanted = " or ".join(s.value for s in states)
            raise SandboxStateError(f"{type(self).__name__} is {self.state.value}, this needs it {wanted}")

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


async def wait_healthy(url: str, *, deadline: float, failed: Any = None, poll_s: float = 0.02) -> None:
    """Poll ``url/health`` until it answers 200 or ``deadline`` (a ``time.monotonic()`` value) passes.

    ``failed`` is an optional async callable returning an error message once the server can never come up (its
    process exited); it is asked every 0.5 s so a crashed server fails fast instead of at the deadline.
    """
    next_check = time.monotonic() + 0.5
    async with httpx.AsyncClient(timeout=httpx.Timeout(1.0, connect=0.5)) as client:
        while True:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if failed is not None and now >= next_check:
                next_check = now + 0.5
                reason = await failed()
                if reason:
                    raise SandboxStartError(reason)
            if now >= deadline:
                raise SandboxStartError(f"{url}/health did not answer before the start deadline")
            await asyncio.sleep(poll_s)
