"""envkit.untrusted on this host: runs as another uid die whole, output is capped, and the helper refuses misuse.
The container-side attacks (fork bombs, graders) are in test_sandbox_containment.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from envkit import untrusted

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
        assert result.stdout == b"left a daemon\n" and result.exit_code == 0 and not result.timed_out
        assert untrusted.processes_of(uid) == []


@needs_root
async def test_a_run_as_another_uid_cannot_read_this_process() -> None:
    async with untrusted.users.lease() as uid:
        probe = "import os; open(f'/proc/{os.getppid()}/environ')"
        result = await untrusted.run([untrusted.python(), "-I", "-c", probe], user=uid, timeout_s=10)
    assert result.exit_code == 1 and b"PermissionError" in result.stderr, result


async def test_output_is_capped_and_the_rest_drained() -> None:
    """20 MB of output against a 1 KiB cap: the writer never blocks on a full pipe, the cut is reported."""
    started = time.monotonic()
    result = await untrusted.run([untrusted.python(), "-I", "-c", "import sys; sys.stdout.write('x' * (20 << 20))"],
                                 output_limit=1024, timeout_s=30)
    assert result.exit_code == 0 and result.truncated and result.stdout == b"x" * 1024
    assert not result.timed_out and time.monotonic() - started < 30


async def test_the_deadline_kills_and_says_so() -> None:
    result = await untrusted.run(["sleep", "30"], timeout_s=0.5)
    assert result.timed_out and result.exit_code == -1 and result.duration_s < 5


def test_the_callers_own_processes_are_never_targets() -> None:
    with pytest.raises(ValueError, match="refusing"):
        untrusted.kill_user(0)
    with pytest.raises(ValueError, match="non-empty argv"):
        asyncio.run(untrusted.run([]))
