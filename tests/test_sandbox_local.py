"""The local-process sandbox (no Docker): same interface, `envkit serve` as a child process, and the automatic
fallback to it when no engine is reachable."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from archives import hostile_archives, setuid_archive

import envkit
from envkit.errors import SnapshotError
from envkit.remote import RemoteConfig
from sandboxes.base import SandboxStartError, SandboxStateError
from sandboxes.local import LocalSandbox


async def test_local_sandbox_serves_an_env_and_runs_commands() -> None:
    sandbox = LocalSandbox("arithmetic")
    async with sandbox:
        assert await sandbox.alive()
        env = envkit.make(f"{sandbox.url}/arithmetic", remote=RemoteConfig(token=sandbox.token))
        messages, _ = await env.reset(seed=0)
        assert messages[-1]["content"] == "What is 4 + 5?"
        await env.close()
        result = await sandbox.exec("import os; print(os.environ['ENVKIT_SANDBOX'])", stdin="")
        assert (result.stdout, result.exit_code) == ("local\n", 0)
        # Killed at the timeout, with what it started: events, not a clock. An ignored timeout would let sh finish
        # (timed_out False); a kill that missed the background sleep would leave its pid running.
        result = await sandbox.exec(["sh", "-c", "sleep 600 & echo $!; sleep 600"], timeout=0.5)
        assert result.timed_out and result.exit_code == -1, result
        # Polled for up to 10 s only to end a failing run: a process that escaped the kill lives for 600 s.
        assert _wait_gone([int(result.stdout)], 10) == [], result
        pid = sandbox._proc.pid
    assert sandbox.state.value == "closed"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(SandboxStateError):
        await sandbox.exec("print(1)")


async def test_a_local_sandboxs_files_load_into_another_and_hostile_archives_write_nothing_outside() -> None:
    """A sandbox's files (what a snapshot of its env holds besides the env's state) replace another's, directories'
    modes and symlinks kept; an archive that would write outside the directory, or make a device, is refused whole
    (nothing of it is written) and the host's /tmp never sees its file; setuid bits are dropped."""
    marker = f"envkit-archive-{uuid.uuid4().hex}"
    async with LocalSandbox("arithmetic") as first, LocalSandbox("arithmetic") as second:
        made = await first.exec(["sh", "-c", "mkdir d && echo 42 > d/n && ln -s d/n link && chmod 750 d"])
        assert made.exit_code == 0, made
        await second.exec(["sh", "-c", "echo mine > mine"])
        await second.load_files(await first.save_files())
        assert (await second.exec(["sh", "-c", "ls -A; cat link; stat -c %a d"])).stdout == "d\nlink\n42\n750\n"
        for attack, archive in hostile_archives(marker).items():
            with pytest.raises(SnapshotError, match="refused archive member"):
                await second.load_files(archive)
            landed = [Path(d, marker) for d in ("/tmp", tempfile.gettempdir())]
            assert not any(await asyncio.to_thread(lambda: [p.exists() for p in landed])), attack  # noqa: B023
            assert (await second.exec(["ls", "-A"])).stdout == "", attack  # refused whole: not even `before`
        await second.load_files(setuid_archive())
        assert (await second.exec(["stat", "-c", "%a", "tool"])).stdout == "755\n"
        await second.load_files(b"")  # an empty sandbox's archive: nothing left
        assert (await second.exec(["ls", "-A"])).stdout == "" and await first.save_files() != b""


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (read from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            children.append(int(stat.parent.name))
    return children


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped yet counts: an orphan's reaper may be slow or absent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


async def test_closing_a_served_code_env_s_sandbox_stops_the_sandboxes_its_tools_opened() -> None:
    """compute served from a local sandbox runs its tools in local sandboxes of its own, each a session of its own
    that killing the server's process group misses: closing lets the server close them first (they were orphaned)."""
    sandbox = LocalSandbox("compute", options=["--kwargs", json.dumps({"code_sandbox": "local", "pool_size": 2})])
    async with sandbox:
        env = envkit.make(f"{sandbox.url}/compute", remote=RemoteConfig(token=sandbox.token))
        await env.reset(seed=0)
        code = json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
        [output] = (await env.step(envkit.assistant(f"<tool_call>{code}</tool_call>"))).observation
        assert output["role"] == "tool" and output["content"].strip() == "42"
        await env.close()
        runners = _children(sandbox._proc.pid)
        assert runners  # the tools' pool
    assert _wait_gone(runners, 0) == []


_OWNER = """
import asyncio, sys
from sandboxes.local import LocalSandbox

async def main():
    sandbox = LocalSandbox("arithmetic")
    await sandbox.start()
    print(sandbox._proc.pid, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


def test_a_local_sandbox_s_server_ends_when_its_owner_is_killed() -> None:
    """A SIGKILLed owner closes nothing: the server notices it was orphaned and shuts down (closing its envs)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        server = int(owner.stdout.readline())
        assert not _gone(server)
    finally:
        owner.kill()
        owner.wait()
    assert _wait_gone([server], 15) == []


async def test_an_env_ref_borrows_its_sandbox_from_the_pool_opened_for_it() -> None:
    from sandboxes.env import open_pool_for

    ref = envkit.EnvRef("arithmetic", {"level": 1}, sandbox="local")
    pool = await open_pool_for(ref, size=1)
    try:
        servers = set()
        for seed in (0, 1):
            async with ref.with_pool(pool).make() as env:
                messages, _ = await env.reset(seed=seed)
                assert "What is" in messages[-1]["content"]
                servers.add(env.env.sandbox.url)
            assert pool.idle == 1  # given back, not closed
        assert len(servers) == 1  # both episodes ran on the pool's one server
    finally:
        await pool.close()
    with pytest.raises(ValueError, match="is not sandboxed"):
        await open_pool_for(envkit.EnvRef("arithmetic"), size=1)


async def test_local_sandbox_start_failure_is_reported() -> None:
    with pytest.raises(SandboxStartError, match="exited with status"):
        await LocalSandbox("no-such-env", start_timeout_s=30).start()


async def test_auto_falls_back_to_local_when_no_engine(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with caplog.at_level(logging.WARNING, logger="sandboxes.env"):
        env = envkit.make("arithmetic", sandbox="auto", level=1)
    assert "no Docker engine reachable" in caplog.text and "local process sandbox" in caplog.text
    try:
        await env.reset(seed=0)
        assert (await env.step(envkit.assistant("9"))).reward == 1.0
        assert env.env.sandbox.kind == "local"
    finally:
        await env.close()


def test_unknown_sandbox_kind_says_which_exist() -> None:
    with pytest.raises(envkit.errors.EnvLoadError, match=r"unknown sandbox 'podman' \(known: auto, docker, local\)"):
        envkit.make("arithmetic", sandbox="podman")
