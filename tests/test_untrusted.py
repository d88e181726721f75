"""envkit.agents.untrusted on this host: runs as another uid die whole, output is capped, and the helper refuses misuse.
The container-side attacks (fork bombs, graders) are in test_sandbox_containment.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from remote_envs import envkit_serve, free_port

from envkit.agents import untrusted

ESCAPE = """
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            pass
    os._exit(0)
print("left a daemon")
"""

needs_root = pytest.mark.skipif(not untrusted.can_switch_user(),
                                reason="running code as another uid needs root with CAP_SETUID/SETGID/KILL")


@needs_root
async def test_a_daemon_in_a_new_session_dies_with_the_run() -> None:
    async with untrusted.users.lease() as uid:
        assert uid is not None
        result = await untrusted.run([untrusted.python(), "-I", "-c", ESCAPE], user=uid, timeout_s=10)
        assert result.stdout == b"left a daemon\n" and result.exit_code == 0 and not result.timed_out, result
        assert untrusted.processes_of(uid) == []


LINGER = """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(3)
    os._exit(0)
print("left a lingerer", flush=True)
"""


async def test_what_a_run_printed_is_kept_when_a_process_it_left_holds_its_pipe() -> None:
    """Without a uid of its own, a process that left the run's group outlives the run holding its stdout: the reads
    give up a moment after the run (here long before the 3 s it lingers), and what was read by then is returned."""
    result = await untrusted.run([sys.executable, "-I", "-c", LINGER], timeout_s=10)
    assert result.stdout == b"left a lingerer\n" and result.exit_code == 0, result


@needs_root
async def test_a_process_the_scan_cannot_see_dies_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan of /proc can miss a process: a child forked after the scan read the listing, whose parent exited
    before the scan read its status (under load, 3 of 40 daemons of the test above outlived a kill by scans alone),
    and a process that forks and exits without end gives every scan that chance. With the scans blind to it,
    kill_user still kills it (kill(-1) as the uid); the scans alone leave it running."""
    seen = untrusted.processes_of
    hidden_pid = [0]

    def blind(uid: int | None, **kwargs: bool) -> list[int]:
        return [pid for pid in seen(uid, **kwargs) if pid not in hidden_pid]

    async with untrusted.users.lease() as uid:
        assert uid is not None
        hidden = await asyncio.create_subprocess_exec(*untrusted._as_user(uid, ["sleep", "60"]),
                                                      env=dict(untrusted.SAFE_ENV))
        try:
            with monkeypatch.context() as patch:
                hidden_pid[0] = hidden.pid
                patch.setattr(untrusted, "processes_of", blind)
                untrusted._kill_seen(uid, time.monotonic() + 5)  # what kill_user did alone before
                assert hidden.returncode is None and seen(uid) == [hidden.pid]  # the positive control: it lives
                untrusted.kill_user(uid)
            assert await asyncio.wait_for(hidden.wait(), 5) == -signal.SIGKILL and seen(uid) == []
        finally:
            if hidden.returncode is None:
                hidden.kill()


@needs_root
async def test_a_run_as_another_uid_cannot_read_this_process() -> None:
    async with untrusted.users.lease() as uid:
        probe = "import os; open(f'/proc/{os.getppid()}/environ')"
        result = await untrusted.run([untrusted.python(), "-I", "-c", probe], user=uid, timeout_s=10)
    assert result.exit_code == 1 and b"PermissionError" in result.stderr, result


