"""DockerSandbox: an env image's ``envkit serve`` in its own locked-down container; and the orphan reaper.

Every docker SDK call is blocking, so each runs in a worker thread (``asyncio.to_thread``); the event loop only
polls ``/health`` with httpx. A container is created under a name chosen beforehand, so cleanup can find it even
when the call that creates it was still in flight when the start failed or was cancelled.

Isolation per container: CPU, memory (no swap) and pids limits, read-only root with tmpfs ``/work`` and ``/tmp``,
``no-new-privileges``, an init process that reaps zombies. The server runs as root holding only CAP_SETUID,
CAP_SETGID and CAP_KILL: ``exec`` goes to its ``/exec`` route, which runs the command as ``EXEC_UID`` and, when it
ends, stops and kills every process of that uid (new sessions, daemons and all). The env packages are readable by
root only, so neither exec'd code nor a graded submission (run under uids of their own) can read them. Without
``network`` the container sits on an internal bridge whose packets this host does not forward, whose DNS answers
nothing, and from which this host's firewall drops every new connection (TCP SYN, UDP): the host reaches the
container's server on the bridge address, the container reaches nothing, not even services on this host. With
``network`` it joins the default bridge and the server port is published on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from envkit import tracing
from envkit.agents.untrusted import EXEC_USER_ENV, process_start_ticks
from envkit.distribution import install_hint
from envkit.errors import SnapshotError
from envkit.remote import SNAPSHOT_KEY_ENV
from sandboxes.base import (
    EXEC_DIR,
    EXEC_UID,
    SANDBOX_ENV,
    SERVER_PORT,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxStartError,
    SandboxUnavailableError,
    State,
    exec_argv,
    host_lock,
    owner_id,
    snapshot_key,
    wait_healthy,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SANDBOX_LABEL = "org.envkit.sandbox"
OWNER_LABEL = "org.envkit.owner"
"""``host:pid:start`` of the process that started the container; the reaper removes those whose owner died."""
INTERNAL_NETWORK = "envkit-sandbox-internal"
SANDBOX_NETWORK_ENV = "ENVKIT_SANDBOX_NETWORK"
"""Names the internal network no-network sandboxes join instead of :data:`INTERNAL_NETWORK`: a node of a container
cluster (trainer/container_cluster.py) is attached to its cluster's, so its env workers reach their sandboxes."""
STAGING_DIR_ENV = "ENVKIT_DOCKER_STAGING_DIR"
"""Names a directory that this process and the Docker engine see at the same path, where a
:class:`~sandboxes.agent.DockerCommand` stages each episode (its gateway socket, its task) for its container to
bind-mount; default the temp directory, right where the engine runs on this process's host. A container cluster's
node, whose engine is the host's, is given one under the shared directory."""
EXEC_KILL_GRACE_S = 5.0
"""How much longer than its timeout the host waits for an exec's answer."""
FILES_ROUTE = "/exec/files"
FILES_TIMEOUT_S = 90.0
"""How long the host waits for the server to pack or unpack the exec dir's files (its own deadline is 60 s)."""

_reaped = False
_shared: dict[str, Any] = {}


def connect() -> Any:
    """The process's docker SDK client (one connection pool for all sandboxes), or SandboxUnavailableError."""
    try:
        import docker
    except ImportError as e:
        raise SandboxUnavailableError(f"the docker SDK is missing: {install_hint('docker')}") from e
    host = os.environ.get("DOCKER_HOST", "")
    if host not in _shared:
        try:
            client = docker.from_env(timeout=60, max_pool_size=32)
            client.ping()
        except Exception as e:
            raise SandboxUnavailableError(f"no Docker engine reachable ({type(e).__name__}: {e}); start one with "
                                          "`python -m sandboxes.engine up`") from e
        _shared[host] = client
    return _shared[host]


def _owner_alive(owner: str) -> bool:
    host, _, rest = owner.partition(":")
    pid_text, _, start_text = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return True  # another host's (or a malformed) owner: not ours to judge
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return not start_text.isdigit() or process_start_ticks(pid) == int(start_text)


