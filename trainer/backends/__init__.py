"""Training backends (FSDP2, DeepSpeed ZeRO) behind one interface (``trainer/backends/base.py``), and the factory
that picks one from the run's config."""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING, Literal

import torch

from generators.precision import auto_dtype
from trainer.backends.base import BackendConfig, TrainBackend

if TYPE_CHECKING:
    from trainer.config import Config

__all__ = ["BackendConfig", "TrainBackend", "make_backend", "train_dtype"]


def make_backend(cfg: Config, model_path: str, *, sft_steps: int | None = None) -> TrainBackend:
    """The training backend named by ``trainer.backend``: for RL, or with ``sft_steps`` (its optimizer steps) for
    the supervised stage (``sft.lr``, logprobs at temperature 1, no reference and no critic)."""
    t = cfg.trainer
    if sft_steps is None:
        objective = {"lr": t.lr, "total_steps": t.steps * cfg.steps_per_update,
                     "temperature": cfg.generator.temperature, "reference": cfg.algorithm.kl_coef > 0,
                     "value_head": cfg.algorithm.critic}
    else:
        objective = {"lr": cfg.sft.lr, "total_steps": sft_steps}
    attention = t.attention
    if attention == "auto" and sft_steps is None and t.shares_prompts:
        # Groups read their prompts once, as parts of one row (part_attention: each part attends within itself
        # alone); rollouts without a group go through SDPA.
        attention = "sdpa"
    config = BackendConfig(
        model_path=model_path, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule,
        grad_clip=t.grad_clip, dtype=train_dtype(t.dtype), lora_r=cfg.model.lora.r, lora_alpha=cfg.model.lora.alpha,
        lora_dropout=cfg.model.lora.dropout, lora_target_modules=tuple(cfg.model.lora.target_modules),
        gradient_checkpointing=t.gradient_checkpointing, attention=attention, seed=t.seed, **objective,
    )
    if not torch.cuda.is_available():
        keep_freed_memory()
    if t.backend == "deepspeed":
        from trainer.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(config, zero_stage=t.zero_stage)
    from trainer.backends.fsdp import FSDPBackend

    return FSDPBackend(config)


@cache
def keep_freed_memory() -> None:
    """Make glibc's malloc keep the memory a training step frees for the next step (as torch's CUDA allocator does).

    By default large allocations (over 128 KB, raised as they are freed up to 32 MB) are fresh mmaps, and freed memory
    at the top of the heap goes back to the kernel, so each update faulted its weight casts, gradients and logits in
    again, page by page: 4 of a GRPO update's 10 s on a 2-vCPU VM (``benchmarks/train_peak.py``). The process holds
    its peak memory until it exits instead.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator has its own policy
        return
    for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD):
        libc.mallopt(option, 2**31 - 1)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def train_dtype(dtype: str) -> Literal["bf16", "fp32"]:
    """``trainer.dtype`` with ``auto`` resolved for this machine (see :mod:`generators.precision`)."""
    if dtype == "auto":
        return "bf16" if auto_dtype(on_gpu=torch.cuda.is_available()) == "bfloat16" else "fp32"
    return "bf16" if dtype == "bf16" else "fp32"
