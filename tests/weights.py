"""Checkpoints in tests: did a training run move the weights, and a policy that differs from the bundled one."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def changed_tensors(a: Path, b: Path) -> int:
    """How many tensors differ between two HF safetensors checkpoints of one architecture."""
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(b / "model.safetensors", "pt") as fb:
        return sum(not fa.get_tensor(k).equal(fb.get_tensor(k)) for k in fa.keys())  # noqa: SIM118


def nonfinite_tensors(src: Path) -> list[str]:
    """Names of the tensors of the HF checkpoint in ``src`` that hold a NaN or an infinity."""
    return [name for name, t in model_tensors(src).items() if not torch.isfinite(t).all()]


def model_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint in ``src``."""
    return {name: t for f in sorted(src.glob("*.safetensors")) for name, t in load_file(f).items()}


def perturbed_weights(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model moved by seeded noise, and the final norm negated (greedy output must change)."""
    noise = torch.Generator().manual_seed(0)
    moved = {name: t + 0.01 * torch.randn(t.shape, generator=noise, dtype=t.dtype)
             for name, t in model_tensors(src).items()}
    moved["model.norm.weight"] = -moved["model.norm.weight"]
    return moved
