"""A managed SGLang server: token-in/token-out generation over the native ``/generate`` route and in-place
weight reload from disk, with the same semantics as :class:`generators.engines.vllm.VLLMEngine`.

The facts this relies on were read from the SGLang 0.5.23 sources (``python/sglang/srt/...``):

* ``POST /generate`` takes ``input_ids`` and ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
  ``stop``, ``sampling_seed``) and, with ``return_logprob``, answers ``output_ids`` plus
  ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text-or-null]`` per sampled token,
  ``meta_info.finish_reason`` as ``{"type": "stop" | "length" | "abort", ...}`` and ``meta_info.weight_version``
  (``managers/tokenizer_manager.py``, ``managers/schedule_batch.py`` ``FINISH_*``).
* The returned logprob is ``log softmax(logits / temperature)`` of the sampled token: after temperature, before
  top-p/top-k truncation (``layers/sampler.py``). ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would switch that to
  temperature 1, so the launcher pins it off. Temperature 0 is sampled as top-k 1 at temperature 1, so greedy
  logprobs are the temperature-1 ones.
* ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version`` takes the tokenizer manager's
  writer lock, so requests in flight finish first and new ones wait; it reloads, flushes the radix cache
  (``flush_cache`` defaults to true) and tags the version in one call (``entrypoints/http_server.py``,
  ``managers/tokenizer_manager.py``, ``managers/scheduler_components/weight_updater.py``). ``GET /model_info``
  reports ``weight_version``.
* ``GET /health_generate`` answers 503 until the server has warmed up, then runs a one-token generation.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from generators.engines.base import Completion, EngineError, FinishReason, SamplingParams
from generators.engines.managed import ServerBackedEngine, ServerOptions
from generators.precision import auto_dtype

log = logging.getLogger(__name__)


def sglang_available() -> str | None:
    """None if ``sglang`` can be imported here (checked without importing it), else why not."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError) as e:
        return f"sglang cannot be found: {type(e).__name__}: {e}"
    if spec is None:
        return (f"sglang is not installed in {sys.prefix}; it needs its own environment "
                "(`pip install sglang` pulls CUDA torch; for CPU see https://docs.sglang.io/platforms/cpu_server.html)")
    return None


def launch_env(device: str | None = None) -> dict[str, str]:
    """Environment the server needs on top of ours."""
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # logprobs after temperature (see the module docstring)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU backend is off unless this is set
    return env


def generate_body(prompt_ids: list[int], sampling: SamplingParams) -> dict[str, Any]:
    """The native ``/generate`` request for one token-in/token-out completion."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed  # honoured only with --enable-deterministic-inference
    # logprob_start_len -1 (the default) returns logprobs for the output tokens only.
    return {"input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True,
            "logprob_start_len": -1, "stream": False}


def _completion_from_generate(data: dict[str, Any], weight_version: int) -> Completion:
    """A :class:`Completion` from a non-streaming ``/generate`` answer.

    The weight version is the server's ``meta_info.weight_version`` when it is an integer (it is the version that
    served the request: weight updates wait for requests in flight), else ``weight_version``.
    """
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"SGLang /generate answered without meta_info: {str(data)[:200]}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError("SGLang /generate answered without meta_info.output_token_logprobs "
                          "(was return_logprob set?)")
    logprob_ids = [int(entry[1]) for entry in entries]
    ids = data.get("output_ids")
    ids = logprob_ids if ids is None else [int(i) for i in ids]
    if ids != logprob_ids:
        raise EngineError(f"SGLang returned {len(ids)} output ids but logprobs for {len(logprob_ids)} tokens "
                          f"that do not match them: {ids[:8]}... vs {logprob_ids[:8]}...")
    if any(entry[0] is None for entry in entries):  # orjson writes NaN and -inf as null
        raise EngineError(f"SGLang returned a non-finite logprob: {entries[:8]}...")
    logprobs = [float(entry[0]) for entry in entries]
    reason = meta.get("finish_reason")
    matched = reason.get("matched") if isinstance(reason, dict) else None  # a stop string or token id
    return Completion(ids, logprobs, _finish(reason), weight_version=_version(meta.get("weight_version"),
                                                                             weight_version),
                      stop_string=matched if isinstance(matched, str) else None)


def _finish(reason: Any) -> FinishReason:
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


def _version(reported: Any, fallback: int) -> int:
    try:
        return int(reported)
    except (TypeError, ValueError):
        return fallback


class SGLangEngine(ServerBackedEngine):
    """Starts ``sglang.launch_server`` as a subprocess we own.

    Generation is token-in/token-out over the native ``/generate`` route, with the logprob of each sampled token
    after temperature (before top-p truncation). Weights reload in place from an HF safetensors dir through
    ``/update_weights_from_disk``, which also flushes the prefix cache and tags the version the server reports.
    If the server dies, the next request restarts it (and reloads the latest weights) once.

    ``device="cpu"`` runs SGLang's CPU backend (Intel Xeon with AMX; needs an SGLang built for CPU);
    ``None`` lets SGLang pick the accelerator. ``options`` (:class:`ServerOptions`, shared with vLLM) says how the
    server is started; its ``dtype="auto"`` is bfloat16 on an accelerator or a CPU with native bfloat16 and float32
    on other CPUs (:mod:`generators.precision`). ``python`` is the interpreter that has
    ``sglang`` (default: this one); SGLang pins its own torch, so it often lives in an environment of its own.
    """

    backend = "SGLang"

    def __init__(
        self,
        model: str | Path | None = None,
        options: ServerOptions = ServerOptions(),  # noqa: B008 - frozen, so one shared default is safe
        *,
        mem_fraction_static: float | None = None,
        device: str | None = None,
        python: str = sys.executable,
    ) -> None:
        self.dtype = auto_dtype(on_gpu=device != "cpu") if options.dtype == "auto" else options.dtype
        self.mem_fraction_static = mem_fraction_static
        self.device = device
        self.python = python
        super().__init__(model, options, server_name="sglang", env=launch_env(device), health_path="/health_generate")

    def _command(self, port: int) -> list[str]:
        """The argv that launches ``sglang.launch_server`` on ``port``."""
        argv = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", self._model_path, "--served-model-name", self.model_name,
            "--host", self.server.host, "--port", str(port),
            "--context-length", str(self.options.max_model_len), "--dtype", self.dtype,
            # The initial checkpoint is version 0; /update_weights_from_disk re-tags it (the default is "default").
            "--weight-version", "0",
            "--log-level-http", "warning",
        ]
        if self.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.device is not None:
            argv += ["--device", self.device]
            if self.device == "cpu":
                argv += ["--disable-overlap-schedule"]  # as in SGLang's CPU server guide (docs/platforms/cpu_server.md)
        return [*argv, *self.options.extra_args]

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        version = await self._serving_version()
        data = await self._post("/generate", generate_body(prompt_ids, sampling))
        return _completion_from_generate(data, version)

    async def _apply_weights(self, path: Path, version: int) -> None:
        # One call: waits for requests in flight, holds new ones, reloads, flushes the cache, tags the version.
        data = await self._send("POST", "/update_weights_from_disk", {
            "model_path": str(path), "weight_version": str(version), "flush_cache": True,
            "abort_all_requests": False,
        })
        if data.get("success") is False:  # SGLang answers 400 on failure; this guards older servers
            raise EngineError(f"SGLang could not load {path}: {data.get('message')}")

    async def server_weight_version(self) -> str:
        """The weight version as the server reports it (``/model_info``)."""
        data = await self._get("/model_info")
        return str(data["weight_version"])
