"""Run a model server and take every process it starts down with it, or with its owner.

    python -m generators.engines.watchdog FD -- COMMAND...

:class:`generators.engines.server.ManagedServer` starts this as the leader of a new session and keeps the write end
of the pipe whose read end is ``FD``. The kernel closes that end when the owner dies, however it dies (SIGKILL
included); the watchdog then reads EOF and ends the server and everything it forked: SIGTERM, then SIGKILL after
a grace period. When the server exits by itself, its leftovers (vLLM's engine core and workers) are killed too, and
the watchdog exits with the server's code. It is a child subreaper, so helpers orphaned by the server's death are
re-parented to it, not to init, and stay in reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def descendants(root: int) -> set[int]:
    """Pids of the processes below ``root`` or in its process group, ``root`` excluded (read from /proc)."""
    parent: dict[int, int] = {}
    group: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue
        parent[int(entry)], group[int(entry)] = int(fields[1]), int(fields[2])
    root_group = os.getpgid(root)
    found = {pid for pid, pgrp in group.items() if pgrp == root_group}
    frontier = [root]
    while frontier:
        below = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in found]
        found.update(below)
        frontier = below
    found.discard(root)
    return found


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap() -> None:
    """Collect exited children (orphans re-parented here) so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def end_everything(grace_s: float) -> None:
    """SIGTERM every process below this one, then SIGKILL what is left after ``grace_s``."""
    me = os.getpid()
    _signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not descendants(me):
            return
        time.sleep(0.1)
    _signal_all(descendants(me), signal.SIGKILL)


def _watch(fd: int) -> None:
    while os.read(fd, 1):  # the owner never writes: this returns b"" (EOF) once it is gone
        pass
    end_everything(GRACE_S)
    os._exit(128 + signal.SIGKILL)


def _server_preexec() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform == "linux":
        # A watchdog killed outright (SIGKILL: Ray ends a dead actor's child processes that way) cannot clean up;
        # the kernel then sends the server SIGTERM, and it shuts down its engine processes itself.
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str]) -> int:
    """Run the command after ``--``; returns its exit code."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m generators.engines.watchdog FD -- COMMAND...", file=sys.stderr)
        return 2
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # The owner's stop() signals the whole group: the server shuts down gracefully and this process outlives it,
    # to clean up after it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = subprocess.Popen(argv[2:], preexec_fn=_server_preexec)  # ignored signals would survive the exec
    threading.Thread(target=_watch, args=(int(argv[0]),), daemon=True).start()
    code = server.wait()
    print(f"[watchdog] the server exited with code {code}", flush=True)
    _signal_all(descendants(os.getpid()), signal.SIGKILL)
    _reap()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