def reap_orphans(client: Any) -> list[str]:
    """Remove sandbox containers on this engine whose owner process on this host is gone; returns their names."""
    import docker.errors

    removed = []
    # ignore_removed: another process may remove a container between the listing and its inspection
    for container in client.containers.list(all=True, ignore_removed=True, filters={"label": SANDBOX_LABEL}):
        owner = container.labels.get(OWNER_LABEL, "")
        if _owner_alive(owner):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
            removed.append(container.name)
            log.info("reaped sandbox container %s (owner %s is gone)", container.name, owner)
    return removed


def sandbox_network() -> str:
    """The name of the internal network this process's no-network sandboxes join."""
    return os.environ.get(SANDBOX_NETWORK_ENV) or INTERNAL_NETWORK


def internal_network(client: Any, name: str, labels: dict[str, str] | None = None) -> str:
    """The internal bridge ``name`` (created once per engine, with ``labels``), with forwarding off on this host and
    what its containers initiate towards this host dropped; its id."""
    import docker.errors

    # Docker accepts two networks of one name, and then refuses the name as ambiguous: processes starting their
    # first sandbox at once take turns (a host-wide lock), and duplicates an older version made are removed.
    with host_lock("sandbox-network"):
        same = sorted((n for n in client.networks.list(names=[name]) if n.name == name),
                      key=lambda n: n.attrs.get("Created", ""))
        if not same:
            same = [client.networks.create(name, driver="bridge", internal=True,
                                           labels=labels or {SANDBOX_LABEL: "network"})]
        network = same[0]
        for extra in same[1:]:
            with contextlib.suppress(docker.errors.APIError):  # still has containers: left, and never used by name
                extra.remove()
    # Docker isolates internal networks with iptables rules, which a dockerd started with --iptables=false never
    # installs: the containers keep a default route. With forwarding off on the bridge the kernel routes nothing
    # they send beyond this host, whatever the firewall. Best effort: it needs root and a local engine.
    bridge = f"br-{network.id[:12]}"
    forwarding = Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding")
    with contextlib.suppress(OSError):
        if forwarding.read_text().strip() != "0":
            forwarding.write_text("0")
    # Forwarding off still lets containers open connections to this host itself (every service listening on all
    # interfaces, at the gateway address).
    drop_initiated(["-i", bridge])
    return network.id


def drop_initiated(source: list[str], *, netns_of: int | None = None) -> str | None:
    """Drop the TCP connections and UDP packets that what ``source`` matches (iptables: ``-i BRIDGE``, ``-s SUBNET``)
    initiates towards this host, or towards the network namespace of process ``netns_of``; connections made from here
    (SYN out, replies in without SYN) pass. Idempotent; needs root. Why a rule could not be set, else None."""
    iptables = ["iptables"] if netns_of is None else ["nsenter", "-t", str(netns_of), "-n", "iptables"]
    for rule in (["-p", "tcp", "--syn"], ["-p", "udp"]):
        spec = ["INPUT", *source, *rule, "-j", "DROP"]
        try:
            if subprocess.run([*iptables, "-C", *spec], capture_output=True).returncode == 0:
                continue
            done = subprocess.run([*iptables, "-I", *spec], capture_output=True, text=True)
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        if done.returncode:
            return done.stderr.strip()
    return None


