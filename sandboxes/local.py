"""LocalSandbox: the Sandbox interface without Docker. ``envkit serve NAME`` runs as a child process on loopback.

It isolates nothing: it is for machines without a Docker engine, where an env should still run out of process
behind the same interface. ``exec`` runs on the host in a directory of the sandbox's own, with a timeout and the
output cap. Where this process may switch users (root), it runs as a uid leased for the sandbox's life, and every
process it started is killed when it ends, as in a container; otherwise only its process group is, and a process
that calls ``setsid()`` escapes. The server ends with this process, also when this one is SIGKILLed. Envs that run
model-written code refuse to run here, because ``ENVKIT_SANDBOX`` says ``local``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO

from envkit.agents import untrusted
from envkit.remote import PARENT_ENV, SNAPSHOT_KEY_ENV
from sandboxes.base import (
    SANDBOX_ENV,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxStartError,
    State,
    exec_argv,
    snapshot_key,
    wait_healthy,
)


def _empty(directory: str) -> None:
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stop(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the server, so it closes its envs and the sandboxes they lease (each in a session of its own, out of
    reach of the kill below), then SIGKILL its whole process group and reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)
    # Also after the leader exited: children it left in the group die with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


class LocalSandbox(Sandbox):
    """``envkit serve`` for env ``env`` as a child process of this one, on a free loopback port."""

    kind = "local"
    stop_grace_s = 10.0
    """How long ``close`` lets the server shut down (closing its envs) before it kills the server's process group."""

    def __init__(self, env: str, *, limits: SandboxLimits | None = None, start_timeout_s: float = 30.0,
                 options: Sequence[str] = ()) -> None:
        super().__init__()
        self.env = env
        self.options = list(options)
        """``envkit serve``'s options beyond the port: the env kwargs its operator sets (``serve_options``)."""
        self.limits = limits or SandboxLimits()
        self.start_timeout_s = start_timeout_s
        self.token = secrets.token_urlsafe(24)
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self._lease: contextlib.AbstractAsyncContextManager[int | None] | None = None
        self._uid: int | None = None
        self._workdir: str | None = None

    def _child_env(self) -> dict[str, str]:
        return {**os.environ, "ENVKIT_TOKEN": self.token, SANDBOX_ENV: self.kind, PARENT_ENV: str(os.getpid()),
                SNAPSHOT_KEY_ENV: snapshot_key()}

    async def start(self) -> None:
        """Start ``envkit serve`` and wait for ``/health`` within ``start_timeout_s``."""
        self._require(State.CREATED)
        self.state = State.STARTING
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: nobody reads the server's log while it runs, and a full pipe would block it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  # lives as long as the server; close() closes it
        try:
            self._lease = untrusted.users.lease()
            self._uid = await self._lease.__aenter__()
            self._workdir = tempfile.mkdtemp(prefix="envkit-sandbox-")
            if self._uid is not None:
                os.chown(self._workdir, self._uid, self._uid)
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "envkit.cli", "serve", self.env, "--port", str(port), *self.options,
                env=self._child_env(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=self._log, start_new_session=True)
            await wait_healthy(self.url, deadline=time.monotonic() + self.start_timeout_s, failed=self._exit_reason)
        except BaseException as e:
            await asyncio.shield(self.close())
            if isinstance(e, SandboxError) or not isinstance(e, Exception):
                raise
            raise SandboxStartError(f"envkit serve {self.env} failed to start: {type(e).__name__}: {e}") from e
        self.state = State.RUNNING
        self.started_at = time.monotonic()

    async def lost(self) -> str | None:
        proc = self._proc
        if proc is None or proc.returncode is None:
            return None
        return f"sandbox process envkit serve {self.env} (pid {proc.pid}) exited with status {proc.returncode}"

    async def _exit_reason(self) -> str | None:
        proc = self._proc
        if proc is None or proc.returncode is None:
            return None
        assert self._log is not None
        self._log.seek(0)
        tail = self._log.read()[-2000:].decode(errors="replace").strip()
        return f"envkit serve {self.env} exited with status {proc.returncode} before serving:\n{tail}"

    async def close(self) -> None:
        """Stop the server, killing its process group after ``stop_grace_s`` (idempotent)."""
        self.state = State.CLOSED
        proc, self._proc = self._proc, None
        if proc is not None:
            await _stop(proc, self.stop_grace_s)
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.__aexit__(None, None, None)  # kills whatever exec left of the uid's
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def exec(self, code_or_cmd: str | Sequence[str], *, timeout: float = 10.0,  # noqa: ASYNC109
                   stdin: str | bytes = b"") -> ExecResult:
        """Run Python source or an argv on the host (no isolation!) in the sandbox's directory; killed at timeout."""
        self._require(State.RUNNING)
        assert self._workdir is not None
        argv = exec_argv(code_or_cmd)
        if argv[0] == "python3":
            argv[0] = untrusted.python()
        data = stdin.encode() if isinstance(stdin, str) else stdin
        env = {**untrusted.SAFE_ENV, "HOME": self._workdir, SANDBOX_ENV: self.kind}
        result = await untrusted.run(argv, stdin=data, timeout_s=timeout, output_limit=self.limits.output_limit_bytes,
                                     user=self._uid, cwd=self._workdir, env=env)
        return ExecResult(**result.decoded())

    async def scrub(self) -> bool:
        """Kill what ``exec`` left (all of it where users can be switched, else nothing more) and empty its dir."""
        self._require(State.RUNNING)
        assert self._workdir is not None
        if self._uid is not None:
            await asyncio.to_thread(untrusted.kill_user, self._uid)
        await asyncio.to_thread(_empty, self._workdir)
        return not os.listdir(self._workdir)

    async def save_files(self) -> bytes:
        """The sandbox's directory as a tar, read as its uid."""
        self._require(State.RUNNING)
        assert self._workdir is not None
        return await untrusted.pack(self._workdir, user=self._uid)

    async def load_files(self, archive: bytes) -> None:
        """Kill what ``exec`` left and replace the sandbox's directory with ``archive``'s files, written as its uid."""
        await self.scrub()
        assert self._workdir is not None
        await untrusted.unpack(self._workdir, archive, user=self._uid)

    def __repr__(self) -> str:
        return f"<LocalSandbox {self.env} {self.state.value} url={self.url or '-'}>"
