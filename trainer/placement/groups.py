"""Ray placement groups and actor options, shared by every role of a Ray run: trainer ranks, inference replicas
and env workers."""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from envkit.tracing import ENDPOINT_ENV, RUN_ENV

TRAINER_RANK = "trainer-rank-"
"""A trainer rank actor's name, before its rank."""
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 60.0


def actor_options(resources: dict[str, float], group: PlacementGroup | None = None) -> dict[str, Any]:
    """Ray ``.options()`` for an actor needing ``resources`` (``CPU``, ``GPU``, custom), in ``group`` if given."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
                               "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}}
    # The run's name (its Ray namespace) and where its traces go: the actor passes them on to those it makes
    passed = {name: os.environ[name] for name in (RUN_ENV, ENDPOINT_ENV) if os.environ.get(name)}
    if passed:
        options["runtime_env"] = {"env_vars": passed}
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group)
    return options


def ready_group(resources: dict[str, float], count: int, role: str) -> PlacementGroup:
    """A placement group of ``count`` bundles of ``resources``, packed onto as few nodes as fit; waits for it."""
    group = placement_group([dict(resources)] * count, strategy="PACK", name=role)
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"the cluster cannot place {count} × {resources} for the {role} within "
                           f"{READY_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})") from None
    return group
