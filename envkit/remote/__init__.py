"""Envs in other processes, both sides of the wire: the client side (:class:`RemoteEnv` in :mod:`.client` for
``envkit serve``, :class:`~envkit.remote.openenv.OpenEnvEnv` for OpenEnv servers, on the connections of
:mod:`.httpclient` and :mod:`.wsclient`), the server side (:mod:`.server`, ``envkit serve``), and what both speak
(:mod:`.protocol`, :mod:`.wire`, :mod:`.deadlines`). All of it needs the ``envkit-rl[server]`` extra.

``RemoteEnv`` and ``RemoteConfig`` are importable from here; the client module is imported on first use of either,
so a server process, which imports this package too, never loads the client's httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envkit.remote.client import RemoteConfig, RemoteEnv

__all__ = ["KEEP_ALIVE_S", "OPERATOR_KWARGS", "PARENT_ENV", "SNAPSHOT_KEY_ENV", "TOKEN_ENV", "RemoteConfig",
           "RemoteEnv"]

TOKEN_ENV = "ENVKIT_TOKEN"
"""The environment variable both ends read the bearer token from."""
KEEP_ALIVE_S = 75
"""How long ``envkit serve`` keeps an idle HTTP connection open; RemoteEnv reopens one well before."""
OPERATOR_KWARGS = frozenset({"opponent", "python"})
"""Env kwargs only whoever starts ``envkit serve`` sets (its ``--kwargs``), never a session: a two-player game's
opponent is code the server imports and calls, or a URL it posts to and quotes back; a verifiers env's ``python`` is a
program the server runs. A sandbox starts its server with them."""
SNAPSHOT_KEY_ENV = "ENVKIT_SNAPSHOT_KEY"
"""A key ``envkit serve`` signs its snapshot tokens with (random per server when unset): servers that share one
restore each other's snapshots. Keep it secret: a server unpickles whatever a holder of its key seals."""
PARENT_ENV = "ENVKIT_SERVE_PARENT"
"""Set to a pid, ``envkit serve`` ends when that process does: a sandbox's server must not outlive the process that
leased it, SIGKILLed or not (nothing else would close the sandboxes its envs opened)."""


def __getattr__(name: str) -> Any:
    if name in ("RemoteConfig", "RemoteEnv"):
        return getattr(importlib.import_module("envkit.remote.client"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
