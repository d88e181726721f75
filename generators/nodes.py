"""Where a process of a Ray run lives, as the run's summary names it (``python -m trainer``'s ``nodes``)."""

from __future__ import annotations

import socket


def node_name() -> str:
    """This node's host name, and in a Ray cluster its address there, e.g. ``worker1 (172.18.0.3)``."""
    import ray

    if not ray.is_initialized():
        return socket.gethostname()
    return f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
