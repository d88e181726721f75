"""Containment on the real engine: each attack runs in a tightly limited container, bounded in time, and must leave
the host, the attacked sandbox's own server, and a bystander sandbox working."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

pytest.importorskip("docker", reason="the docker SDK is not installed: pip install 'envkit[docker]'")

from sandboxes.base import SandboxLimits
from sandboxes.docker import DockerSandbox

TIGHT = SandboxLimits(cpus=0.5, memory_mb=128, pids=48, tmpfs_mb=8)


@pytest.fixture(scope="module")
async def victim(docker_client, arithmetic_image):
    """The container the attacks run in."""
    async with DockerSandbox(arithmetic_image, limits=TIGHT) as sb:
        yield sb


@pytest.fixture(scope="module")
async def bystander(docker_client, arithmetic_image):
    """Another sandbox that must not notice the attacks."""
    async with DockerSandbox(arithmetic_image, limits=TIGHT) as sb:
        yield sb


async def _unaffected(victim: DockerSandbox, bystander: DockerSandbox) -> None:
    assert await victim.alive(), "the attacked sandbox's own env server died"
    assert (await bystander.exec("print(6 * 7)", timeout=10)).stdout == "42\n"
    host = await asyncio.create_subprocess_exec("true")  # the host can still start processes
    assert await asyncio.wait_for(host.wait(), 5) == 0


async def test_fork_bomb_is_contained(victim, bystander) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    async with asyncio.timeout(30):
        result = await victim.exec(bomb, timeout=3)
        assert result.timed_out
        # The kill took the whole process group: only the server and init are left.
        left = await victim.exec("import os; print(sum(p.isdigit() for p in os.listdir('/proc')))", timeout=10)
        assert int(left.stdout) <= 6, left
        await _unaffected(victim, bystander)


async def test_memory_bomb_is_contained(victim, bystander) -> None:
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))"
    async with asyncio.timeout(30):
        result = await victim.exec(bomb, timeout=20)
        assert result.exit_code != 0 and not result.timed_out, result  # OOM-killed or MemoryError, not stuck
        await _unaffected(victim, bystander)


async def test_infinite_loop_is_killed_at_the_timeout(victim, bystander) -> None:
    async with asyncio.timeout(15):
        result = await victim.exec("while True:\n    pass", timeout=1.5)
        assert result.timed_out and 1.5 <= result.duration_s < 5
        await _unaffected(victim, bystander)


async def test_network_egress_is_blocked(victim, bystander) -> None:
    probe = """
import socket, threading
answers = []
def resolve():
    try:
        socket.getaddrinfo("pypi.org", 443)
        answers.append("RESOLVED pypi.org")
    except OSError as e:
        answers.append(f"blocked dns {type(e).__name__}")
threading.Thread(target=resolve, daemon=True).start()
for target in [("1.1.1.1", 53), ("8.8.8.8", 443), ("151.101.0.223", 443)]:
    try:
        socket.create_connection(target, timeout=2).close()
        print("REACHED", target)
    except OSError as e:
        print("blocked", target, type(e).__name__)
print(answers[0] if answers else "blocked dns (no answer)")
"""
    async with asyncio.timeout(30):
        result = await victim.exec(probe, timeout=15)
        assert "REACHED" not in result.stdout and "RESOLVED" not in result.stdout, result
        assert result.stdout.count("blocked") == 4, result
        await _unaffected(victim, bystander)


async def test_services_on_the_host_are_unreachable(docker_client, victim, bystander) -> None:
    """A host service listening on every interface: the host reaches it, the sandbox (at the gateway) does not."""
    from sandboxes.docker import INTERNAL_NETWORK

    gateway = docker_client.networks.get(INTERNAL_NETWORK).attrs["IPAM"]["Config"][0]["Gateway"]
    server = await asyncio.start_server(lambda reader, writer: writer.close(), host="0.0.0.0", port=0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(gateway, port), 5)  # the host itself can
        writer.close()
        probe = f"""
import socket
try:
    socket.create_connection(("{gateway}", {port}), timeout=2).close()
    print("REACHED")
except OSError as e:
    print("blocked", type(e).__name__)
"""
        async with asyncio.timeout(30):
            result = await victim.exec(probe, timeout=15)
        assert result.stdout.startswith("blocked"), result
        await _unaffected(victim, bystander)
    finally:
        server.close()
        await server.wait_closed()


async def test_writes_outside_the_workdir_fail_and_never_reach_the_host(victim, bystander) -> None:
    marker = f"envkit-containment-{uuid.uuid4().hex}"
    probe = f"""
import os
for path in ["/etc/{marker}", "/usr/{marker}", "/opt/envkit/{marker}", "/{marker}", "/work/{marker}",
             "/tmp/{marker}"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
"""
    async with asyncio.timeout(30):
        result = await victim.exec(probe, timeout=10)
        wrote = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("wrote")]
        assert wrote == [f"/work/{marker}", f"/tmp/{marker}"], result  # only the container's own tmpfs
        host_paths = [Path(d, marker) for d in ("/etc", "/usr", "/opt", "/", "/work", "/tmp")]
        assert not any(await asyncio.to_thread(lambda: [p.exists() for p in host_paths]))
        full = await victim.exec("open('/work/big', 'wb').write(b'x' * (64 << 20))", timeout=10)
        assert full.exit_code != 0 and "No space left" in full.stderr  # the tmpfs has a size limit
        await victim.exec(["sh", "-c", "rm -f /work/* /tmp/envkit-containment-*"], timeout=5)
        await _unaffected(victim, bystander)
