"""What every engine that owns a model-server subprocess shares: the HTTP client, crash detection with one
restart-and-retry, restoring the latest weights after a restart, and chat through the server's OpenAI routes.

A backend subclasses :class:`ServerBackedEngine` and supplies the launch command (``_command``), how to load a
checkpoint into the running server (``_apply_weights``, built only from ``_send``), and ``generate``; one that can
take weights from memory also supplies ``_apply_tensors`` (see ``push_weights``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx2

from generators.engines.base import ChatCompletion, EngineError, InferenceEngine, SamplingParams
from generators.engines.openai_chat import OpenAIChat
from generators.engines.server import AttachedServer, ManagedServer
from generators.models import cache_dir, resolve_model

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE = (httpx2.ConnectError, httpx2.RemoteProtocolError, httpx2.ReadError)
"""Transport errors that mean "the server may have died"; anything else is the server's answer."""


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` resolved, if it holds an HF safetensors checkpoint."""
    path = Path(path).resolve()
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no *.safetensors files")
    return path


@dataclass(frozen=True)
class ServerOptions:
    """How a model server (vLLM, SGLang) is started and talked to: what every server-backed engine takes."""

    served_model_name: str = "policy"
    host: str = "127.0.0.1"
    port: int | None = None
    """None: a free port."""
    max_model_len: int = 2048
    """Prompt plus completion tokens per request (vLLM's ``--max-model-len``, SGLang's ``--context-length``)."""
    dtype: str = "auto"
    """auto (bfloat16 on a GPU or a CPU with native bfloat16, else float32: :mod:`generators.precision`; not the
    checkpoint's dtype, as the servers' own auto would take), bfloat16, float32, ..."""
    extra_args: tuple[str, ...] = ()
    """More arguments for the server's command line."""
    log_path: Path | None = None
    """The server's log; None: ``<cache>/logs/<server>-<served_model_name>-<pid>.log``, so that concurrent servers
    never interleave."""
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    auto_restart: bool = True
    """Restart a server that died (and restore its weights) on the next request; never one that ``url`` names."""
    max_restarts: int = 3
    url: str | None = None
    """Attach to a server of this kind that somebody else runs, instead of starting one."""


class ServerBackedEngine(InferenceEngine):
    """An :class:`InferenceEngine` whose model server is a :class:`ManagedServer` subprocess this engine owns, or,
    with ``url``, a server of the same kind that somebody else runs (never restarted; its weights are ours to load).

    Requests go through ``_request``: if the server died, the first failure restarts it (reloading the latest
    weights) and the request is sent once more. While a restart is under way every other request waits for it,
    so none reaches a server that is still serving the initial weights.
    """

    backend = "server"
    """The backend's display name in log lines and errors."""

    def __init__(self, model: str | Path | None, options: ServerOptions, *, server_name: str,
                 env: dict[str, str] | None = None, health_path: str = "/health") -> None:
        self.model = model
        self.options = options
        self.max_restarts = options.max_restarts
        self.model_name = options.served_model_name
        self.request_timeout = options.request_timeout
        self.auto_restart = options.auto_restart and options.url is None
        self.restarts = 0
        self._version = 0
        self._serving = asyncio.Event()  # clear while new weights are going in: requests wait, then get them
        self._serving.set()
        self._weights: Path | dict[str, Any] | None = None
        """What the server must serve after a restart: the last checkpoint loaded, or the last tensors pushed."""
        self._client: httpx2.AsyncClient | None = None
        self._chat: OpenAIChat | None = None
        self._model_path = ""
        self._started = False
        self._restart_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        log_path = options.log_path or cache_dir() / "logs" / f"{server_name}-{self.model_name}-{os.getpid()}.log"
        self.server: ManagedServer | AttachedServer = (
            AttachedServer(server_name, options.url, health_path=health_path, startup_timeout=options.startup_timeout)
            if options.url else
            ManagedServer(server_name, self._command, log_path=log_path, env=env, host=options.host, port=options.port,
                          health_path=health_path, startup_timeout=options.startup_timeout))

    # --- what a backend supplies -------------------------------------------------------------------------

    @abc.abstractmethod
    def _command(self, port: int) -> list[str]:
        """The server's argv for ``port`` (``self._model_path`` is resolved by then)."""

    async def _on_started(self) -> None:
        """Runs after every (re)start, before weights are restored (using only ``_send``)."""

    @abc.abstractmethod
    async def _apply_weights(self, path: Path, version: int) -> None:
        """Load the checkpoint in ``path`` into the running server as ``version``, using only ``_send`` (it also
        runs inside a restart, where ``_request`` would wait on that restart)."""

    async def _apply_tensors(self, tensors: dict[str, Any], version: int) -> None:
        """Send ``tensors`` into the running server as ``version``, using only ``_send``."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights from memory")

    # --- lifecycle -------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        async with self._start_lock:  # engines sharing this server may start it at once
            if self._started:
                return
            self._model_path = await asyncio.to_thread(resolve_model, self.model)
            await self.server.start()
            self._connect()
            try:
                await self._on_started()
            except BaseException:
                await self.stop()
                raise
            self._started = True

    async def stop(self) -> None:
        self._started = False
        await self._disconnect()
        await self.server.stop()

    def _connect(self) -> None:
        # Idle connections are dropped well before the server drops them (vLLM's and SGLang's uvicorn: after 5 s,
        # httpx's default too), so that a request is rarely sent on one the server is closing at that moment.
        # httpx2, not httpx: httpcore's pool scans its connections quadratically on every request and response
        # (64 agents' calls in flight: most of the gateway's CPU per call); httpcore2's pool does one pass.
        limits = httpx2.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=2.0)
        self._client = httpx2.AsyncClient(base_url=self.base_url, timeout=self.request_timeout, limits=limits)
        self._chat = OpenAIChat(self.base_url + "/v1", model_name=self.model_name, timeout=self.request_timeout)

    async def _disconnect(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._chat is not None:
            await self._chat.aclose()
            self._chat = None

    # --- the shared InferenceEngine parts --------------------------------------------------------------

    async def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: list[dict[str, Any]] | None = None
    ) -> ChatCompletion:
        await self._ensure_running()
        version = await self._serving_version()
        assert self._chat is not None
        return await self._chat.chat(messages, sampling, tools, weight_version=version)

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the checkpoint in ``path`` as ``version``; if the server dies meanwhile it is restarted (with the
        previous weights) and the load is retried once."""
        path = await asyncio.to_thread(checkpoint_dir, path)
        async with self._weights_lock, self._updating():
            await self._with_restart(f"loading weights from {path}", lambda: self._apply_weights(path, version))
            self._weights, self._version = path, version

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Serve ``tensors`` (HF names) as ``version`` without a checkpoint on disk; if the server dies meanwhile it
        is restarted and they are sent again. The engine keeps a reference to them, to restore after a restart."""
        async with self._weights_lock, self._updating():
            # not sent again on a live server: a transfer cut halfway may leave its receivers waiting
            await self._with_restart("sending weights", lambda: self._apply_tensors(tensors, version), resend=False)
            self._weights, self._version = tensors, version

    @contextlib.asynccontextmanager
    async def _updating(self) -> AsyncIterator[None]:
        """While new weights go in, requests wait (see :meth:`_serving_version`)."""
        self._serving.clear()
        try:
            yield
        finally:
            self._serving.set()

    async def _serving_version(self) -> int:
        """The version a request sent now is served by: during an update, the new one, once it is in. (Sent
        during the server's pause, it would be tagged with the old version and sampled by the new weights.)"""
        await self._serving.wait()
        return self._version

    # --- requests --------------------------------------------------------------------------------------

    async def _post(self, route: str, body: dict[str, Any] | None = None, params: dict[str, str] | None = None
                    ) -> dict[str, Any]:
        return await self._request("POST", route, body, params)

    async def _get(self, route: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return await self._request("GET", route, None, params)

    async def _request(self, method: str, route: str, body: dict[str, Any] | None = None,
                       params: dict[str, str] | None = None) -> dict[str, Any]:
        """One request to the running server, restarting it once if it died; EngineError on any failure."""
        return await self._with_restart(f"{method} {route}", lambda: self._send(method, route, body, params))

    async def _send(self, method: str, route: str, body: dict[str, Any] | None = None,
                    params: dict[str, str] | None = None) -> dict[str, Any]:
        """One request, no restart: RETRYABLE errors propagate; a non-200 answer is an EngineError. A JSON body
        is returned as is, an empty one as ``{}``, any other as ``{"text": ...}``."""
        assert self._client is not None, "not connected"
        response = await self._client.request(method, route, json=body, params=params)
        if response.status_code != 200:
            raise EngineError(f"{self.backend} {method} {route} answered {response.status_code}: "
                              f"{response.text[:500]}", status=response.status_code)
        if not response.content:
            return {}
        try:
            data = response.json()
        except ValueError:
            return {"text": response.text}
        return data if isinstance(data, dict) else {"data": data}

    async def _with_restart(self, what: str, action: Callable[[], Awaitable[T]], *, resend: bool = True) -> T:
        """Run ``action`` against a running server; if it fails with a transport error, run it once more: after
        restarting the server if it died, else (with ``resend``) on a new connection, since a server closes an idle
        keep-alive connection when it likes and a request sent on it just then gets no answer."""
        for attempt in (0, 1):
            await self._ensure_running()
            process = self.server.process
            try:
                return await action()
            except RETRYABLE as e:
                if attempt == 0 and self.auto_restart and await self._server_died(process):
                    log.warning("%s server died (%s: %s, during %s); restarting it", self.backend,
                                type(e).__name__, e, what)
                    continue
                if attempt == 0 and resend:
                    log.info("%s %s: %s: %s; sending it again", self.backend, what, type(e).__name__, e)
                    continue
                raise EngineError(f"{self.backend} {what} failed: {type(e).__name__}: {e}") from e
            except EngineError as e:
                # A crashing engine answers its in-flight requests with 5xx, then the server exits.
                if (attempt == 0 and self.auto_restart and (e.status or 0) >= 500
                        and await self._server_died(process, grace_s=10.0)):
                    log.warning("%s server crashed (%s); restarting it", self.backend, e)
                    continue
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _server_died(self, process: object, grace_s: float = 2.0) -> bool:
        """Whether the server that ``process`` was has gone: another request may already be restarting it (or
        have restarted it), else wait a moment, since a connection error right after a crash can beat the exit
        status."""
        if self.server.process is not process or self._restart_lock.locked():
            return True
        return await self.server.exited_within(grace_s)

    async def _ensure_running(self) -> None:
        if not self._started:
            raise EngineError(f"{type(self).__name__} is not started; use `async with engine:` or "
                              "`await engine.start()`")
        if self.server.alive and not self._restart_lock.locked():
            return
        if not self.server.alive and not self.auto_restart:
            raise EngineError(f"the {self.backend} server is not running. Last log lines:\n{self.server.log_tail()}")
        async with self._restart_lock:
            if self.server.alive:  # another request restarted it while we waited
                return
            if not self._started:
                raise EngineError(f"{type(self).__name__} was stopped")
            if self.restarts >= self.max_restarts:
                raise EngineError(f"the {self.backend} server died again after {self.restarts} restarts; giving up. "
                                  f"Last log lines:\n{self.server.log_tail()}")
            self.restarts += 1
            log.warning("restarting %s (restart %d); last log lines:\n%s", self.backend, self.restarts,
                        self.server.log_tail(10))
            await self._disconnect()
            await self.server.stop()
            began = time.monotonic()
            try:
                await self.server.start()
                self._connect()
                await self._on_started()
                await self._restore_weights()
                log.warning("%s server restarted in %.1f s (restart %d), serving weights v%d", self.backend,
                            time.monotonic() - began, self.restarts, self._version)
            except BaseException as e:
                # Never leave a server up with the wrong weights: the next request restarts it again.
                await self._disconnect()
                await self.server.stop()
                if isinstance(e, RETRYABLE):
                    raise EngineError(f"{self.backend} restart failed: {type(e).__name__}: {e}") from e
                raise

    async def _restore_weights(self) -> None:
        """Give a restarted server the weights it served before (none pushed or loaded yet: its base model's)."""
        if isinstance(self._weights, Path):
            await self._apply_weights(self._weights, self._version)
        elif self._weights is not None:
            await self._apply_tensors(self._weights, self._version)
