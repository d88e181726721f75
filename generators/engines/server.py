"""A model server subprocess we own (free port, log file, health wait, crash detection, clean stop, and death with
its owner), or one somebody else runs that we only attach to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import httpx

from generators.engines.base import EngineError

log = logging.getLogger(__name__)

OWNER_ENV = "ENVKIT_SERVER_OWNER"
"""Set in a managed server's environment (and so its children's) to the owning process's pid."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _watchdog_argv(read_fd: int, argv: list[str]) -> list[str]:
    """``argv`` run under :mod:`generators.engines.watchdog`, which kills the whole process group once ``read_fd``
    reads EOF: when this process dies, however it dies."""
    return [sys.executable, "-m", "generators.engines.watchdog", str(read_fd), "--", *argv]


async def wait_healthy(url: str, timeout_s: float, *, check: Callable[[], None] = lambda: None) -> bool:
    """Poll ``url`` until it answers 200 (True) or ``timeout_s`` passes (False); ``check`` runs before each try
    and may raise to give up early."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            check()
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return True
            await asyncio.sleep(0.5)
    return False


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ManagedServer:
    """Runs ``command(port)`` in its own process group, logs to ``log_path``, and waits on ``health_path``.

    The whole process group is killed on stop, so helper processes a server forks (vLLM's engine core) go too;
    a finalizer does the same if the owner forgets to stop it. The server runs under a watchdog holding the read end
    of a pipe whose write end only this process has: if this process dies, even by SIGKILL, the watchdog reads EOF
    and kills the group (a parent-death signal reaches the server's leader only; its children would live on).
    """

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        health_path: str = "/health",
        startup_timeout: float = 600.0,
    ) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        self.env = env or {}
        self.host = host
        self.requested_port = port
        self.port = port or 0
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.process: asyncio.subprocess.Process | None = None
        self._finalizer: weakref.finalize | None = None
        self._lifeline: int | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        """True while the server process is running."""
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Launch the server and wait until its health route answers 200; raises EngineError with the log tail."""
        if self.alive:
            return
        self.port = self.requested_port or free_port(self.host)
        argv = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s on port %d: %s (log: %s)", self.name, self.port, " ".join(argv), self.log_path)
        read_fd, self._lifeline = os.pipe()  # both non-inheritable; the read end is passed to the watchdog only
        try:
            with self.log_path.open("ab") as log_file:
                log_file.write(f"\n==== {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
                log_file.flush()
                self.process = await asyncio.create_subprocess_exec(
                    *_watchdog_argv(read_fd, argv), stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL, env={**os.environ, **self.env, OWNER_ENV: str(os.getpid())},
                    start_new_session=True, pass_fds=(read_fd,),
                )
        finally:
            os.close(read_fd)
            if self.process is None:
                os.close(self._lifeline)
                self._lifeline = None
        self._finalizer = weakref.finalize(self, _kill_group, self.process.pid, signal.SIGKILL)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise

    async def _wait_healthy(self) -> None:
        def check() -> None:
            if not self.alive:
                raise EngineError(f"{self.name} exited with code {self.process.returncode} while starting.\n"
                                  f"Last log lines ({self.log_path}):\n{self.log_tail()}")

        if not await wait_healthy(self.base_url + self.health_path, self.startup_timeout, check=check):
            raise EngineError(f"{self.name} did not become healthy within {self.startup_timeout:.0f} s.\n"
                              f"Last log lines ({self.log_path}):\n{self.log_tail()}")

    async def exited_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the process to exit; True if it is not running."""
        if self.process is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), seconds)
        except TimeoutError:
            return False
        return True

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` seconds; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            _kill_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
        # Children (e.g. vLLM's engine core) can outlive the leader; the group kill reaches them.
        _kill_group(process.pid, signal.SIGKILL)
        await process.wait()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class AttachedServer:
    """A model server somebody else runs at ``base_url``: waited on, never started, restarted or stopped by us."""

    process: asyncio.subprocess.Process | None = None

    def __init__(self, name: str, base_url: str, *, health_path: str = "/health", startup_timeout: float = 600.0
                 ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.host = httpx.URL(self.base_url).host
        self.health_path = health_path
        self.startup_timeout = startup_timeout

    @property
    def alive(self) -> bool:
        """Always True: whether it answers is each request's to find out."""
        return True

    async def start(self) -> None:
        """Wait until its health route answers 200; raises EngineError after ``startup_timeout``."""
        if not await wait_healthy(self.base_url + self.health_path, self.startup_timeout):
            raise EngineError(f"{self.name} at {self.base_url} did not answer {self.health_path} within "
                              f"{self.startup_timeout:.0f} s")

    async def stop(self) -> None:
        """Nothing: the server is its owner's."""

    async def exited_within(self, seconds: float) -> bool:
        """False: an attached server is never restarted by us."""
        return False

    def log_tail(self, lines: int = 30) -> str:
        """Its log is with whoever runs it."""
        return f"(the log of {self.base_url} is with whoever runs it)"
