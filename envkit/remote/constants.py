"""The names and numbers both ends of the wire agree on: the environment variables ``envkit serve`` and its clients
read, and how long an idle connection lives. A leaf: it imports nothing, so the client and the server modules take
these from here rather than through the package's face (whose type-only import of the client would make a circle).
All of them are importable from :mod:`envkit.remote` too.
"""

from __future__ import annotations

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

