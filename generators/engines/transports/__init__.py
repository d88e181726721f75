"""How weights go from the trainer's memory into a vLLM server's workers: one :class:`WeightTransport` interface, its
kinds registered by name in :data:`TRANSPORTS`.

    trainer side (VLLMEngine.push_weights)                  server side (each vLLM worker, WeightReceiver)
    transport.open(rpc, server)      once per server process   worker_<call>(...) of the same class, reached
    transport.stage(tensors, ...)    while the server generates   through /collective_rpc envkit_call
    pause
    transport.deliver(rpc, ...)      the workers load the weights  (vLLM's reload_weights: as from disk)
    reset the prefix cache, tag the version, resume

A transport is one file holding both sides: the trainer's methods, and static ``worker_*`` functions that run in
each worker (the :class:`~generators.engines.transports.receiver.WeightReceiver` extension calls them by name).
Adding one means that file plus a line in :data:`TRANSPORTS`. ``weight_sync.mode=disk`` is not a transport: the
trainer writes a full HF checkpoint, which any engine reloads (``load_weights``). Across a Ray cluster, pushed tensors
reach a replica's actor through Ray's object store first (``trainer/placement/engine_actors.py``), then its transport
(``ray`` among them: the object store again, from the actor to its server's workers).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the registry is read where torch need not be loaded (config checks)
    import torch

    from generators.engines.transports.buckets import Bucket

TRANSPORTS: dict[str, str] = {
    "shared": "generators.engines.transports.shared:SharedMemory",
    "group": "generators.engines.transports.group:ProcessGroup",
    "disk": "generators.engines.transports.disk:SafetensorsFile",
    "ray": "generators.engines.transports.ray_store:RayObjectStore",
}
"""Each transport's name and the class (``module:Class``) that implements it, tried in this order under ``auto``."""

Rpc = Callable[[str, dict[str, str]], Awaitable[list[Any]]]
"""Calls a transport's ``worker_<name>`` on every worker of the server (string arguments); their results, in rank
order."""


@dataclass(frozen=True)
class Server:
    """What a transport needs to know of the server it sends to."""

    host: str
    """The address the server listens on."""
    local: bool
    """A server this process started, so on this machine: it can read this machine's files and memory."""
    device: str
    """Where its workers compute: cpu or cuda."""


class WeightTransport(abc.ABC):
    """Moves one set of tensors, laid out in buckets, into a paused server's workers, which load them."""

    name: ClassVar[str]

    @classmethod
    def unusable(cls, server: Server, buckets: list[Bucket]) -> str | None:
        """Why this transport cannot carry ``buckets`` to ``server`` (None: it can)."""
        return None

    async def open(self, rpc: Rpc, server: Server) -> None:  # noqa: B027 - most transports need no set-up
        """Set up with one server process (once: a restarted server gets a new transport)."""

    def stage(self, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:  # noqa: B027
        """Blocking work done before the server pauses, while it still generates (run in a thread)."""

    @abc.abstractmethod
    async def deliver(self, rpc: Rpc, tensors: dict[str, torch.Tensor], buckets: list[Bucket], version: int) -> None:
        """Bring the weights into the paused server's workers and have them load them; raises if any did not."""

    def close(self) -> None:  # noqa: B027
        """Release what :meth:`open` and :meth:`stage` made (idempotent)."""


def transport_class(name: str) -> type[WeightTransport]:
    """The class registered as ``name``."""
    if name not in TRANSPORTS:
        raise ValueError(f"no weight transport {name!r} (known: {', '.join(TRANSPORTS)})")
    module, _, cls = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
