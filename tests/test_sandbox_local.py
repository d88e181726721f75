"""The local-process sandbox (no Docker): same interface, `envkit serve` as a child process, and the automatic
fallback to it when no engine is reachable."""

from __future__ import annotations

import logging
import os
import time

import pytest

import envkit
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
        started = time.monotonic()
        result = await sandbox.exec(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.5)
        assert result.timed_out and time.monotonic() - started < 3
        pid = sandbox._proc.pid
    assert sandbox.state.value == "closed"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(SandboxStateError):
        await sandbox.exec("print(1)")


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
