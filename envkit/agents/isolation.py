"""Where a :class:`~envkit.agents.agent.Command` agent runs: a network, a process tree and (as root) a uid of its
own, so a policy-driven process reaches its episode's gateway and nothing else.

Three ways, by what this machine allows (:func:`isolation`):

- ``"user"`` (envkit runs as root, and may make namespaces): the agent runs as a uid leased for it alone
  (:data:`envkit.agents.untrusted.users`) with no capabilities, in new network, PID and mount namespaces. It cannot read
  another agent's ``/proc/PID/environ`` (where its key is), nor root's files, nor the Docker socket; it reaches no port
  of this host.
- ``"namespace"`` (a plain user where unprivileged user namespaces are enabled, or root without CAP_SYS_ADMIN): the same
  namespaces, inside a user namespace, as this user with no capabilities. Other agents' processes, and so their keys,
  are out of sight, and no port of this host is reachable; but the agent can read and write what this user can, Unix
  sockets on the filesystem included (a Docker socket this user may use: use :class:`~sandboxes.agent.DockerCommand`
  there).
- ``None``: neither works. Agents run as this user, on this host's network, and a warning says so once.

In the first two the network namespace has only a loopback. :mod:`envkit.agents.relay` listens there on
``127.0.0.1:RELAY_PORT`` and relays each connection through a Unix socket that only it may open to the episode's own
gateway port (:attr:`AgentClient.channel_url`), which refuses every key but the episode's. Killing the namespace's
first process (the relay) kills every process in it, whatever sessions they made.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import urlsplit

from envkit.agents.untrusted import SAFE_ENV, can_switch_user, setpriv_path

log = logging.getLogger(__name__)

RELAY = Path(__file__).with_name("relay.py")
RELAY_PORT = 8000
"""Where an isolated agent finds its gateway: ``http://127.0.0.1:8000`` in its own network."""
_NAMESPACES = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")
NOT_ISOLATED = ("Command agents run unisolated on this machine (envkit is not root, and unprivileged user namespaces "
                "are disabled): each agent process can read other agents' keys in /proc, reach the inference "
                "server's port and every other port of this host, and act as this user. Run policy-driven agents "
                "in sandboxes.agent.DockerCommand, or run envkit as root or where `unshare --user` works.")


@functools.cache
def isolation() -> str | None:
    """``"user"``, ``"namespace"`` or None: how :class:`~envkit.agents.agent.Command` agents are isolated here (see the
    module doc). Probed once (a few milliseconds)."""
    unshare = _unshare()
    if unshare is None or setpriv_path() is None:
        return None
    # Root may lack CAP_SYS_ADMIN (a container run without it): then only a user namespace may work, if any.
    if can_switch_user() and _works([unshare, *_NAMESPACES, "true"]):
        return "user"
    return "namespace" if _works([unshare, "--user", "--map-root-user", *_NAMESPACES, "true"]) else None


@functools.cache
def _unshare() -> str | None:
    return shutil.which("unshare", path=SAFE_ENV["PATH"])


def _works(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0


AS_THIS_USER = ("Command agents run in user namespaces as this process's user, uid {uid} (a uid of their own needs "
                "root with CAP_SYS_ADMIN): they reach no port of this host and see no other agent's processes, but "
                "can read and write this user's files and open the Unix sockets this user may (a Docker socket among "
                "them). Run untrusted agents in sandboxes.agent.DockerCommand.")


@functools.cache
def announce(mode: str | None) -> None:
    """Say, once per process, what an isolated ``Command`` cannot keep from other agents here: everything where
    nothing isolates it (a ``RuntimeWarning`` too), this user's files in a user namespace."""
    if mode is None:
        log.warning(NOT_ISOLATED)
        warnings.warn(NOT_ISOLATED, RuntimeWarning, stacklevel=3)
    elif mode == "namespace":
        log.warning(AS_THIS_USER.format(uid=os.geteuid()))


def blocked_for_others(program: str, search_path: str) -> str | None:
    """Why another uid cannot run ``program`` (looked up on ``search_path``): the directory it cannot enter or the
    file it cannot execute (a venv under root's 0700 home, say); None when it can."""
    found = shutil.which(program, path=search_path)
    if found is None:
        return None  # the run itself says it is missing
    real = Path(found).resolve()
    for directory in reversed(real.parents):
        if not directory.stat().st_mode & stat.S_IXOTH:
            return f"{directory} (mode {directory.stat().st_mode & 0o777:o}) may not be entered by other users"
    if not real.stat().st_mode & stat.S_IXOTH:
        return f"{real} may not be executed by other users"
    return None


def isolated_argv(mode: str, socket_path: Path, argv: list[str], uid: int | None) -> list[str]:
    """``argv`` run in the namespaces of ``mode``, behind the relay to ``socket_path`` (as ``uid`` in ``"user"``
    mode). The relay starts with namespace-root's rights (to bring the loopback up); the agent holds none."""
    setpriv, unshare = setpriv_path(), _unshare()
    assert setpriv is not None and unshare is not None
    if mode == "user":
        outer = [unshare, *_NAMESPACES]
        drop = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    else:
        outer = [unshare, "--user", "--map-root-user", *_NAMESPACES]
        drop = [setpriv, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    # The process the env waits on dies with it (a killed env worker), and the namespace with that process.
    return [setpriv, "--pdeathsig", "KILL", "--", *outer, "--", sys.executable, "-I", str(RELAY), str(socket_path),
            str(RELAY_PORT), "--", *drop, "--", *argv]


def relayed(variables: dict[str, str]) -> dict[str, str]:
    """An agent's variables with its endpoints moved to the relay (each URL's path kept)."""
    relay = f"http://127.0.0.1:{RELAY_PORT}"
    return {name: relay + urlsplit(value).path if name.endswith("_BASE_URL") else value
            for name, value in variables.items()}


async def forward(path: Path, url: str) -> asyncio.Server:
    """Serve the Unix socket ``path``: each connection joined to a new one to ``url``'s host and port."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                end.close()

    return await asyncio.start_unix_server(join, path=str(path))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until it ends, then end ``writer``'s writing half."""
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
