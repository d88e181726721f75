"""The process group: torchrun's when launched by it, else a one-rank group, so one code path serves both."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_created_here = False
T = TypeVar("T")


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or create) the default process group; returns ``(rank, world_size, device)``.

    NCCL with one GPU per rank when CUDA is available, else gloo on CPU.
    """
    global _created_here
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
            dist.init_process_group(backend)
        else:
            # An in-memory store: no port to pick, so no race with another process picking the same one.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _created_here = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def shutdown_distributed() -> None:
    """Destroy the default process group if ``init_distributed`` created it."""
    global _created_here
    if _created_here and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False


def all_reduce_values(values: dict[str, float], op: Callable[..., float] = sum) -> dict[str, float]:
    """Named scalars combined over all ranks by ``op`` (``sum`` or ``max``); unchanged on one rank."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    # NCCL reduces only device tensors; gloo only host ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op is max else dist.ReduceOp.SUM)
    return dict(zip(keys, tensor.tolist(), strict=True))


def max_over_ranks(value: int) -> int:
    """The largest ``value`` any rank holds."""
    return int(all_reduce_values({"value": float(value)}, max)["value"])


def broadcast_from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (pickled); ``obj`` itself on one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box: list[Any] = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
