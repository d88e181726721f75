"""Rank 0's side of the Ray placement: inference replicas and env workers as actors, behind the local interfaces.

    EngineActor    hosts one engine (a managed vLLM/SGLang server, or HF in-process) on its node
    ActorEngine    an InferenceEngine whose calls go to an EngineActor; a dead actor raises ReplicaDied, so the
                   ReplicaSet (generators/engines/replicas.py) sends the request elsewhere and replaces the replica
    WeightStage    pushed weights, put in the object store once for all replicas
    EnvWorker      hosts the envs of many rollouts; WorkerEnv is the Env whose calls go to one
    EnvWorkerPool  picks the least-loaded worker per rollout and replaces a worker that died; the rollouts that were
                   on it fail (recorded on their trajectories, dropped from the batch and counted) and the step goes on

Actors created here are owned by rank 0's actor, so Ray ends them when it ends, however it ends; a managed server's
watchdog ends the server with its actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import envkit
from envkit import Env, Message, StepResult, Task, Tool
from generators.engines.base import ChatCompletion, Completion, InferenceEngine, SamplingParams
from generators.engines.factory import EngineConfig, make_engine
from generators.engines.replicas import ReplicaDied, ReplicaSet
from trainer.config import Config
from trainer.placement.base import Placement

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 60.0


def actor_options(resources: dict[str, float], group: PlacementGroup | None = None) -> dict[str, Any]:
    """Ray ``.options()`` for an actor needing ``resources`` (``CPU``, ``GPU``, custom), in ``group`` if given."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
                               "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}}
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


# ------------------------------------------------------------------------------------------ inference replicas


@ray.remote
class EngineActor:
    """One inference replica: the engine ``config`` names, started on this actor's node."""

    def __init__(self, config: EngineConfig, model: str, log_dir: str) -> None:
        self.engine = make_engine(config, model, log_dir=Path(log_dir))
        self.inflight = 0

    async def start(self) -> tuple[str, bool, bool]:
        await self.engine.start()
        return self.engine.model_name, self.engine.supports_token_ids, self.engine.supports_weight_push

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        self.inflight += 1
        try:
            return await self.engine.generate(prompt_ids, sampling)
        finally:
            self.inflight -= 1

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None) -> ChatCompletion:
        self.inflight += 1
        try:
            return await self.engine.chat(messages, sampling, tools)
        finally:
            self.inflight -= 1

    async def load_weights(self, path: str, version: int) -> None:
        await self.engine.load_weights(path, version)

    async def push_weights(self, packed: dict[str, Packed], version: int) -> None:
        await self.engine.push_weights(unpack(packed), version)

    async def stop(self) -> None:
        await self.engine.stop()

    def requests_in_flight(self) -> int:
        """Requests being served now (what a test waits for before it kills a replica mid-step)."""
        return self.inflight


Packed = tuple[str, tuple[int, ...], np.ndarray]
"""A tensor as its dtype's name, its shape and its bytes."""


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, Packed]:
    """Each tensor's bytes as a numpy array: Ray's object store takes numpy arrays with one copy and hands them out
    with none, where it pickles torch tensors (0.05 s against 0.9 s for the bundled model's 540 MB here)."""
    return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape),
                   t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in tensors.items()}


