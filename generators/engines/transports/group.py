"""The network transport: the trainer broadcasts its weights to the server's workers over a process group (gloo on
CPU, NCCL on GPU), with no file in between.

    trainer (rank 0)                                    vLLM worker i (rank 1 + i)
    open()     ── TCPStore + process group ──────────── worker_join(host, port, world_size)
    deliver()  ── header: version, tensors ──────────── worker_receive(manifest)
               ── all-reduce: both agree? ───────────     (a mismatch ends the transfer on both sides)
               ── bucket 0, 1, ... ─────────────────      unpack, then reload_weights(those tensors)

The receiver asks for bucket i + 1 before it loads bucket i, so the bytes of the next bucket arrive while the loader
repacks the last one. Both sides keep their buffers for the next sync of the same layout (allocating 0.5 GB afresh
costs more than sending it).
"""

from __future__ import annotations

import asyncio
import datetime
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from generators.engines.threads import torch_in_thread
from generators.engines.transports import Rpc, Server, WeightTransport
from generators.engines.transports.buckets import Bucket, manifest, numel, read_manifest

TIMEOUT = datetime.timedelta(seconds=120)


def _group(store: dist.TCPStore, rank: int, world_size: int, device: str) -> Any:
    """A process group outside torch.distributed's default one, so the trainer's FSDP group and vLLM's own stay
    untouched."""
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: where that host's server can reach a group we listen for."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


def _handshake(group: Any, version: int, count: int, device: str, *, sender: bool, expected: tuple[int, int] = (0, 0)
               ) -> None:
    """The sender's (version, tensor count) reach every receiver, and all agree that it is the transfer they expect;
    on a mismatch every side raises, so none waits for bytes that never come."""
    header = torch.tensor([version, count] if sender else [0, 0], dtype=torch.int64, device=device)
    group.broadcast(header, 0).wait()
    agree = torch.tensor([1 if sender or tuple(header.tolist()) == expected else 0], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([agree], opts).wait()
    if int(agree.item()) != 1:
        raise RuntimeError(f"weight transfer mismatch: the sender sends version {int(header[0])} with "
                           f"{int(header[1])} tensors" + ("" if sender else f", this side expected {expected}"))


def _flat_buffers(buckets: list[Bucket], device: str) -> list[torch.Tensor]:
    return [torch.empty(b.numel, dtype=getattr(torch, b.dtype), device=device) for b in buckets]


class ProcessGroup(WeightTransport):
    """Rank 0 of a process group with the server's workers, broadcasting the buckets (blocking calls, in a thread)."""

    name = "group"

    def __init__(self) -> None:
        self._group: Any = None
        self._store: dist.TCPStore | None = None
        self._device = "cpu"
        self._buffers: tuple[str, list[torch.Tensor]] = ("", [])

    async def open(self, rpc: Rpc, server: Server) -> None:
        """Listen for the group, count the workers, and form it with them (once per server process)."""
        host, self._device = _address_towards(server.host), server.device
        self._store = await asyncio.to_thread(dist.TCPStore, host, 0, 1, is_master=True, timeout=TIMEOUT,
                                              wait_for_workers=False)
        world_size = 1 + len(await rpc("rank", {}))
        join = rpc("join", {"host": host, "port": str(self._store.port), "world_size": str(world_size)})
        self._group, _ = await asyncio.gather(
            torch_in_thread(_group, self._store, 0, world_size, self._device), join)

    async def deliver(self, rpc: Rpc, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        receive = rpc("receive", {"manifest": manifest(buckets, version)})
        await asyncio.gather(receive, torch_in_thread(self._send, tensors, buckets, version))

    def _send(self, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        """Broadcast ``tensors`` as ``buckets`` (in their dtypes) after both sides agree on the transfer."""
        _handshake(self._group, version, sum(len(b.tensors) for b in buckets), self._device, sender=True)
        layout = manifest(buckets, 0)
        if self._buffers[0] != layout:  # casting into memory already mapped costs a fifth of casting into fresh
            self._buffers = (layout, _flat_buffers(buckets, self._device))
        for bucket, flat in zip(buckets, self._buffers[1], strict=True):
            first = tensors[bucket.tensors[0][0]].detach()
            if len(bucket.tensors) == 1 and first.dtype == flat.dtype and first.device == flat.device \
                    and first.is_contiguous():
                flat = first.view(-1)  # already in the wire dtype: sent in place
            else:
                offset = 0
                for name, shape in bucket.tensors:
                    n = numel(shape)
                    flat[offset:offset + n].view(shape).copy_(tensors[name].detach())  # casts on the way in
                    offset += n
            self._group.broadcast(flat, 0).wait()

    def close(self) -> None:
        """Drop the group (the receivers' side goes with their process)."""
        self._group, self._store = None, None

    @staticmethod
    def worker_rank(worker: Any) -> int:
        """In a worker: its rank (the trainer counts the workers by asking all of them)."""
        return int(worker.rank)

    @staticmethod
    def worker_join(worker: Any, host: str, port: str, world_size: str) -> None:
        """In a worker: join the group the trainer listens for at ``host:port`` as rank 1 + the worker's rank."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        worker._envkit_store = dist.TCPStore(host, int(port), int(world_size), is_master=False, timeout=TIMEOUT)
        worker._envkit_group = _group(worker._envkit_store, 1 + worker.rank, int(world_size), device)
        worker._envkit_device = device
        worker._envkit_buffers = {}

    @staticmethod
    def worker_receive(worker: Any, manifest: str) -> int:
        """In a worker: receive one transfer described by ``manifest``, load it, and return its version."""
        buckets, version = read_manifest(manifest)
        group, device = worker._envkit_group, worker._envkit_device
        _handshake(group, 0, 0, device, sender=False, expected=(version, sum(len(b.tensors) for b in buckets)))
        layout = repr([(b.dtype, b.tensors) for b in buckets])
        buffers = worker._envkit_buffers.get(layout)
        if buffers is None:
            buffers = _flat_buffers(buckets, device)
            worker._envkit_buffers = {layout: buffers}  # one layout kept: a model has one

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            arriving = group.broadcast(buffers[0], 0)
            for i, (bucket, flat) in enumerate(zip(buckets, buffers, strict=True)):
                arriving.wait()
                if i + 1 < len(buffers):  # the next bucket's bytes come in while the loader takes this one
                    arriving = group.broadcast(buffers[i + 1], 0)
                offset = 0
                for name, shape in bucket.tensors:
                    n = numel(shape)
                    yield name, flat[offset:offset + n].view(shape)
                    offset += n

        worker.reload_weights(weights_iterator=received())
        return version