class DockerSandbox(Sandbox):
    """An env image's server in a container of its own: ``await start()``, use ``url``/``exec``, ``await close()``."""

    kind = "docker"

    def __init__(self, image: str, *, limits: SandboxLimits | None = None, start_timeout_s: float = 30.0,
                 environment: dict[str, str] | None = None, command: Sequence[str] | None = None,
                 client: Any = None) -> None:
        super().__init__()
        self.image = image
        self.limits = limits or SandboxLimits()
        self.start_timeout_s = start_timeout_s
        self.environment = dict(environment or {})
        self.command = list(command) if command is not None else None
        """Overrides the image's command (tests use it to make a server that never becomes healthy)."""
        self.name = f"envkit-sb-{secrets.token_hex(6)}"
        self.owner = owner_id()
        self.token = secrets.token_urlsafe(24)
        self._client = client
        self._container: Any = None
        self._inflight: asyncio.Future[Any] | None = None
        self._http: httpx.AsyncClient | None = None

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking SDK call in a thread; a cancelled caller leaves it running, and cleanup awaits it."""
        future: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._inflight = future
        return await asyncio.shield(future)

    async def start(self) -> None:
        """Create and start the container, then wait for its server's ``/health`` within ``start_timeout_s``."""
        self._require(State.CREATED)
        self.state = State.STARTING
        deadline = time.monotonic() + self.start_timeout_s
        try:
            await self._thread(self._create_and_start)
            await wait_healthy(self.url, deadline=deadline, failed=self._exit_reason)
        except BaseException as e:
            # Shielded: a second cancellation must not interrupt the removal.
            await asyncio.shield(self._remove())
            if isinstance(e, SandboxError) or not isinstance(e, Exception):
                raise
            raise SandboxStartError(f"container {self.name} from {self.image} failed to start: "
                                    f"{type(e).__name__}: {e}") from e
        self.state = State.RUNNING
        self.started_at = time.monotonic()

    def _create_and_start(self) -> None:
        global _reaped
        client = self._client = self._client or connect()
        if not _reaped:  # once per process: containers left by owners that were killed before their cleanup
            _reaped = True
            reap_orphans(client)
        limits = self.limits
        network: dict[str, Any]
        if limits.network:
            network = {"ports": {f"{SERVER_PORT}/tcp": ("127.0.0.1", None)}}
        else:
            # Names resolve nowhere: without this the engine's DNS forwards queries out, a channel to the world.
            network = {"network": internal_network(client, sandbox_network()), "dns": ["127.0.0.1"]}
        tmpfs = f"rw,nosuid,nodev,size={limits.tmpfs_mb}m,nr_inodes={limits.tmpfs_inodes}"
        self._container = client.containers.create(
            self.image, command=self.command, name=self.name, detach=True,
            labels={SANDBOX_LABEL: "1", OWNER_LABEL: self.owner},
            environment={**self.environment, "ENVKIT_TOKEN": self.token, SANDBOX_ENV: self.kind,
                         EXEC_USER_ENV: str(EXEC_UID), SNAPSHOT_KEY_ENV: snapshot_key()},
            nano_cpus=int(limits.cpus * 1e9), mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m", pids_limit=limits.pids,
            read_only=True, working_dir="/", init=True,
            # The host polls /health itself. Docker's own check starts a python in every container every 10 s: 24
            # idle sandboxes took 21% of this 2-core machine with it, 3% without.
            healthcheck={"test": ["NONE"]},
            tmpfs={EXEC_DIR: f"{tmpfs},uid=0,gid={EXEC_UID},mode=0770", "/tmp": f"{tmpfs},mode=1777"},
            security_opt=["no-new-privileges"], cap_drop=["ALL"], cap_add=["SETUID", "SETGID", "KILL"], user="0:0",
            **network,
        )
        self._container.start()
        self._container.reload()
        settings = self._container.attrs["NetworkSettings"]
        if limits.network:
            host_port = settings["Ports"][f"{SERVER_PORT}/tcp"][0]["HostPort"]
            self.url = f"http://127.0.0.1:{host_port}"
        else:
            self.url = f"http://{settings['Networks'][sandbox_network()]['IPAddress']}:{SERVER_PORT}"

    async def _exit_reason(self) -> str | None:
        """Why the container can never serve (it exited), with the tail of its log; None while it runs."""
        def probe() -> str | None:
            if (why := self._ended()) is None:
                return None
            tail = self._container.logs(tail=20).decode(errors="replace").strip()
            return f"{why} before serving:\n{tail}"

        return await asyncio.to_thread(probe)

    async def lost(self) -> str | None:
        if self._container is None:
            return None
        return await asyncio.to_thread(self._ended)

    def _ended(self) -> str | None:
        """How the container ended, where it ran (this engine's host: a cluster node's name), and its limits; None
        while it runs."""
        import docker.errors

        try:
            self._container.reload()
        except docker.errors.NotFound:
            return f"sandbox container {self.name} on {socket.gethostname()} is gone (removed)"
        if self._container.status in ("created", "running"):
            return None
        state = self._container.attrs["State"]
        how = (f"was OOM-killed (its memory limit: {self.limits.memory_mb} MiB)" if state.get("OOMKilled")
               else f"exited with status {state.get('ExitCode')}")
        return f"sandbox container {self.name} ({self.image}) on {socket.gethostname()} {how}"

    async def _remove(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            with contextlib.suppress(BaseException):
                await inflight  # the container may exist only once this returns
        self.state = State.CLOSED
        if self._client is None:
            return
        await asyncio.to_thread(self._remove_by_name)

    def _remove_by_name(self) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            self._client.api.remove_container(self.name, force=True, v=True)
        self._container = None

    async def close(self) -> None:
        """Remove the container (killing whatever runs in it); idempotent."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self.state is State.CLOSED:
            return
        await self._remove()

    async def exec(self, code_or_cmd: str | Sequence[str], *, timeout: float = 10.0,  # noqa: ASYNC109
                   stdin: str | bytes = b"") -> ExecResult:
        """Run Python source or an argv in the container as ``EXEC_UID`` in ``/work``; killed after ``timeout`` s,
        with every process it started."""
        self._require(State.RUNNING)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body = {"argv": exec_argv(code_or_cmd), "stdin_b64": base64.b64encode(data).decode(), "timeout_s": timeout,
                "output_limit": self.limits.output_limit_bytes}
        with tracing.span("sandbox.exec", sandbox=self.name):
            result = ExecResult(**await self._post("/exec", body, timeout + EXEC_KILL_GRACE_S))
            tracing.annotate(exit_code=result.exit_code, timed_out=result.timed_out)
        return result

    async def scrub(self) -> bool:
        """Kill what ``exec`` left running and delete its files in ``/work`` and ``/tmp``; True when clean."""
        self._require(State.RUNNING)
        try:
            answer = await self._post("/exec/scrub", {}, 30.0)
        except SandboxError as e:
            log.warning("scrubbing %s failed: %s", self.name, e)
            return False
        if answer["processes"] or answer["files"]:
            log.warning("%s is not clean after a scrub: processes %s, files %s", self.name, answer["processes"],
                        answer["files"])
            return False
        return True

    async def save_files(self) -> bytes:
        """The container's ``/work`` as a tar, read by its server as the exec user."""
        self._require(State.RUNNING)
        return (await self._request("GET", FILES_ROUTE, FILES_TIMEOUT_S, refused=SnapshotError)).content

    async def load_files(self, archive: bytes) -> None:
        """Replace the container's ``/work`` with ``archive``'s files, written by its server as the exec user."""
        self._require(State.RUNNING)
        await self._request("PUT", FILES_ROUTE, FILES_TIMEOUT_S, refused=SnapshotError, content=archive)

    async def _post(self, route: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        return (await self._request("POST", route, timeout_s, json=body)).json()

    async def _request(self, method: str, route: str, timeout_s: float, *,
                       refused: type[Exception] = SandboxError, **body: Any) -> httpx.Response:
        """``method route`` on the container's server; a 422 or 500 (the server refused or failed the request
        itself) raises ``refused``, any other failure ``SandboxError``."""
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.url, headers={"authorization": f"Bearer {self.token}"})
        try:
            response = await self._http.request(method, route, timeout=timeout_s, **body)
        except httpx.HTTPError as e:
            raise SandboxError(f"{route} in {self.name} failed: {type(e).__name__}: {e}") from e
        if response.status_code not in (200, 204):
            error = refused if response.status_code in (422, 500) else SandboxError
            raise error(f"{method} {route} in {self.name} answered {response.status_code}: {response.text[:500]}")
        return response

    def __repr__(self) -> str:
        return f"<DockerSandbox {self.name} image={self.image} {self.state.value} url={self.url or '-'}>"

