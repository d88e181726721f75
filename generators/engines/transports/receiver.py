"""The vLLM worker extension every server here is started with (``--worker-extension-cls
generators.engines.transports.receiver.WeightReceiver``): the server side of every weight transport. Its methods are
called through ``/collective_rpc``, whose arguments are strings."""

from __future__ import annotations

import os
from typing import Any

from generators.engines.transports import transport_class

BUSY_POLL_ENV = "ENVKIT_VLLM_BUSY_POLL_S"
"""Set for a server on the CPU (``VLLMEngine``): how long its workers busy-poll for work after each read."""


class WeightReceiver:
    """Mixed into each vLLM worker: answers the trainer's weight-sync calls."""

    def envkit_model_dtype(self) -> str:
        """The dtype every floating parameter of the served model has ("" if they differ): what the trainer sends."""
        dtypes = {p.dtype for p in self.model_runner.get_model().parameters() if p.is_floating_point()}  # type: ignore[attr-defined]
        return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else ""

    def envkit_call(self, transport: str, call: str, **kwargs: str) -> Any:
        """Run transport ``transport``'s ``worker_<call>`` in this worker."""
        return getattr(transport_class(transport), f"worker_{call}")(self, **kwargs)


def _shorten_busy_polling() -> None:
    """Cap how long a worker busy-polls its input queue after a read at ``$ENVKIT_VLLM_BUSY_POLL_S`` seconds.

    vLLM's workers spin on their shared-memory queue for 1 s after each read before they wait on its socket, which
    the writer notifies on every message, so a shorter window only adds a wake-up between steps further apart than
    it. On a CPU whose cores the trainer shares, that second of spinning after a step's last request took a core
    from the update that came next: 1.0 s of CPU, 0.85 s of a 4.8 s update on 2 vCPUs.
    """
    limit = os.environ.get(BUSY_POLL_ENV)
    if limit is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: its own polling stands
        return
    if getattr(SpinCondition.wait, "envkit_limit", None) is not None:  # this process has capped it already
        return
    wait = SpinCondition.wait

    def capped(self: Any, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, float(limit))
        wait(self, timeout_ms)

    capped.envkit_limit = limit  # type: ignore[attr-defined]
    capped.__wrapped__ = wait  # type: ignore[attr-defined]
    SpinCondition.wait = capped


_shorten_busy_polling()
