"""The interface every training backend implements (FSDP2, DeepSpeed), so the RL loop reads the same on both.

One optimizer step of the loop, whatever the backend::

    for k, mb in enumerate(micro_batches):        # gradient accumulation
        logprobs = backend.forward(mb).logprobs   # (B, T), grad-enabled, aligned with mb["input_ids"]
        loss = policy_loss(logprobs, ...) / len(micro_batches)
        backend.backward(loss, last=k == len(micro_batches) - 1)
    stats = backend.step()                        # clip, optimizer + scheduler step, zero grads

Batches are dicts of tensors as made by ``trainer.batching.to_padded``: ``input_ids``, ``attention_mask``,
``loss_mask``, ``rollout_logprobs`` (all (B, T)). ``logprobs[:, t]`` is log p(input_ids[:, t] | input_ids[:, :t])
at ``temperature``; position 0 has no prediction and is 0.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from trainer.backends.hf_export import served_tensors, write_hf_checkpoint

Batch = dict[str, torch.Tensor]


class TokenOutputs(NamedTuple):
    """Per-token values of a batch in the padded (B, T) layout, 0 off the loss mask."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None
    """The critic's V(state before each token); None without a value head."""


@dataclass(frozen=True)
class BackendConfig:
    """What a backend needs to build the policy, its optimizer and its schedule."""

    model_path: str
    """HF checkpoint dir of the initial policy (and reference)."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 1000
    """Optimizer steps the LR schedule spans."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to ``lr * min_lr_ratio``."""
    grad_clip: float = 1.0
    temperature: float = 1.0
    """Logits are divided by it before log-softmax, matching the sampler's logprobs."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype; parameters and optimizer state stay fp32."""
    reference: bool = False
    """Keep a frozen copy of the initial policy for KL (with LoRA: the policy with its adapters disabled)."""
    lora_r: int = 0
    """LoRA adapter rank (``peft``); 0 trains every weight. See :mod:`trainer.backends.lora`."""
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    value_head: bool = False
    """Add PPO's critic (:class:`trainer.backends.common.ValueHead`); ``forward`` then also returns values."""
    gradient_checkpointing: bool = False
    attention: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """transformers' attention kernel; ``auto`` is eager on CPU (faster than SDPA's CPU kernels on rollout-length
    sequences, ~20% per training step here) and SDPA on GPU."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for training logprobs, got {self.temperature}")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0, got {self.lora_r}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"need total_steps >= 1 and warmup_steps >= 0, got {self.total_steps}, "
                             f"{self.warmup_steps}")


class NonFiniteGradientError(RuntimeError):
    """An optimizer step's gradient norm was inf or NaN: its update would make the policy's weights NaN."""


def finite_grad_norm(norm: float) -> float:
    """``norm``, or :class:`NonFiniteGradientError` when it is inf or NaN. The run stops at that step, before the
    weights reach an inference engine (a NaN policy there fails every later rollout) or a checkpoint."""
    if not math.isfinite(norm):
        raise NonFiniteGradientError(
            f"the gradient norm of this optimizer step is {norm}: the run stops before the weights reach the "
            "inference engine or a checkpoint. Resume from the last checkpoint (trainer.resume=latest) once the "
            "cause is found (trainer.dtype=fp32 tells a bf16 overflow from a bad batch or loss)")
    return norm


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports."""

    grad_norm: float
    lr: float


class TrainBackend(abc.ABC):
    """A policy model being trained (sharded however the backend likes), plus an optional frozen reference."""

    rank: int = 0
    world_size: int = 1

    @abc.abstractmethod
    def forward(self, batch: Batch, *, entropy_grad: bool = False) -> TokenOutputs:
        """Per-token logprobs of ``input_ids`` (with grad), entropy (with grad only if ``entropy_grad``) and, with a
        value head, values (with grad) under the policy; (B, T) each."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, last: bool = True) -> None:
        """Accumulate gradients of ``loss`` (already divided by the number of micro-batches). ``last=False``: more
        micro-batches of this optimizer step follow, so a backend may defer its end-of-step work to the last one."""

    @abc.abstractmethod
    def step(self) -> StepStats:
        """Clip gradients, step the optimizer and the LR schedule, zero gradients; :class:`NonFiniteGradientError`
        when the gradient norm is inf or NaN."""

    @abc.abstractmethod
    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs without grad, from the policy or (``reference=True``) the frozen reference."""

    config: BackendConfig

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights by parameter name, on the CPU of rank 0 (empty on other ranks). Collective.

        With LoRA, the adapters merged into the base weights, under the base model's names: the policy as a plain
        model."""

    def served_weights(self) -> dict[str, torch.Tensor]:
        """What an inference engine serves (:meth:`full_state_dict` less the trainer's own parts), on rank 0."""
        return served_tensors(self.full_state_dict(), Path(self.config.model_path))

    def export_weights(self, path: Path) -> None:
        """Write the full policy weights as an HF checkpoint dir (safetensors + config + tokenizer) at ``path``.

        Collective: every rank calls it; rank 0 writes. The directory appears atomically.
        """
        weights = self.served_weights()
        if self.rank == 0:
            write_hf_checkpoint(weights, Path(self.config.model_path), path)
        if self.world_size > 1:
            torch.distributed.barrier()

    def export_adapter(self, path: Path) -> None:
        """Write the policy's LoRA adapters alone at ``path`` as ``peft`` saves them: what an engine serving the
        base model loads as an adapter. Collective: every rank calls it; rank 0 writes."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapters it can export alone")

    @abc.abstractmethod
    def save_state(self, path: Path) -> None:
        """Save model, optimizer and scheduler state into the directory ``path`` (collective)."""

    @abc.abstractmethod
    def load_state(self, path: Path) -> None:
        """Restore what ``save_state`` wrote (collective)."""
