"""The process group: torchrun's when launched by it, else a one-rank group, so one code path serves both."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

_created_here = False


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
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
