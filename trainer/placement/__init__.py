"""Where a run's processes live, behind one interface the loop uses the same way for both backends.

    local   everything in this process: one inference engine, envs in rank 0's event loop (torchrun adds ranks)
    ray     trainer ranks, inference replicas and env workers as actors of a Ray cluster (trainer/placement/cluster.py
            launches the ranks, ray_placement.py holds rank 0's side: engine_actors.py, env_workers.py)

Rank 0 asks its :class:`Placement` for the engine it generates with, how a rollout's env is made, and per-step health
metrics (trainer/placement/base.py); :func:`launch_stage` runs each stage's ranks here or on the cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import Config
from trainer.placement.base import Placement, RunFailed

__all__ = ["Placement", "RunFailed", "launch_stage", "make_placement"]


def launch_stage(cfg: Config, run: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """Rank 0's results of ``run(cfg, **kwargs)`` (a stage of trainer/stages.py) on every trainer rank: this
    process's (torchrun's ranks each run it), or ``placement.trainer_ranks`` Ray actors'."""
    if cfg.placement.backend == "ray":
        from trainer.placement.cluster import launch_on_ray

        return launch_on_ray(cfg, run, **kwargs)
    return run(cfg, **kwargs)


def make_placement(cfg: Config) -> Placement:
    """The placement ``cfg.placement.backend`` names (called on rank 0)."""
    if cfg.placement.backend == "ray":
        from trainer.placement.ray_placement import RayPlacement

        return RayPlacement(cfg)
    return Placement(cfg)
