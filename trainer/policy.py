"""A policy: what a run trains and serves, and the operations every stage uses on it, named as the field's training
API names them (Tinker's ``save_state`` / ``load_state`` / ``save_weights_for_sampler``):

    load_state(where)              a checkpoint's weights and optimizer state into the backend; its loop state
    save_state(state)              the backend and the loop state, as a checkpoint
    save_weights_for_sampler(v)    the engine samples from the current weights as version v
    save_weights(v)                the weights of version v as an HF checkpoint dir (the final weights)

Every operation is collective: each trainer rank calls it (FSDP gathers, DeepSpeed saves per rank), and only rank 0,
which holds the engine, sends weights to it. A run holds its policies (trainer/runs.py: ``run.policies``): one, whose
seat is a single-agent env's one seat, or one per policy a multi-agent env's seats name (trainer/seated_run.py). The
gradient steps are ``trainer/loop.py::update_policy`` on its backend, on the trajectories it :meth:`~Policy.plays`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from envkit.multi_agent import Seat
from generators import Trajectory
from generators.engines.base import InferenceEngine
from trainer.async_rollouts import LoopThread
from trainer.backends.base import TrainBackend
from trainer.backends.hf_export import write_hf_checkpoint
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.distributed import broadcast_from_rank0

log = logging.getLogger(__name__)

Runner = asyncio.Runner | LoopThread
"""What drives the engine's coroutines from the training thread."""


@dataclass
class Policy:
    """One trained policy: its backend (weights, optimizer, schedule), its checkpoints, where its weights are
    written (``out``), the engine that samples from it (none on the ranks above 0), its name (none alone in its run)
    and the seats it plays."""

    backend: TrainBackend
    checkpoints: CheckpointManager
    out: Path
    engine: InferenceEngine | None = None
    name: str = ""
    seats: list[Seat | None] = field(default_factory=lambda: [None])
    """A multi-agent env's seats bound to it, or a single-agent env's one seat (a trajectory's ``seat`` is None)."""

    def plays(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """The trajectories it played: those of its seats."""
        return [t for t in trajs if t.seat in self.seats]

    def load_state(self, where: str) -> TrainState:
        """The loop state of checkpoint ``where`` (``latest``, or a checkpoint dir), its weights and optimizer state
        loaded into the backend."""
        return self.checkpoints.load(self.checkpoints.resolve(where), self.backend)

    def save_state(self, state: TrainState) -> None:
        """Checkpoint the backend with the loop's ``state``."""
        self.checkpoints.save(self.backend, state)

    def save_weights_for_sampler(self, version: int, runner: Runner | None, how: str) -> bool:
        """Have the engine (driven from ``runner``) sample from the current weights as ``version``: sent from memory
        (``how`` memory, or auto where the engine can take them), else as an HF checkpoint it reloads; whether they
        went from memory."""
        return sync_weights(self.backend, self.engine, runner, self.out, version, how)

    def save_weights(self, version: int) -> str:
        """The dir of version ``version``'s weights, written as an HF checkpoint unless they are there already (sent
        to the engine from disk); version 0 is the starting model's."""
        if not version:
            return str(self.backend.config.model_path)
        weights = self.out / "weights" / f"v{version}"
        if broadcast_from_rank0(not weights.exists()):  # sent from memory, or never served: write them
            self.backend.export_weights(weights)
        return str(weights)


class AdapterPolicy(Policy):
    """A LoRA policy served as an adapter of one server of the base model (``model.lora.serve=adapters``): its
    adapter is written and loaded by the server; only the newest is kept on disk."""

    def save_weights_for_sampler(self, version: int, runner: Runner | None, how: str) -> bool:
        path = self.out / "adapters" / f"v{version}"
        self.backend.export_adapter(path)  # every rank gathers; rank 0, which holds the engine, writes and loads
        if self.engine is None or runner is None:
            return False
        runner.run(self.engine.load_weights(path, version))
        for old in (self.out / "adapters").glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return False


def sync_weights(backend: TrainBackend, engine: InferenceEngine | None, runner: Runner | None, out: Path,
                 version: int, how: str) -> bool:
    """Have the engine serve the policy as ``version``: sent from memory (``how`` memory, or auto where the engine
    can take it), else as an HF checkpoint it reloads (only the newest is kept); whether it went from memory. Every
    rank gathers the weights; rank 0, which holds the engine (and the ``runner`` it is driven from), sends them."""
    weights = backend.served_weights()
    if engine is None or runner is None:
        return False
    if how != "disk" and engine.supports_weight_push:
        try:
            runner.run(engine.push_weights(weights, version))
            return True
        except Exception as e:
            if how == "memory":
                raise
            log.warning("sending weights v%d from memory failed (%s: %s); loading them from disk instead", version,
                        type(e).__name__, e)
    path = out / "weights" / f"v{version}"
    write_hf_checkpoint(weights, Path(backend.config.model_path), path)
    runner.run(engine.load_weights(path, version))
    for old in (out / "weights").glob("v*"):
        if old != path and old.name[1:].isdigit():
            shutil.rmtree(old, ignore_errors=True)
    return False
