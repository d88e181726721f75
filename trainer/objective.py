"""What the RL loop's update follows, token by token: the seam a stage that trains on rollouts plugs into.

    Objective           RL (``stages=[rl]``): each token's advantage is its rollout's, from the env's reward
    DistillObjective    ``stages=[distill]`` (trainer/distill.py): a teacher's per-token signal mixed in

The loop (trainer/loop.py) calls ``score`` once a step on every rank, before the update, and ``token_advantages`` for
each micro-batch inside it; it never asks which objective it has.
"""

from __future__ import annotations

import torch

from trainer.backends.base import Batch
from trainer.batching import StepBatch


class Objective:
    """The env's reward alone: the advantages ``prepare_batch`` computed, each token of a rollout at its rollout's."""

    stage = "rl"
    """The stage's name in the run's logs and report."""
    keeps_flat_groups = False
    """Whether groups whose rewards are all equal are trained on: they carry no reward signal, so RL drops them."""

    def score(self, batch: StepBatch) -> dict[str, float]:
        """Score ``batch`` before its update (on every rank: a collective where rank 0 alone computes); the step's
        metrics of it, the time it took as a ``time/...`` key (the loop leaves it out of ``time/train_s``)."""
        return {}

    def token_advantages(self, advantages: torch.Tensor, rows: list[int], mb: Batch
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token advantages (B, T) of micro-batch ``mb`` (``rows`` of the scored batch) the policy loss
        follows, from the env's ``advantages`` (B, T); and diagnostics to average over the mini-batch."""
        return advantages, {}
