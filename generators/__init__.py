"""generators: multi-turn LLM ⇄ env rollouts through an inference server, exact about tokens.

The public names below load lazily, so ``envkit``'s CLI can find ``envkit eval`` here without importing
transformers or an inference engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ChatTokenizer": "generators.chat",
    "ChatCompletion": "generators.engines.base",
    "Completion": "generators.engines.base",
    "EngineError": "generators.engines.base",
    "InferenceEngine": "generators.engines.base",
    "SamplingParams": "generators.engines.base",
    "HFEngine": "generators.engines.hf",
    "OpenAIEndpoint": "generators.engines.openai_chat",
    "SGLangEngine": "generators.engines.sglang",
    "VLLMEngine": "generators.engines.vllm",
    "bundled_model_dir": "generators.models",
    "resolve_model": "generators.models",
    "Generator": "generators.rollout",
    "GeneratorConfig": "generators.config",
    "env_factory": "generators.rollout",
    "Trajectory": "generators.trajectory",
    "read_jsonl": "generators.trajectory",
    "write_jsonl": "generators.trajectory",
}

__all__ = [
    "ChatCompletion",
    "ChatTokenizer",
    "Completion",
    "EngineError",
    "Generator",
    "GeneratorConfig",
    "HFEngine",
    "InferenceEngine",
    "OpenAIEndpoint",
    "SGLangEngine",
    "SamplingParams",
    "Trajectory",
    "VLLMEngine",
    "bundled_model_dir",
    "env_factory",
    "read_jsonl",
    "resolve_model",
    "write_jsonl",
]

if TYPE_CHECKING:
    from generators.chat import ChatTokenizer
    from generators.config import GeneratorConfig
    from generators.engines.base import ChatCompletion, Completion, EngineError, InferenceEngine, SamplingParams
    from generators.engines.hf import HFEngine
    from generators.engines.openai_chat import OpenAIEndpoint
    from generators.engines.sglang import SGLangEngine
    from generators.engines.vllm import VLLMEngine
    from generators.models import bundled_model_dir, resolve_model
    from generators.rollout import Generator, env_factory
    from generators.trajectory import Trajectory, read_jsonl, write_jsonl


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'generators' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
