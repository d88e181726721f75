"""``python -m trainer``'s entry: a run's stages (trainer/stages.py), each placed here or on a Ray cluster."""

from __future__ import annotations

import os
from typing import Any

from envkit import tracing
from trainer.config import Config


def launch(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.stages`` in order, each stage's ranks in this process or as ``placement.trainer_ranks`` actors of a
    Ray cluster (trainer/placement). With ``logging.traces``, every process of the run exports its spans there
    (envkit/tracing.py)."""
    if cfg.logging.traces:
        os.environ[tracing.ENDPOINT_ENV] = cfg.logging.traces  # inherited by the processes the run starts
        os.environ.setdefault(tracing.RUN_ENV, f"envkit-{os.getpid()}")
    from trainer.stages import run_stages

    return run_stages(cfg)
