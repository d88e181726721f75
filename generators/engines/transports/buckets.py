"""Weights laid out for a transfer: tensors under 1 MB packed into flat buckets of one dtype (one copy or broadcast
for many norms and biases), bigger ones alone and sent in place (packing them meant copying most of the model into
fresh memory, which took longer than the transfer itself). Floating tensors travel in the dtype the server computes in
when all its parameters share one (an fp32 master copy sent to a bf16 server: half the bytes, and the same rounding
the server's load would do). The manifest (names, dtypes, shapes, bucket layout, version) travels in the RPC that
starts a receive, so a transport carries only tensor bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

PACK_BELOW = 1 << 20
BUCKET_BYTES = 16 << 20


@dataclass
class Bucket:
    """Tensors sent in one broadcast: packed flat when there are several, in place when alone."""

    dtype: str
    tensors: list[tuple[str, list[int]]]

    @property
    def numel(self) -> int:
        """Elements in the bucket."""
        return sum(numel(shape) for _, shape in self.tensors)


def plan_buckets(tensors: dict[str, torch.Tensor], pack_below: int = PACK_BELOW, bucket_bytes: int = BUCKET_BYTES,
                 cast: str | None = None) -> list[Bucket]:
    """A tensor of ``pack_below`` bytes or more is a bucket alone (sent in place, no copy); smaller ones share
    buckets of one dtype up to ``bucket_bytes`` (one broadcast for many norms and biases). ``cast``: the dtype
    (a torch name, e.g. "bfloat16") floating tensors travel in; their own when None."""
    buckets: list[Bucket] = []
    open_: dict[str, tuple[Bucket, int]] = {}  # dtype -> the bucket small tensors go into, its bytes so far
    for name, t in tensors.items():
        sent = _sent_dtype(t, cast)
        dtype, nbytes = str(sent).removeprefix("torch."), t.numel() * sent.itemsize
        if nbytes >= pack_below:
            buckets.append(Bucket(dtype, [(name, list(t.shape))]))
            continue
        bucket, size = open_.get(dtype, (None, 0))
        if bucket is None or size + nbytes > bucket_bytes:
            bucket, size = Bucket(dtype, []), 0
            buckets.append(bucket)
        bucket.tensors.append((name, list(t.shape)))
        open_[dtype] = (bucket, size + nbytes)
    return buckets


def _sent_dtype(t: torch.Tensor, cast: str | None) -> torch.dtype:
    return getattr(torch, cast) if cast and t.is_floating_point() else t.dtype


def manifest(buckets: list[Bucket], version: int) -> str:
    """The JSON the receiver needs to unpack a transfer."""
    return json.dumps({"version": version, "buckets": [{"dtype": b.dtype, "tensors": b.tensors} for b in buckets]})


def read_manifest(text: str) -> tuple[list[Bucket], int]:
    """The buckets and version :func:`manifest` wrote."""
    plan = json.loads(text)
    buckets = [Bucket(b["dtype"], [(name, shape) for name, shape in b["tensors"]]) for b in plan["buckets"]]
    return buckets, plan["version"]


def numel(shape: list[int]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n
