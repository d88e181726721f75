"""ReplicaSet's routing, weight sync and failover, with in-process engines that record what they served (the Ray
tests run the same set over real replica actors)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from generators.engines.base import ChatCompletion, Completion, InferenceEngine, SamplingParams
from generators.engines.replicas import ReplicaDied, ReplicaSet, Session, rollout_session


class Recorder(InferenceEngine):
    """Answers after ``delay`` s with its own index as the token; can be made to die or to fail loading."""

    def __init__(self, index: int, delay: float = 0.01) -> None:
        self.index, self.delay = index, delay
        self.model_name = "policy"
        self.dead = self.broken_loader = self.stopped = False
        self.version = 0
        self.served: Any = None
        """The checkpoint path or pushed tensors it serves."""

    @property
    def base_url(self) -> str:
        return f"memory://{self.index}"

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        await asyncio.sleep(self.delay)
        if self.dead:
            raise ReplicaDied(f"replica {self.index} is gone")
        return Completion([self.index], [0.0], "stop", self.version)

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        raise NotImplementedError

    async def load_weights(self, path: str | Path, version: int) -> None:
        if self.broken_loader:
            raise RuntimeError("cannot read the checkpoint")
        self.version, self.served = version, path

    supports_weight_push = True

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        if self.broken_loader:
            raise RuntimeError("cannot take the tensors")
        self.version, self.served = version, tensors

    async def stop(self) -> None:
        self.stopped = True


@pytest.fixture
async def replicas():
    made: list[Recorder] = []

    async def spawn(index: int) -> InferenceEngine:
        made.append(Recorder(index))
        return made[-1]

    engines = ReplicaSet(spawn, 2)
    await engines.start()
    yield engines, made
    await engines.stop()


async def _rollout(engines: ReplicaSet, turns: int) -> list[int]:
    """The replicas that served each turn of one rollout."""
    rollout_session.set(Session())
    return [(await engines.generate([1], SamplingParams())).token_ids[0] for _ in range(turns)]


async def test_turns_of_a_rollout_stay_on_one_replica_and_rollouts_spread(replicas):
    engines, _ = replicas
    served = await asyncio.gather(*(asyncio.create_task(_rollout(engines, 3)) for _ in range(8)))
    assert all(len(set(turns)) == 1 for turns in served)
    assert sorted(turns[0] for turns in served) == [0] * 4 + [1] * 4
    assert engines.metrics()["inference/replica0/requests"] == engines.metrics()["inference/replica1/requests"] == 12


async def test_a_dead_replica_s_requests_go_to_another_and_a_replacement_joins_at_the_current_weights(replicas):
    engines, made = replicas
    await engines.load_weights("/weights/v3", 3)
    made[0].dead = True
    served = await asyncio.gather(*(asyncio.create_task(_rollout(engines, 2)) for _ in range(4)))
    assert all(0 not in turns and len(set(turns)) == 1 for turns in served)  # failed over, then sticky again
    assert made[0].stopped and engines.metrics()["inference/replicas_lost"] == 1
    await asyncio.gather(*engines._pending)  # the replacement's start
    assert [r.index for r in engines.replicas] == [1, 2] and made[2].version == 3
    assert engines.metrics()["inference/replica_restarts"] == 1


async def test_a_replica_that_cannot_load_new_weights_leaves_rotation(replicas):
    engines, made = replicas
    made[1].broken_loader = True
    await engines.load_weights("/weights/v1", 1)
    assert engines.weight_version == 1 and [r.index for r in engines.replicas] == [0]
    assert await _rollout(engines, 2) == [0, 0]
    await asyncio.gather(*engines._pending)
    assert [r.index for r in engines.replicas] == [0, 2] and made[2].version == 1


async def test_pushed_weights_reach_every_replica_and_a_replacement_after_a_disk_load(replicas):
    engines, made = replicas
    assert engines.supports_weight_push
    await engines.load_weights("/weights/v1", 1)
    tensors = {"w": [1.0]}
    made[1].broken_loader = True
    await engines.push_weights(tensors, 2)
    assert engines.weight_version == 2 and made[0].served is tensors and made[0].version == 2
    await asyncio.gather(*engines._pending)  # replica 1 could not take them: its replacement gets the tensors
    assert [r.index for r in engines.replicas] == [0, 2] and made[2].served is tensors and made[2].version == 2
