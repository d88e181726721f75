"""``envkit.make(NAME, sandbox=...)``: an env that runs inside a sandbox of its own, RemoteEnv underneath.

envkit finds these providers through the ``envkit.sandboxes`` entry-point group (it never imports this package):

- ``sandbox="docker"``: the env's image (built by ``envkit build NAME`` on first use, rebuilt when its inputs
  change) in a fresh container; ``close`` removes the container. Fails when no engine is reachable.
- ``sandbox="local"``: ``envkit serve NAME`` as a child process; no isolation.
- ``sandbox="auto"``: docker when an engine answers, else local, saying so in the log.

``pool=`` (a SandboxPool of this env's image, which :func:`open_pool` makes) lends it a sandbox, given back instead
of removed at ``close``. ``sandbox_options`` (a dict) tunes the sandboxes it starts itself: ``limits``
(SandboxLimits), ``start_timeout_s``.

The env kwargs a session may not set (``envkit.remote.OPERATOR_KWARGS``: a two-player game's ``opponent``) start the
sandbox's server instead (``envkit serve --kwargs``); a pool's sandboxes are started with its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from envkit.core import Env, Snapshot, StepResult, Task, check_kind
from envkit.errors import ResetNeededError
from envkit.messages import Message
from envkit.ref import EnvRef
from envkit.registry import EnvSpec
from envkit.remote import OPERATOR_KWARGS, RemoteConfig, RemoteEnv
from sandboxes.base import Sandbox, SandboxLimits, SandboxLost, serve_command, serve_options
from sandboxes.docker import DockerSandbox
from sandboxes.engine import engine_reachable
from sandboxes.local import LocalSandbox
from sandboxes.pool import SandboxPool

log = logging.getLogger(__name__)
T = TypeVar("T")
_image_tags: dict[str, str] = {}
START_TIMEOUT_S = 30.0
"""How long a sandbox may take to answer its health check, unless ``sandbox_options`` say otherwise."""


class SandboxedEnv(Env):
    """The env ``name`` served from a sandbox: ``init`` gets the sandbox and opens a session, ``close`` ends both."""

    def __init__(self, name: str, *, acquire: Callable[[], Awaitable[Sandbox]],
                 release: Callable[[Sandbox], Awaitable[None]], env_kwargs: dict[str, Any] | None = None,
                 remote: RemoteConfig | None = None, kind: str = "") -> None:
        self.name = name
        self._acquire, self._release = acquire, release
        self.env_kwargs = dict(env_kwargs or {})
        self.remote_config = remote or RemoteConfig(transport="ws")
        self.sandbox: Sandbox | None = None
        """The sandbox serving this env once ``init`` ran (use its ``exec`` to run code next to the env)."""
        self._remote: RemoteEnv | None = None
        self.tools = []  # type: ignore[misc]  # the server's, once the session exists
        self.spec = EnvSpec(name=name, entry_point="sandboxes.env:SandboxedEnv", kwargs=self.env_kwargs,
                            description=f"{name} in a {kind or 'sandbox'}", source=f"sandbox={kind!r}")

    async def init(self) -> None:
        """Get a running sandbox and open a session on its server (idempotent)."""
        if self._remote is not None:
            return
        sandbox = await self._acquire()
        try:
            scheme = "ws" if (self.remote_config.transport or "ws") == "ws" else "http"
            config = dataclasses.replace(self.remote_config, token=sandbox.token)
            remote = RemoteEnv(f"{sandbox.url.replace('http', scheme, 1)}/{self.name}", remote=config,
                               env_kwargs=self.env_kwargs)
            await _named(sandbox, remote.init())
        except BaseException:
            await asyncio.shield(self._release(sandbox))
            raise
        self.sandbox, self._remote = sandbox, remote
        self.tools = remote.tools  # type: ignore[misc]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start an episode in the sandbox."""
        await self.init()
        assert self._remote is not None and self.sandbox is not None
        return await _named(self.sandbox, self._remote.reset(seed=seed, task=task))

    async def step(self, action: Message) -> StepResult:
        """One assistant message to the sandboxed env."""
        assert self._remote is not None and self.sandbox is not None, "ContractChecker runs reset before step"
        return await _named(self.sandbox, self._remote.step(action))

    @property
    def snapshot_kind(self) -> str:
        """Any sandbox of the served env: a snapshot restores into another, of either runtime."""
        return f"envkit-sandbox:{self.name}"

    async def snapshot(self) -> Snapshot:
        """The sandboxed env's state (its server's token, see :meth:`RemoteEnv.snapshot`) and the files ``exec`` left
        in the sandbox (a tar of its working directory): it restores into another sandbox of this env, since every
        sandbox this process starts shares one snapshot key. Processes still running there are not in it."""
        await self.init()
        assert self._remote is not None and self.sandbox is not None
        state = await self._remote.snapshot()
        return Snapshot(self.snapshot_kind, (state.state, await self.sandbox.save_files()))

    async def restore(self, snapshot: Snapshot) -> None:
        """Put the sandboxed env in ``snapshot``'s state, and its sandbox's working directory in its files'."""
        check_kind(self, snapshot)
        await self.init()
        assert self._remote is not None and self.sandbox is not None
        state, files = snapshot.state
        await self._remote.restore(Snapshot(self._remote.snapshot_kind, state))
        await self.sandbox.load_files(files)

    def tasks(self, split: str = "train") -> Sequence[Task] | None:
        """The sandboxed env's task list (see :meth:`RemoteEnv.tasks`); the sandbox must be up: ``init`` first."""
        if self._remote is None:
            raise ResetNeededError(f"{self.name}'s task list lives in its sandbox: await init() before tasks()")
        return self._remote.tasks(split)

    async def close(self) -> None:
        """Delete the session, then give the sandbox back (its container is removed unless pooled); idempotent."""
        remote, self._remote = self._remote, None
        sandbox, self.sandbox = self.sandbox, None
        try:
            if remote is not None:
                await remote.close()
        finally:
            if sandbox is not None:
                await self._release(sandbox)


