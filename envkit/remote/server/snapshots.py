"""Snapshot tokens: a session's env state leaves the server as a signed token (``POST /sessions/{id}/snapshot``)
and comes back to restore any session of a server that holds the same key (``POST /sessions/{id}/restore``).

The server keeps nothing, so a token restores on any worker of ``--workers N`` and, with one key shared through
:data:`~envkit.remote.SNAPSHOT_KEY_ENV`, on any server of the same env (a pool of sandboxes). A token is the pickled
state and an HMAC-SHA256 of it: a server unpickles only what a holder of its key sealed, so a client cannot make it
run code by sending a forged state.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import pickle
import secrets

from envkit.core import Snapshot
from envkit.remote import SNAPSHOT_KEY_ENV
from envkit.remote.protocol import ApiError


def snapshot_key() -> bytes:
    """The key from :data:`~envkit.remote.SNAPSHOT_KEY_ENV`, or a new random one (this server's tokens only)."""
    shared = os.environ.get(SNAPSHOT_KEY_ENV)
    return shared.encode() if shared else secrets.token_bytes(32)


class SnapshotSeal:
    """Seals ``(env name, snapshot, episode status)`` into a token and opens only tokens sealed with its key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def seal(self, env: str, snapshot: Snapshot, episode: str) -> str:
        """The token of a session's snapshot."""
        payload = pickle.dumps((env, snapshot, episode), protocol=pickle.HIGHEST_PROTOCOL)
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def open(self, token: str, env: str) -> tuple[Snapshot, str]:
        """The snapshot and episode status in ``token``; ApiError ``invalid_snapshot`` unless it was sealed with
        this key for ``env``."""
        body, dot, mac = token.partition(".")
        try:
            payload, signature = _unb64(body), _unb64(mac)
        except (binascii.Error, ValueError):
            payload, signature = b"", b""
        if not dot or not hmac.compare_digest(signature, self._mac(payload)):
            raise ApiError("invalid_snapshot", "not a snapshot token of this server: it was altered, or sealed by a "
                                               "server with another key (share one in $ENVKIT_SNAPSHOT_KEY)")
        name, snapshot, episode = pickle.loads(payload)  # sealed with this key: a state this server made
        if name != env:
            raise ApiError("invalid_snapshot", f"a snapshot of env {name!r} cannot restore a session of {env!r}")
        return snapshot, episode


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
