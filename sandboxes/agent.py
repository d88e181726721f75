"""DockerCommand: an agent process (a coding CLI, a script on any SDK) in a container that reaches nothing but its
episode's gateway endpoint.

An :class:`~envkit.agents.agent.AgentEnv` takes it as its ``agent=``, as it takes :class:`envkit.Command`; the
episode runs::

    env = AgentEnv(agent=DockerCommand(["my-agent", "--quiet"], image="my-agent:1"), grader=...)

The container has no network at all (``network_mode=none``: loopback only). The one way out is a Unix socket this
process serves for the episode, bind-mounted read-only with the task: each connection to it is joined to the
episode's own gateway port (which refuses every other episode's key), and to nothing else. Inside,
:mod:`envkit.agents.relay` listens on ``127.0.0.1:RELAY_PORT`` and
relays to that socket, then runs the agent with ``OPENAI_BASE_URL`` (and ``ANTHROPIC_BASE_URL``) pointing at it and
the task as JSON on stdin; its stdout, stripped, is the result. It runs as an unprivileged user with every capability
dropped, a read-only root (``/tmp`` a small tmpfs) and CPU, memory and pids limits; past ``timeout_s``, or when its
rollout is cancelled, the container is killed. Either way it is removed, and one whose owner died is removed by the
sandbox reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envkit import Task
from envkit.agents.agent import AgentClient, program_result, task_variables
from envkit.agents.isolation import RELAY, RELAY_PORT, forward, relayed
from envkit.errors import AgentProcessError
from sandboxes.base import SandboxLimits, owner_id
from sandboxes.docker import OWNER_LABEL, SANDBOX_LABEL, STAGING_DIR_ENV, connect
from sandboxes.engine import BASE_IMAGE

MOUNT = "/envkit"
AGENT_USER = "65534:65534"
"""nobody: the agent holds no privilege in its container."""


@dataclass(frozen=True)
class DockerCommand:
    """An agent that is a process in a container of ``image`` (python3 on its PATH, for the relay), reaching only
    its episode's gateway (see the module doc). ``mounts`` maps host paths to container paths, bound read-only (the
    agent's code, say); ``env`` is added to the agent's environment."""

    argv: tuple[str, ...] | list[str]
    image: str = BASE_IMAGE
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    output_limit: int = 1 << 20
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    async def __call__(self, task: Task, client: AgentClient) -> str:
        """Run the agent's container for ``task``; raises :class:`~envkit.errors.AgentProcessError` if it fails or
        runs past ``timeout_s``."""
        document = json.dumps(task)
        workdir = Path(tempfile.mkdtemp(prefix="envkit-agent-", dir=os.environ.get(STAGING_DIR_ENV)))
        forwarder: asyncio.Server | None = None
        container = _Container(self, f"envkit-agent-{secrets.token_hex(6)}")
        try:
            forwarder = await forward(workdir / "gateway.sock", client.channel_url or client.base_url)
            _stage(workdir, document)
            status = await container.run({**self.env, **relayed(client.environ()), **task_variables(document)},
                                         workdir)
            stdout, stderr = await asyncio.to_thread(container.output)
        finally:
            await asyncio.shield(container.remove())
            if forwarder is not None:
                forwarder.close()
            shutil.rmtree(workdir, ignore_errors=True)
        what = f"agent container {self.argv[0]!r} ({self.image})"
        if status is None:
            raise AgentProcessError(f"{what} ran past {self.timeout_s:g} s and was killed")
        return program_result(what, status, stdout, stderr, self.output_limit)


def _stage(workdir: Path, document: str) -> None:
    """Put the task and the relay beside the gateway's socket, readable (the socket writable) by the agent's user."""
    (workdir / "task.json").write_text(document)
    shutil.copy(RELAY, workdir / RELAY.name)
    for path in workdir.iterdir():
        path.chmod(0o666 if path.name == "gateway.sock" else 0o444)
    workdir.chmod(0o755)


class _Container:
    """One agent container: created, waited on with a deadline, read, and removed whatever happened."""

    def __init__(self, command: DockerCommand, name: str) -> None:
        self.command, self.name = command, name
        self.client: Any = None
        self.starting: asyncio.Future | None = None

    async def run(self, environment: dict[str, str], workdir: Path) -> int | None:
        """Start it and wait for its exit status; None when it ran past the deadline (it is killed then)."""
        # shielded and kept: a cancelled rollout's remove() waits for the container to exist before removing it
        self.starting = asyncio.ensure_future(asyncio.to_thread(self._start, environment, workdir))
        await asyncio.shield(self.starting)
        waiting = asyncio.ensure_future(asyncio.to_thread(self.client.api.wait, self.name))
        try:
            return (await asyncio.wait_for(asyncio.shield(waiting), self.command.timeout_s))["StatusCode"]
        except TimeoutError:
            return None
        finally:
            if not waiting.done():
                await asyncio.shield(asyncio.to_thread(self._kill))
                with contextlib.suppress(Exception):
                    await asyncio.shield(waiting)

    def _start(self, environment: dict[str, str], workdir: Path) -> None:
        command, limits = self.command, self.command.limits
        self.client = connect()
        volumes = {str(workdir): {"bind": MOUNT, "mode": "ro"},
                   **{host: {"bind": inside, "mode": "ro"} for host, inside in command.mounts.items()}}
        self.client.containers.create(
            command.image, name=self.name, detach=True,
            command=["python3", f"{MOUNT}/{RELAY.name}", f"{MOUNT}/gateway.sock", str(RELAY_PORT),
                     "--task", f"{MOUNT}/task.json", "--", *command.argv],
            environment=environment, volumes=volumes, network_mode="none", user=AGENT_USER, working_dir="/tmp",
            labels={SANDBOX_LABEL: "agent", OWNER_LABEL: owner_id()},
            nano_cpus=int(limits.cpus * 1e9), mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m", pids_limit=limits.pids, read_only=True, init=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmpfs_mb}m,nr_inodes={limits.tmpfs_inodes},mode=1777"},
            security_opt=["no-new-privileges"], cap_drop=["ALL"], healthcheck={"test": ["NONE"]},
            # a flood of output stops at twice what is read back: enough to tell it overflowed
            log_config={"type": "json-file", "config": {"max-size": str(2 * command.output_limit), "max-file": "1"}},
        ).start()

    def _kill(self) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            self.client.api.kill(self.name)

    def output(self) -> tuple[bytes, bytes]:
        """What the agent wrote to stdout, and the tail of its stderr."""
        return (self.client.api.logs(self.name, stdout=True, stderr=False),
                self.client.api.logs(self.name, stdout=False, stderr=True, tail=20))

    async def remove(self) -> None:
        import docker.errors

        if self.starting is not None:
            with contextlib.suppress(Exception):
                await self.starting
        if self.client is None:
            return
        with contextlib.suppress(docker.errors.NotFound):
            await asyncio.to_thread(self.client.api.remove_container, self.name, force=True, v=True)
