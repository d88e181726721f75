"""Env workers as Ray actors, behind the Env interface.

    EnvWorker      hosts the envs of many rollouts; WorkerEnv is the Env whose calls go to one
    EnvWorkerPool  picks the least-loaded worker per rollout and replaces a worker that died; the rollouts that were
                   on it fail (recorded on their trajectories, dropped from the batch and counted) and the step goes on.
                   A replacement no live node can host within :data:`PLACE_TIMEOUT_S` (its node died, and its
                   resources pin it there) ends the step with :class:`PartLost`, naming it and its node
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import pickle
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group

from envkit import AgentClient, AgentEnv, Env, Message, Snapshot, StepResult, Task, Tool, tracing
from envkit.ref import EnvRef
from envkit.remote import SNAPSHOT_KEY_ENV
from envkit.rewards.rubrics import Score
from generators.engines.base import published
from generators.nodes import node_name
from generators.rollout import PartLost
from sandboxes.base import snapshot_key
from trainer.placement.groups import SHUTDOWN_TIMEOUT_S, actor_options, ready_group

log = logging.getLogger(__name__)
T = TypeVar("T")

PLACE_TIMEOUT_S = 30.0
"""How long a rollout waits for its env worker to be placed and started (a few seconds when a node has room)."""


def _portable(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """An env call whose error always reaches the caller: one that does not pickle (a WebSocket client's, say) would
    arrive as Ray's ``UnserializableException`` with its message lost, so it is re-raised as a RuntimeError naming
    its type and message. It runs in its caller's trace (:func:`envkit.tracing.remote_side`)."""

    traced = tracing.remote_side(method)

    @functools.wraps(traced)
    async def call(*args: Any, **kwargs: Any) -> T:
        try:
            return await traced(*args, **kwargs)
        except Exception as e:
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:
                raise RuntimeError(f"{type(e).__name__}: {e}") from None
            raise

    return call


@ray.remote
class EnvWorker:
    """Runs the envs of many rollouts at once (each by key), in this actor's event loop; a sandboxed env's episodes
    borrow containers from this worker's own warm pool of its image."""

    def __init__(self, pool_size: int) -> None:
        self.envs: dict[int, Env] = {}
        self.pool_size = pool_size
        self.pools: dict[tuple[str, str, str], Any] = {}
        self.pools_lock = asyncio.Lock()

    @_portable
    async def open(self, key: int, ref: EnvRef, published: dict[str, str]) -> bool:
        """Make and init the env of rollout ``key``, where what the driver ``published`` (the policy's and the
        judge's endpoints, its sandboxes' snapshot key) is known; whether it is an agent env."""
        os.environ.update(published)
        if ref.sandbox is not None:
            ref = ref.with_pool(await self._pool(ref))
        env = ref.make()
        self.envs[key] = env
        await env.init()
        return isinstance(env.unwrapped, AgentEnv)

    async def _pool(self, ref: EnvRef) -> Any:
        from sandboxes.env import open_pool_for, operator_kwargs

        key = (ref.name, ref.sandbox, json.dumps(operator_kwargs(ref.kwargs), sort_keys=True))
        async with self.pools_lock:  # one pool per image and server kwargs, however many rollouts ask at once
            if key not in self.pools:
                self.pools[key] = await open_pool_for(ref, size=self.pool_size, wait=False)
            return self.pools[key]

    @_portable
    async def reset(self, key: int, seed: int | None, task: Task | None) -> tuple[list[Message], dict, list[dict]]:
        env = self.envs[key]
        messages, info = await env.reset(seed=seed, task=task)
        return messages, info, [t.to_openai() for t in env.tools]

    @_portable
    async def step(self, key: int, action: Message) -> StepResult:
        return await self.envs[key].step(action)

    @_portable
    async def snapshot(self, key: int) -> Snapshot:
        return await self.envs[key].snapshot()

    @_portable
    async def restore(self, key: int, snapshot: Snapshot) -> None:
        await self.envs[key].restore(snapshot)

    @_portable
    async def run_agent(self, key: int, client: AgentClient) -> Any:
        """Play an agent env's episode here: its agent reaches the policy at ``client`` (the generator's gateway)."""
        return await self._agent(key).run(client)

    @_portable
    async def score(self, key: int, result: Any) -> Score:
        return await self._agent(key).score(result)

    def _agent(self, key: int) -> AgentEnv:
        agent = self.envs[key].unwrapped
        assert isinstance(agent, AgentEnv)
        return agent

    async def close(self, key: int) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            await env.close()

    def node(self) -> str:
        """The node this worker runs on."""
        return node_name()

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
        self.nodes: dict[Any, Any] = {}
        """Each worker's node, asked when it was spawned (an ObjectRef until it answers)."""
        self.placed: dict[Any, asyncio.Future[Any]] = {}
        self.lost_on: dict[str, str] = {}
        """A dead worker's name -> the node it ran on, as its replacement's error names it."""
        self.restarts = 0
        for _ in range(size):
            self._spawn()

    def _spawn(self, replacing: str | None = None) -> None:
        name = f"env-worker-{next(self.indices)}"
        worker = EnvWorker.options(name=name, **actor_options(self.resources, self.group)).remote(  # type: ignore[attr-defined]
            self.sandbox_pool_size)
        self.load[worker] = 0
        self.names[worker] = name
        self.nodes[worker] = worker.node.remote()
        if replacing is not None:
            self.lost_on[name] = self.lost_on.pop(replacing, "an unknown node")

    async def ready(self, worker: Any) -> None:
        """Wait until ``worker`` is placed and started; :class:`PartLost` if no node hosts it in time."""
        if worker not in self.placed:
            self.placed[worker] = asyncio.ensure_future(self.nodes[worker])
        name = self.names.get(worker, "an env worker")
        cause = f"; the worker it replaces died on {self.lost_on[name]}" if name in self.lost_on else ""
        try:
            async with asyncio.timeout(PLACE_TIMEOUT_S):
                await asyncio.shield(self.placed[worker])
        except TimeoutError:
            raise PartLost(f"env worker {name} was not placed within {PLACE_TIMEOUT_S:g} s: no live node offers "
                           f"{self.resources}{cause} (free: {ray.available_resources()})") from None
        except RayActorError as e:  # placed on a node that was dying (Ray had not declared it dead yet)
            raise PartLost(f"env worker {name} died before it started ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0]}){cause}") from None

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
        name = self.names.pop(worker)
        done, _ = ray.wait([self.nodes.pop(worker)], timeout=0)
        try:
            self.lost_on[name] = ray.get(done[0]) if done else "a node it never reported"
        except ray.exceptions.RayError:  # it died before it answered
            self.lost_on[name] = "a node it never reported"
        self.placed.pop(worker, None)
        log.warning("env worker %s on %s died; its open rollouts fail and a replacement starts", name,
                    self.lost_on[name])
        self.restarts += 1
        self._spawn(replacing=name)

    async def close(self) -> None:
        """Drain every worker's sandbox pools, end the workers, and remove what dead workers' pools left."""
        workers, self.load = list(self.load), {}
        # a worker that never started (no node could host it) has nothing to drain, and would never answer
        started = [w for w in workers if w in self.placed and self.placed[w].done()
                   and not self.placed[w].cancelled() and self.placed[w].exception() is None]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                await asyncio.gather(*(w.shutdown.remote() for w in started), return_exceptions=True)
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

    def __init__(self, pool: EnvWorkerPool, ref: EnvRef) -> None:
        self.pool = pool
        self.ref = ref
        self.key = next(pool.keys)
        self.worker: Any = None
        self.tools = []  # type: ignore[misc]  # the worker's env's, once reset
        self._agent: _WorkerAgent | None = None

    @property
    def unwrapped(self) -> Env:
        """Once init has run, an agent env's stand-in (its agent runs in the worker), else this env."""
        return self._agent or self

    async def init(self) -> None:
        if self.worker is None:
            self.worker = self.pool.pick()
            await self.pool.ready(self.worker)
            # the driver's snapshot key too: a sandbox's snapshot taken in one worker restores in another's
            if await self._call("open", self.key, self.ref, {**published(), SNAPSHOT_KEY_ENV: snapshot_key()}):
                self._agent = _WorkerAgent(self)

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        await self.init()
        messages, info, tools = await self._call("reset", self.key, seed, task)
        self.tools = [Tool.from_openai(t) for t in tools]  # type: ignore[misc]
        return messages, info

    async def step(self, action: Message) -> StepResult:
        return await self._call("step", self.key, action)

    async def snapshot(self) -> Snapshot:
        """The worker's env's snapshot (it crosses by Ray: it restores in another worker's env of its kind)."""
        await self.init()
        return await self._call("snapshot", self.key)

    async def restore(self, snapshot: Snapshot) -> None:
        await self.init()
        await self._call("restore", self.key, snapshot)

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
        ref = getattr(self.worker, method).remote(*args, trace=tracing.carrier())
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)  # the call goes on in the worker otherwise: an agent process would outlive its rollout
            raise
        except RayActorError as e:
            self.pool.lost(self.worker)
            raise EnvWorkerDied(f"the env worker running {self.ref.name!r} died mid-rollout ({type(e).__name__})"
                                ) from e


class _WorkerAgent(AgentEnv):
    """An agent env in an env worker, as the generator sees it: :meth:`run` plays the episode there (the agent
    reaches the gateway from the worker: on another node, ``generator.gateway_host`` must be an address it reaches),
    :meth:`score` grades and scores it there; the result crosses by Ray, so it must pickle."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__()
        self.env = env

    async def run(self, client: AgentClient) -> Any:
        return await self.env._call("run_agent", self.env.key, client)

    async def score(self, result: Any) -> Score:
        return await self.env._call("score", self.env.key, result)
