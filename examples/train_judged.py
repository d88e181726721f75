"""Train on the score an LLM judge gives: the run starts a judge server of its own (``judge.model=bundled``: the
bundled model on vLLM, its weights frozen), and the arithmetic env's reward becomes that judge's score of each reply.

    python examples/train_judged.py [trainer overrides ...]

The judge reads no score out of text: it answers one digit and its score is the expected digit under its own
probabilities (``parse="logprobs"``), a graded signal where a 135M judge's sampled answer is nearly always the same.
Its reply starts with ``SCORE: `` written for it (``prefill``), so that its first token is the score. Watch
``rubric/length_corr`` beside ``reward/mean``: a small judge mostly rewards length, and the policy learns what its
judge rewards; ``rubric/env`` is the env's own grade (weight 0), what the judge does not look at.
"""

from __future__ import annotations

import json
import sys

import trainer
from envkit.rewards.judges import LLMJudge
from envkit.rewards.rubrics import EnvReward, WeightedSum

polite = LLMJudge("The reply is polite and friendly.", parse="logprobs", scale=(0, 9), prefill="SCORE: ",
                  name="polite")
"""No endpoint given: the judge the run publishes (``judge.model``)."""
rubric = WeightedSum({polite: 1.0, EnvReward(): 0.0})

if __name__ == "__main__":
    results = trainer.run(["judge.model=bundled", "+env.kwargs.rubric=train_judged:rubric", *sys.argv[1:]])
    print(json.dumps(results, indent=2))
