"""Envs in other processes, both sides of the wire: the client side (:class:`RemoteEnv` in :mod:`.client` for
``envkit serve``, :class:`~envkit.remote.openenv.OpenEnvEnv` for OpenEnv servers, on the connections of
:mod:`.httpclient` and :mod:`.wsclient`), the server side (:mod:`.server`, ``envkit serve``), and what both speak
(:mod:`.protocol`, :mod:`.wire`, :mod:`.deadlines`, :mod:`.constants`). All of it needs the ``envkit-rl[server]``
extra.

``RemoteEnv`` and ``RemoteConfig`` are importable from here; the client module is imported on first use of either,
so a server process, which imports this package too, never loads the client's httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from envkit.remote.constants import KEEP_ALIVE_S, OPERATOR_KWARGS, PARENT_ENV, SNAPSHOT_KEY_ENV, TOKEN_ENV

if TYPE_CHECKING:
    from envkit.remote.client import RemoteConfig, RemoteEnv

__all__ = ["KEEP_ALIVE_S", "OPERATOR_KWARGS", "PARENT_ENV", "SNAPSHOT_KEY_ENV", "TOKEN_ENV", "RemoteConfig",
           "RemoteEnv"]


def __getattr__(name: str) -> Any:
    if name in ("RemoteConfig", "RemoteEnv"):
        return getattr(importlib.import_module("envkit.remote.client"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
