"""The file transport: the tensors, cast to the server's dtype, in one safetensors file that the workers read. Slower
than shared memory (the bytes go through the page cache of a real filesystem) but it needs no room in ``/dev/shm``
and no port, only a server on this machine; auto tries it last. Unlike ``weight_sync.mode=disk`` it writes no
checkpoint: no config, no tokenizer, only what the workers load.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from generators.engines.transports import Rpc, Server, WeightTransport
from generators.engines.transports.buckets import Bucket, manifest, read_manifest


class SafetensorsFile(WeightTransport):
    """Weights written to a private directory (mode 0700) as one safetensors file, replaced atomically each sync and
    stamped with the version; removed by :meth:`close`."""

    name = "disk"

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="envkit-weights-"))
        self.path = self.directory / "weights.safetensors"

    @classmethod
    def unusable(cls, server: Server, buckets: list[Bucket]) -> str | None:
        return None if server.local else "it needs a server this engine started, on this machine"

    def stage(self, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        """Write ``tensors`` in their buckets' dtypes, then move the file into place."""
        cast = {name: getattr(torch, b.dtype) for b in buckets for name, _ in b.tensors}
        partial = self.path.with_suffix(".partial")
        save_file({name: tensors[name].detach().to("cpu", cast[name]).contiguous() for name in cast}, str(partial),
                  metadata={"version": str(version)})
        os.replace(partial, self.path)

    async def deliver(self, rpc: Rpc, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        await rpc("load", {"manifest": manifest(buckets, version), "path": str(self.path)})

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def worker_load(worker: Any, manifest: str, path: str) -> int:
        """In a worker: load the file at ``path``, which must hold the version and tensors ``manifest`` names."""
        buckets, version = read_manifest(manifest)
        names = [name for b in buckets for name, _ in b.tensors]
        with safe_open(path, framework="pt") as f:
            held = int((f.metadata() or {}).get("version", -1))
            if held != version or sorted(f.keys()) != sorted(names):
                raise RuntimeError(f"weight transfer mismatch: {path} holds version {held} with {len(f.keys())} "
                                   f"tensors, the manifest says version {version} with {len(names)}")
            worker.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        return version
