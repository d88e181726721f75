"""Rubrics named by ``module:attr`` (``env.kwargs.rubric``), for processes that import them by name: Ray env workers."""

from __future__ import annotations

import os

from envkit.rewards.judges import JUDGE_URL_VAR, RelativeJudge
from envkit.rewards.rubrics import Check, EnvReward, WeightedSum
from generators.reward_model import RewardModel

REWARD_MODEL = RewardModel("bundled", batch_size=16, max_wait_s=0.5)
"""The bundled reward head; on a Ray cluster, one actor for every process (rows gathered for 0.5 s a batch)."""

JUDGE_SEEN = "http://judge.invalid/v1"
"""What a test publishes as the run's judge: :data:`reward_model`'s ``published`` part checks the env saw it."""

reward_model = WeightedSum({EnvReward(): 0.5, REWARD_MODEL: 0.5,
                            Check(lambda episode: float(os.environ.get(JUDGE_URL_VAR) == JUDGE_SEEN),
                                  name="published"): 0.0})

graded = WeightedSum({EnvReward(): 0.5, REWARD_MODEL: 0.5})
"""The env's own grade and the bundled reward head's score, half each."""

relative = RelativeJudge("The reply gives the correct sum.", constrain="regex", env_weight=0.5)
"""A relative judge over each group, on the run's judge: half of each rollout's reward, the env's the other half."""

on_worker1 = WeightedSum({EnvReward(): 0.5, RewardModel("bundled", batch_size=16, max_wait_s=0.5,
                                                        resources={"worker1": 1}): 0.5})
""":data:`graded` with the reward head's actor on a container cluster's node ``worker1``
(trainer/container_cluster.py)."""
