"""Comparing exported checkpoints: did a training run move the weights?"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def changed_tensors(a: Path, b: Path) -> int:
    """How many tensors differ between two HF safetensors checkpoints of one architecture."""
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(b / "model.safetensors", "pt") as fb:
        return sum(not fa.get_tensor(k).equal(fb.get_tensor(k)) for k in fa.keys())  # noqa: SIM118
