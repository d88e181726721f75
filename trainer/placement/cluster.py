"""Launch a stage's ranks on a Ray cluster: ``placement.trainer_ranks`` actors, one process group.

    driver (python -m trainer placement.backend=ray)
      ├── joins placement.address, or starts a one-machine cluster for this run
      ├── TrainerRank × N (one placement group)   each runs the stage (trainer/stages.py) with RANK/WORLD_SIZE/MASTER_*
      │     └── rank 0 owns: EngineActor × replicas, EnvWorker × workers   (ray_placement.py)
      └── waits; the first rank that fails or dies ends the run, and every actor goes with it

Checkpoints are written atomically by the ranks, so a run that died resumes with ``trainer.resume=latest``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from generators.nodes import node_name
from trainer.config import Config
from trainer.placement.base import RunFailed
from trainer.placement.groups import RUN_ENV, TRAINER_RANK, actor_options, ready_group

log = logging.getLogger(__name__)


@ray.remote
class TrainerRank:
    """One FSDP/DeepSpeed rank: the whole stage, as torchrun would run it."""

    def node(self) -> str:
        """The node this rank runs on."""
        return node_name()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's store (rank 0 hosts it)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def train(self, cfg: Config, rank: int, world_size: int, master: tuple[str, int], cwd: str,
              run: Callable[..., dict[str, Any]], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Run ``run(cfg, **kwargs)`` (a stage) as rank ``rank`` of ``world_size``."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        for client in ("httpx", "httpx2"):  # a line a request at INFO, as in trainer/conf/config.yaml's job_logging
            logging.getLogger(client).setLevel(logging.WARNING)
        if os.path.isdir(cwd):  # relative paths in the config mean what they meant to the user
            os.chdir(cwd)
        # Ray gives each GPU actor only its own GPU (CUDA_VISIBLE_DEVICES), so it is device 0 here.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        import torch

        torch.set_num_threads(cfg.placement.trainer_threads or max(1, (os.cpu_count() or 1) // world_size))
        return run(cfg, **kwargs)


def launch_on_ray(cfg: Config, run: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """Run ``run(cfg, **kwargs)`` (a stage) on the cluster's trainer ranks; returns rank 0's results. Raises
    :class:`RunFailed` if a rank fails."""
    p = cfg.placement
    cfg = replace(cfg, trainer=replace(cfg.trainer, output_dir=str(Path(cfg.trainer.output_dir).resolve())))
    _build_images(cfg)
    started_here = not ray.is_initialized()
    if started_here:
        os.environ[RUN_ENV] = f"envkit-{os.getpid()}"
        if p.address:  # a cluster's own settings stand; through Ray Client (ray://) there is no other kind
            _join(p.address, os.environ[RUN_ENV])
        else:
            ray.init(num_cpus=p.cluster_cpus or _cpus_needed(cfg), namespace=os.environ[RUN_ENV],
                     include_dashboard=False, log_to_driver=True)
    group, ranks = None, []
    try:
        group = ready_group(p.trainer_resources, p.trainer_ranks, "trainer ranks")
        ranks = [TrainerRank.options(name=f"{TRAINER_RANK}{i}", **actor_options(p.trainer_resources, group)).remote()  # type: ignore[attr-defined]
                 for i in range(p.trainer_ranks)]
        for i, node in enumerate(ray.get([r.node.remote() for r in ranks])):
            log.info("%s%d on %s", TRAINER_RANK, i, node)
        master = ray.get(ranks[0].rendezvous.remote())
        runs = [r.train.remote(cfg, i, p.trainer_ranks, master, os.getcwd(), run, kwargs) for i, r in enumerate(ranks)]
        pending = list(runs)
        while pending:  # the first failure ends the run: the other ranks would wait on it forever
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                how = "died" if isinstance(e, ray.exceptions.RayActorError) else "failed"
                raise RunFailed(f"trainer rank {runs.index(done[0])} {how}: {_summary(e)}\nCheckpoints under "
                                f"{cfg.trainer.output_dir}/checkpoints are intact: rerun with trainer.resume=latest "
                                "to continue") from e
        return ray.get(runs[0])
    finally:
        for rank_actor in ranks:
            ray.kill(rank_actor)
        if group is not None:
            remove_placement_group(group)
        if started_here:
            ray.shutdown()


def _join(address: str, namespace: str, attempts: int = 3) -> None:
    """Connect to the cluster at ``address``. A Ray Client head sometimes fails to start a new client's server
    (seen on a container cluster under load: "Starting Ray client server failed"); a second try gets one."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=True)
            return
        except ConnectionError as e:  # ConnectionAbortedError included
            if attempt == attempts or not address.startswith("ray://"):
                raise
            log.warning("joining %s failed (%s); trying again in 5 s", address, str(e).strip().splitlines()[-1])
            ray.shutdown()
            time.sleep(5)


def _build_images(cfg: Config) -> None:
    """Build the run's Docker env images here first, where this driver reaches a Docker engine: the nodes of a
    container cluster (trainer/container_cluster.py) share it, and have no package index to build from. Elsewhere
    each node builds its own when its first env worker needs it."""
    sandboxed = [env.name for env in cfg.env.members if env.sandbox in ("docker", "auto")]
    if not sandboxed:
        return
    from sandboxes.engine import engine_reachable
    from sandboxes.images import build

    if engine_reachable():
        for name in sandboxed:
            build(name)


def _cpus_needed(cfg: Config) -> int:
    """Logical CPUs a one-machine cluster needs to place every actor of the run (a replacement takes the bundle
    its dead predecessor freed)."""
    p = cfg.placement
    total = (p.trainer_ranks * p.trainer_resources.get("CPU", 0)
             + cfg.engines * p.inference_replicas * p.replica_resources.get("CPU", 0)
             + p.env_workers * p.env_worker_resources.get("CPU", 0))
    return max(int(total + 0.999), os.cpu_count() or 1)


def _summary(error: BaseException) -> str:
    """The original error's type and the last line of its message (a rank's traceback is in the log above)."""
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