HOLDER = """
import asyncio, subprocess
from envkit.agents import untrusted

async def main():
    async with untrusted.users.lease() as uid:
        subprocess.Popen(["sleep", "60"], user=uid, group=uid, start_new_session=True, stdout=subprocess.DEVNULL)
        print(uid, flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


@needs_root
async def test_a_uid_leased_in_one_process_is_not_handed_out_by_another_and_its_leftovers_die() -> None:
    """Every process has a pool of its own. One used to hand out the uid another held: two xdist workers' local
    sandboxes ran as one uid, and one's close killed the other's running exec. A holder killed mid-run leaves a
    process as its uid; the next lease of that uid kills it first."""
    holder = await asyncio.create_subprocess_exec(sys.executable, "-c", HOLDER, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        held = int(await asyncio.wait_for(holder.stdout.readline(), 60))
        async with untrusted.users.lease() as ours:
            assert ours is not None and ours != held
    finally:
        holder.kill()
        await holder.wait()
    assert untrusted.processes_of(held)  # orphaned, still running as the uid
    async with untrusted.UserPool(first=held, count=1).lease() as again:
        assert again == held and untrusted.processes_of(held) == []


async def test_output_is_capped_and_the_rest_drained() -> None:
    """20 MB of output against a 1 KiB cap: the writer never blocks on a full pipe, the cut is reported."""
    result = await untrusted.run([untrusted.python(), "-I", "-c", "import sys; sys.stdout.write('x' * (20 << 20))"],
                                 output_limit=1024, timeout_s=30)
    assert result.exit_code == 0 and result.truncated and result.stdout == b"x" * 1024
    # The writer finished on its own: one blocked on a full pipe would be killed at the 30 s deadline instead.
    assert not result.timed_out


async def test_the_deadline_kills_and_says_so() -> None:
    # The flag and the exit code say the deadline fired. The 30 s guard only ends a run that waits for the sleep
    # instead of killing it: 60x the 0.5 s deadline, and the 600 s sleep is 20x beyond it.
    result = await asyncio.wait_for(untrusted.run(["sleep", "600"], timeout_s=0.5), 30)
    assert result.timed_out and result.exit_code == -1


def test_the_callers_own_processes_are_never_targets() -> None:
    with pytest.raises(ValueError, match="refusing"):
        untrusted.kill_user(0)
    with pytest.raises(ValueError, match="non-empty argv"):
        asyncio.run(untrusted.run([]))


@needs_root
def test_exec_routes_of_a_served_env_against_hostile_clients() -> None:
    """`envkit serve --exec-user` on loopback: no token, a wrong token, malformed bodies and missing programs get a
    structured 4xx and the server stays up; only the token holder runs anything. Serving it without a token is
    refused, since /exec runs any command."""
    refused = subprocess.run([sys.executable, "-m", "envkit.cli", "serve", "arithmetic", "--exec-user", "29999",
                              "--port", str(free_port())], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "ENVKIT_TOKEN": ""})
    assert refused.returncode == 2 and "needs a token" in refused.stdout + refused.stderr
    workdir = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is root's alone: uid 29999 could not enter it
    os.chown(workdir, 29999, 29999)
    with envkit_serve("arithmetic", "--exec-user", "29999", "--exec-dir", str(workdir),
                      env={"ENVKIT_TOKEN": "exec-token"}) as server:
        run = {"argv": ["sh", "-c", "id -u; pwd; touch made"]}
        for headers in ({}, {"authorization": "Bearer wrong"}):
            answer = httpx.post(f"{server.url}/exec", json=run, headers=headers, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"
        assert not (workdir / "made").exists()
        auth = {"authorization": "Bearer exec-token"}
        for body in ({"argv": []}, {"argv": ["true"], "stdin_b64": "%%"}, {"argv": ["true"], "timeout_s": -1},
                     {"argv": "true"}, {"argv": ["true"], "output_limit": 1 << 40}):
            answer = httpx.post(f"{server.url}/exec", json=body, headers=auth, timeout=10)
            assert answer.status_code == 422 and answer.json()["error"]["code"] == "validation_error", answer.text
        missing = httpx.post(f"{server.url}/exec", json={"argv": ["no-such-program"]}, headers=auth, timeout=10)
        assert missing.status_code == 200 and missing.json()["exit_code"] == 127, missing.text
        answer = httpx.post(f"{server.url}/exec", json=run, headers=auth, timeout=10).json()
        assert answer["stdout"].split() == ["29999", str(workdir)] and (workdir / "made").exists()
        assert httpx.post(f"{server.url}/exec/scrub", headers=auth, timeout=10).json()["files"] == []
        assert not (workdir / "made").exists()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    shutil.rmtree(workdir, ignore_errors=True)
