"""How a training run's new weights reach its inference engine (:class:`WeightSyncConfig`): every rule about it,
checked here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

from generators.engines.base import WEIGHT_SWAPS, WEIGHT_TRANSPORTS

WEIGHT_SYNC_MODES = ("auto", "memory", "disk")


@dataclass
class WeightSyncConfig:
    """How a training run's new weights reach its inference engine."""

    mode: str = "auto"
    """memory (sent from rank 0 with no files: vllm, hf, and Ray replicas of them; not sglang), disk (an HF
    checkpoint the server reloads), or auto (memory where the engine can take it, else disk; disk again after a
    failed transfer)."""
    transport: str = "auto"
    """vllm, from memory: shared (through /dev/shm, for a CPU server this run started), group (a process group with
    the server's workers: gloo on CPU, NCCL on a GPU), disk (a safetensors file a server on this machine reads), ray
    (the object store of the Ray cluster the engine's process is connected to: a replica actor's, under
    placement.backend=ray), or auto (the first of those, in that order, that can reach the server). The transports
    are registered in ``generators/engines/transports``."""
    swap: str = "finish"
    """vllm: what requests in flight do when new weights arrive: finish (on the weights they started with) or
    interrupt (stop, then the generator continues each on the new weights; partial rollouts, every token's version
    in ``Trajectory.version_spans``)."""

    def __post_init__(self) -> None:
        for name, allowed in (("mode", WEIGHT_SYNC_MODES), ("transport", WEIGHT_TRANSPORTS), ("swap", WEIGHT_SWAPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def check_placement(self, backend: str) -> None:
        """Raise ValueError where a run placed by ``backend`` (local, ray) cannot move weights the way this asks."""
        if self.transport == "ray" and backend != "ray":
            raise ValueError("transport=ray moves weights through a Ray cluster's object store, which only "
                             "placement.backend=ray joins: add it, or pick another transport")

    def check_engine(self, engine: str) -> None:
        """Raise ValueError where ``engine`` cannot take new weights the way this asks."""
        if self.mode == "memory" and engine == "sglang":
            raise ValueError("mode=memory, but engine=sglang takes new weights from a checkpoint on disk only: use "
                             "mode=auto or disk")
        if self.transport != "auto" and engine != "vllm":
            raise ValueError(f"transport={self.transport} picks how weights reach a vLLM server's workers; "
                             f"engine={engine} takes no transport: leave it auto")
        if self.swap == "interrupt" and engine != "vllm":
            raise ValueError(f"swap=interrupt needs engine=vllm (engine={engine} finishes requests in flight before "
                             "new weights go in)")
