"""Training checkpoints: backend state (model, optimizer, scheduler), loop state, RNG states; atomic; keep-last-k.

Layout: ``<root>/step-000010/`` holding the backend's files, ``state.json`` (step, policy version, every env's
data position, async mode's untrained groups) and ``rng.pt``. A checkpoint is written into a temp dir and renamed
into place, so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from generators.nodes import node_name
from trainer.backends.base import TrainBackend

_PREFIX = "step-"


@dataclass
class TrainState:
    """Where the loop is: enough, with the backend state, to continue exactly."""

    step: int = 0
    """Training steps completed."""
    policy_version: int = 0
    """Version of the weights the inference engine serves."""
    data: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each env's data position (epoch, position in the epoch's order, prompts drawn), by label."""
    pending: list[dict[str, Any]] = field(default_factory=list)
    """Async mode: groups drawn but not trained (trainer/async_rollouts.py), so a resume loses none of them."""
    promoted: list[int] = field(default_factory=lambda: [0])
    """The online stage: the weight versions promoted to serve, in order (0: the starting weights)."""
    lineage: list[int] = field(default_factory=lambda: [0])
    """The online stage: the versions the trainer's weights came through since it last started from a serving
    version (that version first): how many updates apart two of them are."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the run stops with the last complete one intact."""


class CheckpointManager:
    """Saves to and finds checkpoints under ``root``."""

    def __init__(self, root: Path, *, keep_last: int) -> None:
        self.root = root
        self.keep_last = keep_last

    def save(self, backend: TrainBackend, state: TrainState) -> Path:
        """Write a checkpoint for ``state.step`` (collective: every rank calls it); :class:`CheckpointError` names
        the step, the path and the node when the disk refuses it (full, gone, read-only)."""
        final = self.root / f"{_PREFIX}{state.step:06d}"
        tmp = self.root / f".{final.name}.tmp"
        try:
            return self._save(backend, state, final, tmp)
        except (OSError, CheckpointException) as e:  # DCP wraps the ranks' OSErrors in the latter
            shutil.rmtree(tmp, ignore_errors=True)  # what was written of it, so that the disk has room again
            last = self.all()
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e  # rank's own
            why = getattr(cause, "strerror", None) or str(cause)
            raise CheckpointError(
                f"step {state.step}: writing its checkpoint to {final} on {node_name()} failed: {why}. The last "
                f"complete checkpoint is {last[-1] if last else 'none'}: free the disk and rerun with "
                "trainer.resume=latest") from e

    def _save(self, backend: TrainBackend, state: TrainState, final: Path, tmp: Path) -> Path:
        if backend.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier(backend)
        backend.save_state(tmp)
        if backend.rank == 0:
            (tmp / "state.json").write_text(json.dumps(asdict(state)))
            torch.save(_rng_state(), tmp / "rng.pt")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in self.all()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(backend)
        return final

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))

    def resolve(self, resume: str) -> Path:
        """``latest`` or an explicit checkpoint dir, checked to exist."""
        if resume == "latest":
            found = self.all()
            if not found:
                raise FileNotFoundError(f"trainer.resume=latest but there is no checkpoint under {self.root}")
            return found[-1]
        path = Path(resume)
        if not (path / "state.json").is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint (no state.json)")
        return path

    def load(self, path: Path, backend: TrainBackend) -> TrainState:
        """Restore the backend and RNG states from ``path`` and return the loop state."""
        backend.load_state(path)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return TrainState(**json.loads((path / "state.json").read_text()))


def _rng_state() -> dict[str, object]:
    state: dict[str, object] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier(backend: TrainBackend) -> None:
    if backend.world_size > 1:
        dist.barrier()