def unpack(packed: dict[str, Packed]) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack` packed, as read-only views of the object store's memory (engines copy them in)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
                for name, (dtype, shape, data) in packed.items()}


class WeightStage:
    """The newest pushed weights, packed into Ray's object store once: every replica (and a replacement joining
    later) reads that one copy instead of each call serializing its own."""

    def __init__(self) -> None:
        self._staged: tuple[dict[str, torch.Tensor], ray.ObjectRef] | None = None

    def ref(self, tensors: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """The object holding ``tensors`` (put now if they are not the last ones staged; the older copy is freed)."""
        if self._staged is None or self._staged[0] is not tensors:
            self._staged = None
            self._staged = (tensors, ray.put(pack(tensors)))
        return self._staged[1]


class ActorEngine(InferenceEngine):
    """An engine living in an :class:`EngineActor`; pushed weights travel through ``stage``."""

    def __init__(self, actor: Any, name: str, stage: WeightStage) -> None:
        self.actor = actor
        self.name = name
        self.stage = stage
        self.model_name = "policy"
        self.supports_token_ids = True
        self.supports_weight_push = False
        self._version = 0

    @property
    def base_url(self) -> str:
        return f"ray://{self.name}"

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        self.model_name, self.supports_token_ids, self.supports_weight_push = await self._call("start")

    async def stop(self) -> None:
        with contextlib.suppress(ReplicaDied):  # a dead replica has nothing left to stop
            await self._call("stop")
        ray.kill(self.actor)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        return await self._call("generate", prompt_ids, sampling)

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        return await self._call("chat", messages, sampling, tools)

    async def load_weights(self, path: str | Path, version: int) -> None:
        await self._call("load_weights", str(path), version)
        self._version = version

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        await self._call("push_weights", self.stage.ref(tensors), version)
        self._version = version

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError as e:
            raise ReplicaDied(f"inference replica {self.name} died: {type(e).__name__}") from e


# ------------------------------------------------------------------------------------------------ env workers


@ray.remote
class EnvWorker:
    """Runs the envs of many rollouts at once (each by key), in this actor's event loop; a sandboxed env's episodes
    borrow containers from this worker's own warm pool of its image."""

    def __init__(self, pool_size: int) -> None:
        self.envs: dict[int, Env] = {}
        self.pool_size = pool_size
        self.pools: dict[tuple[str, str, str], Any] = {}
        self.pools_lock = asyncio.Lock()

    async def open(self, key: int, name: str, kwargs: dict[str, Any]) -> None:
        if "sandbox" in kwargs:
            kwargs = {**kwargs, "sandbox_options": {"pool": await self._pool(name, kwargs)}}
        env = envkit.make(name, **kwargs)
        self.envs[key] = env
        await env.init()

    async def _pool(self, name: str, kwargs: dict[str, Any]) -> Any:
        from sandboxes.env import open_pool, operator_kwargs

        served = operator_kwargs(kwargs)
        key = (name, kwargs["sandbox"], json.dumps(served, sort_keys=True))
        async with self.pools_lock:  # one pool per image and server kwargs, however many rollouts ask at once
            if key not in self.pools:
                self.pools[key] = await open_pool(name, kwargs["sandbox"], size=self.pool_size, wait=False,
                                                  server_kwargs=served)
            return self.pools[key]

    async def reset(self, key: int, seed: int | None, task: Task | None) -> tuple[list[Message], dict, list[dict]]:
        env = self.envs[key]
        messages, info = await env.reset(seed=seed, task=task)
        return messages, info, [t.to_openai() for t in env.tools]

    async def step(self, key: int, action: Message) -> StepResult:
        return await self.envs[key].step(action)

    async def close(self, key: int) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            await env.close()

    def episodes(self) -> int:
        """Envs open now (what a test waits for before it kills a worker mid-step)."""
        return len(self.envs)

    async def shutdown(self) -> None:
        """Close every env and drain the sandbox pools (their containers are removed)."""
        await asyncio.gather(*(env.close() for env in self.envs.values()), return_exceptions=True)
        self.envs.clear()
        await asyncio.gather(*(pool.close() for pool in self.pools.values()), return_exceptions=True)
        self.pools.clear()


class EnvWorkerPool:
    """``size`` env workers; each rollout's env goes to the worker with the fewest open envs. A worker that died
    leaves its containers behind: the next sandbox any process on that Docker engine starts removes them
    (:func:`sandboxes.docker.reap_orphans`), and so does closing the pool."""

    def __init__(self, size: int, resources: dict[str, float], *, sandbox_pool_size: int) -> None:
        self.group = ready_group(resources, size, "env workers")
        self.resources = resources
        self.sandbox_pool_size = sandbox_pool_size
        self.sandboxed = False
        """Whether any env went to a sandbox (then closing reaps what dead workers left)."""
        self.keys = itertools.count()
        self.indices = itertools.count()
        self.load: dict[Any, int] = {}
        self.names: dict[Any, str] = {}
        self.restarts = 0
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        name = f"env-worker-{next(self.indices)}"
        worker = EnvWorker.options(name=name, **actor_options(self.resources, self.group)).remote(  # type: ignore[attr-defined]
            self.sandbox_pool_size)
        self.load[worker] = 0
        self.names[worker] = name

    def pick(self) -> Any:
        """The least-loaded live worker, counted as holding one more env."""
        worker = min(self.load, key=self.load.__getitem__)
        self.load[worker] += 1
        return worker

    def release(self, worker: Any) -> None:
        """One env of ``worker`` is closed."""
        if worker in self.load:
            self.load[worker] -= 1

    def lost(self, worker: Any) -> None:
        """``worker`` died: replace it (its rollouts have failed)."""
        if self.load.pop(worker, None) is None:
            return
        log.warning("env worker %s died; its open rollouts fail and a replacement starts", self.names.pop(worker))
        self.restarts += 1
        self._spawn()

    async def close(self) -> None:
        """Drain every worker's sandbox pools, end the workers, and remove what dead workers' pools left."""
        workers, self.load = list(self.load), {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                await asyncio.gather(*(w.shutdown.remote() for w in workers), return_exceptions=True)
        for worker in workers:
            ray.kill(worker)
        remove_placement_group(self.group)
        if self.sandboxed:
            from sandboxes.docker import connect, reap_orphans

            await asyncio.to_thread(reap_orphans, connect())


class EnvWorkerDied(RuntimeError):
    """The env worker running this rollout's env died; the rollout fails, the step goes on."""


class WorkerEnv(Env):
    """An env made and run in an env worker; its messages and step results cross by Ray calls."""

    def __init__(self, pool: EnvWorkerPool, name: str, kwargs: dict[str, Any]) -> None:
        self.pool = pool
        self.name = name
        self.kwargs = kwargs
        self.key = next(pool.keys)
        self.worker: Any = None
        self.tools = []  # type: ignore[misc]  # the worker's env's, once reset

    async def init(self) -> None:
        if self.worker is None:
            self.worker = self.pool.pick()
            await self._call("open", self.key, self.name, self.kwargs)

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        await self.init()
        messages, info, tools = await self._call("reset", self.key, seed, task)
        self.tools = [Tool.from_openai(t) for t in tools]  # type: ignore[misc]
        return messages, info

    async def step(self, action: Message) -> StepResult:
        return await self._call("step", self.key, action)

    async def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is None:
            return
        try:
            await worker.close.remote(self.key)
        except RayActorError:
            pass  # the worker died: nothing of this env is left to close
        finally:
            self.pool.release(worker)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.worker, method).remote(*args)
        except RayActorError as e:
            self.pool.lost(self.worker)
            raise EnvWorkerDied(f"the env worker running {self.name!r} died mid-rollout ({type(e).__name__})") from e


# ---------------------------------------------------------------------------------------------- the placement


class RayPlacement(Placement):
    """Rank 0's placement on a Ray cluster: a :class:`ReplicaSet` of :class:`EngineActor` replicas and, with
    ``env_workers``, an :class:`EnvWorkerPool`."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        p = cfg.placement
        self.replicas: ReplicaSet | None = None
        self.group: PlacementGroup | None = None
        # each worker's pool holds its share of the rollouts in flight
        share = max(1, -(-super().sandbox_pool_size() // max(p.env_workers, 1)))
        self.workers = EnvWorkerPool(p.env_workers, p.env_worker_resources,
                                     sandbox_pool_size=share) if p.env_workers else None

    def engine(self, model_path: str | Path, out: Path) -> InferenceEngine:
        p = self.cfg.placement
        self.group = ready_group(p.replica_resources, p.inference_replicas, "inference replicas")
        # replicas share the nodes with each other and the trainer ranks
        group, inference, stage = self.group, self.inference(beside_trainer=True), WeightStage()

        async def spawn(index: int) -> InferenceEngine:
            name = f"replica-{index}"
            actor = EngineActor.options(name=name, **actor_options(p.replica_resources, group)).remote(  # type: ignore[attr-defined]
                inference, str(model_path), str(out / name))
            return ActorEngine(actor, name, stage)

        self.replicas = ReplicaSet(spawn, p.inference_replicas)
        return self.replicas

    def sandbox_pool_size(self) -> int:
        return super().sandbox_pool_size() if self.workers is None else 0

    def make_env(self, name: str, **kwargs: Any) -> Env:
        if self.workers is None:
            return super().make_env(name, **kwargs)
        if "sandbox" in kwargs:  # the worker borrows from a pool of its own
            kwargs.pop("sandbox_options", None)
            self.workers.sandboxed = True
        return WorkerEnv(self.workers, name, kwargs)

    def metrics(self) -> dict[str, float]:
        values = self.replicas.metrics() if self.replicas is not None else {}
        if self.workers is not None:
            values.update({"envs/workers": len(self.workers.load), "envs/worker_restarts": self.workers.restarts})
        return values

    async def close(self) -> None:
        if self.workers is not None:
            await self.workers.close()
            self.workers = None
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
