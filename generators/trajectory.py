"""Trajectory: one rollout as training data, with JSONL I/O and padded/packed tensor views for the trainer.

Token layout (the contract between generators and trainer)::

    prompt_ids    the opening messages rendered by the chat template, with the generation prompt
    response_ids  every token after the prompt, in order: model tokens and env (observation) tokens
    loss_mask     per response token: 1 = sampled by the model, 0 = written by the env or the template
    rollout_logprobs  per response token: the sampler's logprob for model tokens, 0.0 for env tokens
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

StopReason = Literal["done", "max_turns", "max_tokens", "timeout", "error"]
STOP_REASONS: tuple[StopReason, ...] = ("done", "max_turns", "max_tokens", "timeout", "error")


@dataclass
class Trajectory:
    """One multi-turn rollout of a model in an env. ``failed`` ones (error/timeout) carry the reason, not tokens."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    step_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    stop_reason: StopReason = "done"
    truncated: bool = False
    """The env ended the episode by truncation (its own budget) rather than termination."""
    error: str | None = None
    policy_version: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    env_name: str = ""
    task_id: str | None = None
    group_id: str = ""
    """Rollouts of the same task and seed share a group id (the unit GRPO normalizes over)."""
    sample_index: int = 0
    seed: int | None = None
    template_mismatches: int = 0
    """Turns where re-rendering the chat would not reproduce the running token ids (counted, never fixed up)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent: ``generate`` (model), ``env`` (reset+step), ``total``."""

    @property
    def failed(self) -> bool:
        """True for rollouts that errored or timed out; trainers drop these."""
        return self.stop_reason in ("error", "timeout")

    @property
    def num_model_tokens(self) -> int:
        """How many response tokens the model sampled."""
        return sum(self.loss_mask)

    def check(self) -> None:
        """Raise ValueError if the per-token lists disagree in length or the mask is not 0/1."""
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"response_ids ({n}), loss_mask ({len(self.loss_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        """Rebuild from ``to_json()`` output; unknown keys are rejected so format drift is loud."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Trajectory fields: {sorted(unknown)}")
        return cls(**data)


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """Write one trajectory per line (atomically: a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json()) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    """Read trajectories written by :func:`write_jsonl`."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield Trajectory.from_json(json.loads(line))


def to_padded(trajectories: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors, each (B, T) with T the longest prompt+response.

    ``loss_mask`` and ``rollout_logprobs`` are aligned with ``input_ids`` (zero over the prompt and padding), so
    the logprob of token ``t`` comes from the logits at ``t - 1``.
    """
    import torch

    rows = [_row(t) for t in trajectories]
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask, lps) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(lps, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "rollout_logprobs": logprobs}


def to_packed(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """All sequences concatenated into one row (1, sum T) with per-sequence ``position_ids`` restarting at 0.

    No padding compute: attention implementations that honour position-id boundaries (flash/sdpa varlen in
    transformers) keep sequences apart. ``cu_seqlens`` gives the boundaries.
    """
    import torch

    rows = [_row(t) for t in trajectories]
    lengths = [len(ids) for ids, _, _ in rows]
    return {
        "input_ids": torch.tensor([[i for ids, _, _ in rows for i in ids]], dtype=torch.long),
        "position_ids": torch.tensor([[p for n in lengths for p in range(n)]], dtype=torch.long),
        "loss_mask": torch.tensor([[m for _, mask, _ in rows for m in mask]], dtype=torch.float32),
        "rollout_logprobs": torch.tensor([[lp for _, _, lps in rows for lp in lps]], dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    }


def _row(t: Trajectory) -> tuple[list[int], list[int], list[float]]:
    t.check()
    pad = [0] * len(t.prompt_ids)
    return t.prompt_ids + t.response_ids, pad + t.loss_mask, [0.0] * len(t.prompt_ids) + t.rollout_logprobs
