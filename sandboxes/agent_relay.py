"""Runs inside a :class:`~sandboxes.agent.DockerCommand` container (standard library only): relays TCP connections
on ``127.0.0.1:PORT`` to the gateway's Unix socket mounted at ``SOCKET``, then runs the agent.

The container has no network but its loopback, so the relay is its only way out, and it leads to the episode's
gateway and nowhere else. ``python3 agent_relay.py SOCKET PORT TASK_FILE -- ARGV...``: the agent gets the task
file on its stdin; its stdout is the container's, and its exit status the relay's.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading


def pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends, then end ``sink``'s writing half."""
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def relay(client: socket.socket, path: str) -> None:
    """Join one agent connection to a new connection to the gateway's socket."""
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay, args=(client, path), daemon=True).start()


def main() -> int:
    path, port, task_file, separator, *argv = sys.argv[1:]
    if separator != "--" or not argv:
        sys.exit("usage: agent_relay.py SOCKET PORT TASK_FILE -- ARGV...")
    listener = socket.create_server(("127.0.0.1", int(port)))
    threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    with open(task_file, "rb") as task:
        return subprocess.run(argv, stdin=task).returncode


if __name__ == "__main__":
    sys.exit(main())
