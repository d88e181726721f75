"""Train on two envs at once: every step splits its prompts 3:1 between one-digit sums and two-digit sums and
differences, and logs reward, pass rate and stop reasons per env (`env/<label>/...`, `eval/<label>/...`).

    python examples/train_mixture.py [trainer overrides ...]

Each mixture entry takes everything a single env does (kwargs, sandbox, task source, a URL as its name).
"""

from __future__ import annotations

import json
import sys

import trainer

MIXTURE = ("env.mixture=["
           "{name: arithmetic, label: sums, weight: 3, kwargs: {level: 1}},"
           "{name: arithmetic, label: two_digit, weight: 1, kwargs: {level: 2}}]")

if __name__ == "__main__":
    results = trainer.run([MIXTURE, *sys.argv[1:]])
    print(json.dumps(results, indent=2))
