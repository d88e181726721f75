"""Rank 0's side of the Ray placement: a :class:`ReplicaSet` of inference replicas (trainer/placement/
engine_actors.py) and a pool of env workers (trainer/placement/env_workers.py), as actors behind the local
interfaces.

Actors created here are owned by rank 0's actor, so Ray ends them when it ends, however it ends; a managed server's
watchdog ends the server with its actor.
"""

from __future__ import annotations

from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from envkit import Env
from envkit.ref import EnvRef
from generators.engines.base import InferenceEngine
from generators.engines.replicas import ReplicaSet
from generators.nodes import node_name
from trainer.config import Config
from trainer.placement.base import Placement
from trainer.placement.engine_actors import ActorEngine, EngineActor, WeightStage
from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv
from trainer.placement.groups import TRAINER_RANK, actor_options, ready_group


class RayPlacement(Placement):
    """Rank 0's placement on a Ray cluster: for each engine it asks for (one, or a run with seats' one per policy
    and frozen checkpoint), a :class:`ReplicaSet` of :class:`EngineActor` replicas in a placement group of its own;
    and, with ``env_workers``, an :class:`EnvWorkerPool`."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        p = cfg.placement
        self.engines: dict[str, ReplicaSet] = {}
        """Each engine's replicas, by the prefix of their actors' names: ``replica-N`` for the first engine,
        ``NAME-replica-N`` for a further one, NAME its output dir's."""
        self.groups: list[PlacementGroup] = []
        # each worker's pool holds its share of the rollouts in flight
        share = max(1, -(-super().sandbox_pool_size() // max(p.env_workers, 1)))
        self.workers = EnvWorkerPool(p.env_workers, p.env_worker_resources,
                                     sandbox_pool_size=share) if p.env_workers else None

    def engine(self, model_path: str | Path, out: Path, *, max_loras: int = 0, max_lora_rank: int = 0
               ) -> InferenceEngine:
        if max_loras:
            raise ValueError("LoRA adapters are served by placement.backend=local's engine only")
        if self.cfg.inference.url:  # a server already running: rank 0 attaches to it as a local run does
            return super().engine(model_path, out)
        p = self.cfg.placement
        prefix = f"{Path(out).name}-" if self.engines else ""
        group = ready_group(p.replica_resources, p.inference_replicas, f"{prefix}inference replicas")
        self.groups.append(group)
        # replicas share the nodes with each other and the trainer ranks
        inference, stage = self.inference(beside_trainer=True), WeightStage()

        async def spawn(index: int) -> InferenceEngine:
            name = f"{prefix}replica-{index}"
            actor = EngineActor.options(name=name, **actor_options(p.replica_resources, group)).remote(  # type: ignore[attr-defined]
                inference, self.cfg.weight_sync, str(model_path), str(out / name))
            return ActorEngine(actor, name, stage)

        self.engines[prefix] = ReplicaSet(spawn, p.inference_replicas)
        return self.engines[prefix]

    def sandbox_pool_size(self) -> int:
        return super().sandbox_pool_size() if self.workers is None else 0

    def make_env(self, ref: EnvRef) -> Env:
        if self.workers is None:
            return super().make_env(ref)
        if ref.sandbox is not None:  # the worker borrows from a pool of its own
            self.workers.sandboxed = True
        return WorkerEnv(self.workers, ref.with_pool(None))

    def metrics(self) -> dict[str, float]:
        values = {key.replace("inference/", f"inference/{prefix}", 1): value
                  for prefix, replicas in self.engines.items() for key, value in replicas.metrics().items()}
        if self.workers is not None:
            values.update({"envs/workers": len(self.workers.load), "envs/worker_restarts": self.workers.restarts})
        return values

    def nodes(self) -> dict[str, str]:
        """The node of rank 0 (this actor) and of every actor it placed: replicas, env workers, reward models. (The
        other ranks, busy training, cannot answer: the driver logs theirs when it starts them.)"""
        where = {ray.get_runtime_context().get_actor_name() or f"{TRAINER_RANK}0": node_name()}
        for name in sorted(ray.util.list_named_actors()):  # this run's namespace
            if name.startswith(TRAINER_RANK):
                continue
            try:
                where[name] = ray.get(ray.get_actor(name).node.remote(), timeout=60)
            except (ValueError, ray.exceptions.RayError) as e:  # it died since it was listed
                where[name] = f"gone ({type(e).__name__})"
        return where

    async def close(self) -> None:
        if self.workers is not None:
            await self.workers.close()
            self.workers = None
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
