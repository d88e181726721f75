"""Train on `arithmetic` running in Docker containers: a warm pool holds one container per concurrent rollout.

    python examples/train_sandboxed.py [trainer overrides ...]

Needs a Docker engine (`make docker-up` installs and starts one); the env's image is built on first use
(`envkit build arithmetic`). The pool starts once per run, replaces containers that die (their rollouts fail
alone and are dropped) and is drained at the end.
"""

from __future__ import annotations

import json
import sys

import trainer

if __name__ == "__main__":
    results = trainer.run(["env.name=arithmetic", "env.sandbox=docker", *sys.argv[1:]])
    print(json.dumps(results, indent=2))
