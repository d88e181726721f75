"""The Ray transport: the weights go into the object store of the Ray cluster this process is connected to, and each
worker gets them from there. The server's workers join the cluster once (``ray.init`` at its GCS address). On the
trainer's node a get maps the store's shared memory; on another node Ray moves the bytes, with no port of its own to
open. Named only (``weight_sync.transport=ray``): auto finds shared memory or a process group first.

The object's ref reaches the workers in band, through a small actor that holds it (:class:`RefBoard`). A ref
pickled into a string instead is pinned for the life of the process that made it, so every sync would leak a copy of
the weights into the store.
"""

from __future__ import annotations

import os
import secrets
import warnings
from typing import Any

import numpy as np
import ray
import torch

from generators.engines.transports import Rpc, Server, WeightTransport
from generators.engines.transports.buckets import Bucket, manifest, read_manifest
from generators.engines.transports.shared import pack, shared_layout, unpack


def store_view(array: np.ndarray) -> torch.Tensor:
    """A tensor over an array ``ray.get`` handed out: the store's memory, read-only, not copied (fine for a load,
    which copies what it reads; torch's warning about the read-only buffer is silenced for that reason)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class RefBoard:
    """A Ray actor (no CPU) that holds the ref of the sync in progress for the workers to take."""

    def __init__(self) -> None:
        self._held: tuple[int, list[ray.ObjectRef]] = (-1, [])

    def hold(self, version: int, refs: list[ray.ObjectRef]) -> None:
        """Keep ``refs`` (a list, so Ray passes the refs, not their values) as ``version``'s."""
        self._held = (version, refs)

    def take(self, version: int) -> list[ray.ObjectRef]:
        """``version``'s refs; raises if another version is held."""
        if self._held[0] != version:
            raise RuntimeError(f"weight transfer mismatch: the board holds version {self._held[0]}, not {version}")
        return self._held[1]

    def drop(self) -> None:
        """Let the store free the weights once no worker reads them."""
        self._held = (-1, [])


class RayObjectStore(WeightTransport):
    """Weights packed into one object in Ray's store (laid out as the shared-memory file is), its ref held by a
    :class:`RefBoard` actor until the workers have loaded it."""

    name = "ray"

    def __init__(self) -> None:
        self._board_name = f"envkit-weights-{os.getpid()}-{secrets.token_hex(4)}"
        self._board: Any = None
        self._held: Any = None  # the board's answer to the last hold: the workers may take once it has come

    @classmethod
    def unusable(cls, server: Server, buckets: list[Bucket]) -> str | None:
        if not ray.is_initialized():
            return "it needs this process connected to a Ray cluster (ray.init)"
        return None if server.local else "it needs a server this engine started, so on a node of its Ray cluster"

    async def open(self, rpc: Rpc, server: Server) -> None:
        context = ray.get_runtime_context()
        self._board = ray.remote(num_cpus=0)(RefBoard).options(name=self._board_name).remote()
        await rpc("connect", {"address": context.gcs_address, "namespace": context.namespace})

    def stage(self, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        """Pack ``tensors`` into one array, put it in the store and hand its ref to the board; :meth:`deliver` awaits
        the board's answer (a blocking get here would be one inside an async actor when a replica's engine runs
        this, which Ray warns of)."""
        raw = torch.empty(shared_layout(buckets)[1], dtype=torch.uint8)
        pack(tensors, buckets, raw, version)
        self._held = self._board.hold.remote(version, [ray.put(raw.numpy())])

    async def deliver(self, rpc: Rpc, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        try:
            await self._held
            await rpc("load", {"manifest": manifest(buckets, version), "board": self._board_name})
        finally:
            await self._board.drop.remote()

    def close(self) -> None:
        """End the board, and with it the last ref to the weights."""
        if self._board is not None and ray.is_initialized():
            ray.kill(self._board)
        self._board = None

    @staticmethod
    def worker_connect(worker: Any, address: str, namespace: str) -> None:
        """In a worker: join the trainer's Ray cluster (once per worker process)."""
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="warning")

    @staticmethod
    def worker_load(worker: Any, manifest: str, board: str) -> int:
        """In a worker: take the transfer ``manifest`` describes from the store, through the board named ``board``."""
        buckets, version = read_manifest(manifest)
        refs = ray.get(ray.get_actor(board).take.remote(version))
        raw = store_view(ray.get(refs[0]))
        worker.reload_weights(weights_iterator=unpack(raw, buckets, version, f"ray object {refs[0].hex()}"))
        return version
