"""Runs beside an agent process in a network of its own (standard library only): relays TCP connections on
``127.0.0.1:PORT`` to the episode's gateway through the Unix socket at ``SOCKET``, then runs the agent.

The agent's network namespace (a :class:`~envkit.agents.agent.Command`'s, or a
:class:`~sandboxes.agent.DockerCommand`'s container) has nothing but its loopback, so the relay is its only way out,
and it leads to the episode's gateway and nowhere else. ``python3 relay.py SOCKET PORT [--task FILE] --
ARGV...``: the agent gets the task file on its stdin (else the relay's stdin); its stdout is the relay's, and its exit
status the relay's. A new network namespace starts with its loopback down: the relay brings it up where it may.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import subprocess
import sys
import threading

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


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


def loopback_up() -> None:
    """Bring ``lo`` up if it is down (a fresh network namespace's is; a container's is up already)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def main() -> int:
    path, port, *rest = sys.argv[1:]
    task_file = None
    if rest[:1] == ["--task"]:
        task_file, rest = rest[1], rest[2:]
    if rest[:1] != ["--"] or len(rest) < 2:
        sys.exit("usage: relay.py SOCKET PORT [--task FILE] -- ARGV...")
    loopback_up()
    listener = socket.create_server(("127.0.0.1", int(port)))
    threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    if task_file is None:
        return subprocess.run(rest[1:]).returncode
    with open(task_file, "rb") as task:
        return subprocess.run(rest[1:], stdin=task).returncode


if __name__ == "__main__":
    sys.exit(main())
