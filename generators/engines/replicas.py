"""N inference replicas behind one :class:`InferenceEngine`: session-sticky routing, weight sync to all, failover.

    route     every turn of a rollout goes to the replica its first turn went to (prefix-cache hits); a new rollout
              goes to the replica with the fewest requests in flight
    sync      ``load_weights`` (a checkpoint) and ``push_weights`` (tensors in memory) reach every replica before they
              return, so no request at version N is sent before all replicas serve N; a replica that fails to load
              is dropped (logged) and replaced in the background
    failover  a request to a replica that died (:class:`ReplicaDied`) is sent again to another one; the dead one is
              replaced in the background and joins once it serves the current weights

The rollout identity comes from :data:`rollout_session`, which :class:`generators.Generator` sets per rollout, so the
engine interface carries no routing argument. Replicas are any engines: Ray-hosted ones come from ``trainer.placement``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generators.engines.base import ChatCompletion, Completion, EngineError, InferenceEngine, SamplingParams

log = logging.getLogger(__name__)


class ReplicaDied(EngineError):
    """The replica is gone (its process died): the request may be sent to another replica."""


@dataclass(eq=False)
class Session:
    """One rollout's routing state: the replica its turns go to."""

    replica: Replica | None = None


rollout_session: contextvars.ContextVar[Session | None] = contextvars.ContextVar("rollout_session", default=None)
"""The current rollout's session (set by the generator; each rollout runs in its own task, so its own context)."""


@dataclass(eq=False)
class Replica:
    """One engine of the set and its counters."""

    index: int
    engine: InferenceEngine
    inflight: int = 0
    requests: int = 0


class ReplicaSet(InferenceEngine):
    """``size`` replicas made by ``spawn(index)`` (an engine, not started), serving as one engine."""

    def __init__(self, spawn: Callable[[int], Awaitable[InferenceEngine]], size: int) -> None:
        if size < 1:
            raise ValueError(f"a replica set needs at least one replica, got size={size}")
        self.spawn = spawn
        self.size = size
        self.model_name = "policy"
        self.replicas: list[Replica] = []
        self.restarts = 0
        """Replacements that joined."""
        self.lost = 0
        """Replicas removed because they died or failed to load weights."""
        self._weights: tuple[Path | dict[str, Any], int] | None = None
        """What every replica serves: a checkpoint dir or pushed tensors (kept for replacements), and its version."""
        self._next_index = 0
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def supports_token_ids(self) -> bool:  # type: ignore[override]
        return all(r.engine.supports_token_ids for r in self.replicas) if self.replicas else True

    @property
    def supports_weight_push(self) -> bool:  # type: ignore[override]
        return all(r.engine.supports_weight_push for r in self.replicas) if self.replicas else False

    @property
    def base_url(self) -> str:
        return ", ".join(r.engine.base_url for r in self.replicas)

    @property
    def chat_url(self) -> str | None:
        return self.replicas[0].engine.chat_url if self.replicas else None

    @property
    def weight_version(self) -> int:
        return self._weights[1] if self._weights else 0

    async def start(self) -> None:
        """Start every replica (in parallel); fails if any cannot start."""
        started = await asyncio.gather(*(self._start_one() for _ in range(self.size)), return_exceptions=True)
        self.replicas = [r for r in started if isinstance(r, Replica)]
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            await self.stop()
            raise EngineError(f"{len(errors)} of {self.size} inference replicas failed to start: {errors[0]}")
        self.model_name = self.replicas[0].engine.model_name

    async def _start_one(self) -> Replica:
        index, self._next_index = self._next_index, self._next_index + 1
        engine = await self.spawn(index)
        try:
            await engine.start()
        except BaseException:
            await engine.stop()
            raise
        return Replica(index, engine)

    async def stop(self) -> None:
        """Stop every replica and any replacement still starting; idempotent."""
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        replicas, self.replicas = self.replicas, []
        await asyncio.gather(*(r.engine.stop() for r in replicas), return_exceptions=True)

    # ------------------------------------------------------------------------------------------- requests

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        return await self._route(lambda engine: engine.generate(prompt_ids, sampling))

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        return await self._route(lambda engine: engine.chat(messages, sampling, tools))

    async def _route(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> Any:
        session = rollout_session.get() or Session()
        while True:
            replica = session.replica
            if replica is None or replica not in self.replicas:
                replica = session.replica = self._least_loaded()
            replica.inflight += 1
            replica.requests += 1
            try:
                return await call(replica.engine)
            except ReplicaDied as e:
                self._lose(replica, f"died under a request ({e})")
            finally:
                replica.inflight -= 1

    def _least_loaded(self) -> Replica:
        if not self.replicas:
            raise EngineError("no inference replica is left (all died; replacements are still starting)")
        return min(self.replicas, key=lambda r: (r.inflight, r.requests))

    def _lose(self, replica: Replica, why: str) -> None:
        """Take ``replica`` out of rotation and start its replacement in the background."""
        if replica not in self.replicas:
            return
        self.replicas.remove(replica)
        self.lost += 1
        log.warning("inference replica %d %s: removed; %d left, a replacement is starting", replica.index, why,
                    len(self.replicas))
        task = asyncio.create_task(self._replace(replica))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _replace(self, old: Replica) -> None:
        await old.engine.stop()
        try:
            replica = await self._start_one()
            async with self._lock:  # joins serving the current weights, never an older version
                if self._weights is not None:
                    await _apply(replica.engine, *self._weights)
                self.replicas.append(replica)
        except Exception as e:
            log.error("a replacement for inference replica %d failed to start: %s: %s", old.index,
                      type(e).__name__, e)
            return
        self.restarts += 1
        log.warning("inference replica %d replaces replica %d (weights v%d)", replica.index, old.index,
                    self.weight_version)

    # ------------------------------------------------------------------------------------------- weights

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Every replica in rotation serves the checkpoint in ``path`` as ``version`` when this returns; one that
        fails to load is replaced."""
        await self._sync(Path(path), version)

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Every replica in rotation serves ``tensors`` as ``version`` when this returns, sent from memory; one that
        fails to take them is replaced (and the replacement gets them too)."""
        await self._sync(tensors, version)

    async def _sync(self, weights: Path | dict[str, Any], version: int) -> None:
        async with self._lock:
            replicas = list(self.replicas)
            results = await asyncio.gather(*(_apply(r.engine, weights, version) for r in replicas),
                                           return_exceptions=True)
            self._weights = (weights, version)
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                self._lose(replica, f"failed to load weights v{version} ({type(result).__name__}: {result})")
        if not self.replicas:
            raise EngineError(f"no inference replica could load weights v{version}")

    def metrics(self) -> dict[str, float]:
        """Load and health, for the run's metrics."""
        values: dict[str, float] = {"inference/replicas": len(self.replicas), "inference/replica_restarts":
                                    self.restarts, "inference/replicas_lost": self.lost}
        for r in self.replicas:
            values[f"inference/replica{r.index}/requests"] = r.requests
        return values


async def _apply(engine: InferenceEngine, weights: Path | dict[str, Any], version: int) -> None:
    """Have ``engine`` serve ``weights``: a checkpoint dir it loads, or tensors pushed to it."""
    if isinstance(weights, Path):
        await engine.load_weights(weights, version)
    else:
        await engine.push_weights(weights, version)
