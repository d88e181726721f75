"""The vLLM worker extension every server here is started with (``--worker-extension-cls
generators.engines.transports.receiver.WeightReceiver``): the server side of every weight transport. Its methods are
called through ``/collective_rpc``, whose arguments are strings."""

from __future__ import annotations

from typing import Any

from generators.engines.transports import transport_class


class WeightReceiver:
    """Mixed into each vLLM worker: answers the trainer's weight-sync calls."""

    def envkit_model_dtype(self) -> str:
        """The dtype every floating parameter of the served model has ("" if they differ): what the trainer sends."""
        dtypes = {p.dtype for p in self.model_runner.get_model().parameters() if p.is_floating_point()}  # type: ignore[attr-defined]
        return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else ""

    def envkit_call(self, transport: str, call: str, **kwargs: str) -> Any:
        """Run transport ``transport``'s ``worker_<call>`` in this worker."""
        return getattr(transport_class(transport), f"worker_{call}")(self, **kwargs)
