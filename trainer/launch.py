"""``python -m trainer``'s entry: a run's stages here, or its RL loop here or as the ranks of a Ray cluster."""

from __future__ import annotations

import os
from typing import Any

from envkit import tracing
from trainer.config import Config


def launch(cfg: Config) -> dict[str, Any]:
    """Run the training loop: in this process, or as ``placement.trainer_ranks`` actors of a Ray cluster; a run with
    an sft stage runs its stages here (trainer/stages.py). With ``logging.traces``, every process of the run
    exports its spans there (envkit/tracing.py)."""
    if cfg.logging.traces:
        os.environ[tracing.ENDPOINT_ENV] = cfg.logging.traces  # inherited by the processes the run starts
        os.environ.setdefault(tracing.RUN_ENV, f"envkit-{os.getpid()}")
    if cfg.seats:
        from trainer.multi_policy import train_policies

        return train_policies(cfg)
    if cfg.stages != ["rl"]:
        from trainer.stages import run_stages

        return run_stages(cfg)
    if cfg.placement.backend == "ray":
        from trainer.placement.cluster import launch_on_ray

        return launch_on_ray(cfg)
    from trainer.loop import train

    return train(cfg)
