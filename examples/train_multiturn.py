"""Train on a multi-turn env: guess a number from "Higher."/"Lower." hints, up to 4 guesses per episode.

    python examples/train_multiturn.py [trainer overrides ...]

Env turns are masked out of the loss (their tokens come from the chat template, never re-tokenized); each turn's
reward is kept (`Trajectory.step_rewards`), so `algorithm=ppo` credits it to that turn's last model token while the
GRPO family trains on the episode's total.
"""

from __future__ import annotations

import json
import sys

import trainer

if __name__ == "__main__":
    results = trainer.run(["env=guess_number", "env.kwargs.high=8", "env.kwargs.max_turns=4",
                           "generator.max_turns=4", *sys.argv[1:]])
    print(json.dumps(results, indent=2))
