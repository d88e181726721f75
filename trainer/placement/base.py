"""The placement interface, and the local placement: one engine in this process, envs made in rank 0's event loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from envkit import Env
from envkit.ref import EnvRef
from generators.engines.base import InferenceEngine
from generators.engines.factory import make_engine
from trainer.config import Config, InferenceConfig


class RunFailed(RuntimeError):
    """A trainer rank failed or died; the run's other actors were ended."""


class Placement:
    """The local placement: one engine in this process, envs made in rank 0's event loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def engine(self, model_path: str | Path, out: Path, *, max_loras: int = 0, max_lora_rank: int = 0
               ) -> InferenceEngine:
        """The engine rank 0 generates with (not started); with ``max_loras``, a vLLM server of LoRA adapters too."""
        return make_engine(self.inference(beside_trainer=self.cfg.trainer.mode == "async"), model_path, log_dir=out,
                           weight_sync=self.cfg.weight_sync, max_loras=max_loras, max_lora_rank=max_lora_rank)

    def inference(self, *, beside_trainer: bool) -> InferenceConfig:
        """The engines' config. ``beside_trainer``: a trainer computes while they generate, so ``cpu_cores=auto``
        keeps vLLM's own binding, which leaves a core free."""
        if beside_trainer and self.cfg.inference.cpu_cores == "auto":
            return replace(self.cfg.inference, cpu_cores="vllm")
        return self.cfg.inference

    def make_env(self, ref: EnvRef) -> Env:
        """A fresh env for one rollout."""
        return ref.make()

    def sandbox_pool_size(self) -> int:
        """Warm sandboxes rank 0 keeps per sandboxed env (0: none, its episodes run elsewhere): one per rollout in
        flight."""
        return min(self.cfg.generator.concurrency, self.cfg.generator.batch_size)

    def metrics(self) -> dict[str, float]:
        """Health of the placed processes, logged with every step."""
        return {}

    def nodes(self) -> dict[str, str]:
        """Where each of the run's named processes runs (none apart from this one here)."""
        return {}

    async def close(self) -> None:
        """Release what the placement started; idempotent."""