async def _named(sandbox: Sandbox, call: Awaitable[T]) -> T:
    """``call`` to the sandbox's server; a failure its sandbox's death explains says so (:class:`SandboxLost`)."""
    try:
        return await call
    except Exception as e:
        why = await sandbox.lost()
        if why is None:
            raise
        raise SandboxLost(f"{why}; the episode it served failed ({type(e).__name__})") from e


async def _image_for(name: str) -> str:
    """The up-to-date image of env ``name``, built once per process when missing or stale."""
    if name not in _image_tags:
        from sandboxes.images import build

        _image_tags[name] = (await asyncio.to_thread(build, name)).tag
    return _image_tags[name]


def operator_kwargs(env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of an env's kwargs that its sandbox's server is started with, not its session (OPERATOR_KWARGS)."""
    return {k: v for k, v in env_kwargs.items() if k in OPERATOR_KWARGS}


async def _factory(name: str, kind: str, limits: SandboxLimits | None, start_timeout_s: float,
                   options: list[str]) -> Callable[[], Sandbox]:
    """How to make one (not yet started) sandbox of ``kind`` serving env ``name``, its server started with
    ``options`` (``serve_options``)."""
    if kind == "docker":
        image = await _image_for(name)
        command = serve_command(name, options) if options else None  # None: the image's own, the same without them
        return lambda: DockerSandbox(image, limits=limits, start_timeout_s=start_timeout_s, command=command)
    return lambda: LocalSandbox(name, limits=limits, start_timeout_s=start_timeout_s, options=options)


def _sandboxed(kind: str, name: str, remote: RemoteConfig | None, sandbox_options: dict[str, Any] | None,
               pool: SandboxPool | None, env_kwargs: dict[str, Any]) -> Env:
    """Env ``name`` in a sandbox of ``kind``: one started per env, or borrowed from ``pool``."""
    options = dict(sandbox_options or {})
    limits: SandboxLimits | None = options.pop("limits", None)
    start_timeout_s: float = options.pop("start_timeout_s", START_TIMEOUT_S)
    if options:
        raise TypeError(f"unknown sandbox_options {sorted(options)}; known: limits, start_timeout_s (a warm pool "
                        "is make()'s pool=)")
    served = operator_kwargs(env_kwargs)
    options = serve_options(name, served)  # kwargs a server cannot be given fail here, not in the first episode
    session_kwargs = {k: v for k, v in env_kwargs.items() if k not in served}
    if pool is not None:
        if served != pool.server_kwargs:
            raise ValueError(f"sandboxed env {name!r} with {served} needs a pool whose servers were started with "
                             f"them (open_pool(..., server_kwargs=...)); this pool's were started with "
                             f"{pool.server_kwargs}")
        return SandboxedEnv(name, acquire=pool.acquire, release=pool.release, env_kwargs=session_kwargs,
                            remote=remote, kind=f"{kind} pool")

    async def acquire() -> Sandbox:
        sandbox = (await _factory(name, kind, limits, start_timeout_s, options))()
        await sandbox.start()
        return sandbox

    return SandboxedEnv(name, acquire=acquire, release=_close, env_kwargs=session_kwargs, remote=remote, kind=kind)


def docker(name: str, *, remote: RemoteConfig | None = None, sandbox_options: dict[str, Any] | None = None,
           pool: SandboxPool | None = None, **env_kwargs: Any) -> Env:
    """``sandbox="docker"``: env ``name`` in a container of its own (or one borrowed from ``pool``)."""
    return _sandboxed("docker", name, remote, sandbox_options, pool, env_kwargs)


def local(name: str, *, remote: RemoteConfig | None = None, sandbox_options: dict[str, Any] | None = None,
          pool: SandboxPool | None = None, **env_kwargs: Any) -> Env:
    """``sandbox="local"``: env ``name`` behind ``envkit serve`` in a child process (no isolation)."""
    return _sandboxed("local", name, remote, sandbox_options, pool, env_kwargs)


def _auto_kind(name: str) -> str:
    """docker when an engine is reachable, else local (logged)."""
    if engine_reachable():
        return "docker"
    log.warning("no Docker engine reachable: env %r runs in a local process sandbox (no isolation); start one with "
                "`python -m sandboxes.engine up`", name)
    return "local"


def auto(name: str, **kwargs: Any) -> Env:
    """``sandbox="auto"``: docker when an engine is reachable, else the local-process sandbox (logged)."""
    return docker(name, **kwargs) if _auto_kind(name) == "docker" else local(name, **kwargs)


async def open_pool(name: str, kind: str, *, size: int, limits: SandboxLimits | None = None,
                    wait: bool = True, server_kwargs: dict[str, Any] | None = None) -> SandboxPool:
    """A started warm pool of ``size`` sandboxes serving env ``name``, for ``envkit.make(name, sandbox=kind,
    pool=pool)``: containers of its image (``docker``, building the image if needed), ``envkit serve`` child processes
    (``local``), or either as ``sandbox="auto"`` picks; ``wait=False`` returns while they start (``acquire`` waits
    for the first); ``server_kwargs``: the env kwargs their servers start with (``operator_kwargs`` of the env's).
    The caller closes it."""
    if kind == "auto":
        kind = _auto_kind(name)
    if kind not in ("docker", "local"):
        raise ValueError(f"unknown sandbox kind {kind!r}; known: docker, local, auto")
    served = dict(server_kwargs or {})
    factory = await _factory(name, kind, limits, START_TIMEOUT_S, serve_options(name, served))
    pool = SandboxPool(factory, size=size, server_kwargs=served)
    try:
        await pool.start(wait=wait)
    except BaseException:
        await pool.close()
        raise
    return pool


async def _close(sandbox: Sandbox) -> None:
    await sandbox.close()


async def open_pool_for(ref: EnvRef, *, size: int, wait: bool = True) -> SandboxPool:
    """:func:`open_pool` for the sandboxed env ``ref``: of its kind, its servers started with its operator kwargs."""
    if ref.sandbox is None:
        raise ValueError(f"env {ref.name!r} is not sandboxed: it has no pool to open")
    return await open_pool(ref.name, ref.sandbox, size=size, wait=wait, server_kwargs=operator_kwargs(ref.kwargs))
