"""Synthetic GRPO rollouts for the trainer's benchmarks: no inference engine, the same batch every run."""

from __future__ import annotations

import random

from generators.trajectory import Trajectory


def grpo_rollouts(n: int, group: int = 8, seed: int = 0) -> list[Trajectory]:
    """``n`` rollouts in groups of ``group`` sharing a prompt of 40-80 tokens, each with a response of 16-48 tokens
    and a reward that differs within its group (so every update has a gradient)."""
    rng = random.Random(seed)
    trajs = []
    for g in range(n // group):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 80))]
        for k in range(group):
            response = [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 48))]
            trajs.append(Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                                    rollout_logprobs=[-1.0] * len(response), reward=float(k % 2),
                                    group_id=f"g{g}", sample_index=k))
    return trajs
