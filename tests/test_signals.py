"""`python -m trainer` ends cleanly on SIGTERM: the asyncio task in flight (rollouts holding sandboxes) is cancelled
and unwinds before the run's own cleanup, as on Ctrl-C, even where the process started with SIGINT ignored."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

RUN = """
import asyncio, os, signal
from generators.signals import exit_status, handled_signals

events = []

async def rollouts():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)
    finally:
        events.append("rollouts released their sandboxes")

runner = asyncio.Runner()
try:
    with handled_signals():
        runner.run(rollouts())
except KeyboardInterrupt:
    events.append(f"interrupted, exit status {exit_status()}")
finally:
    events.append("the run's cleanup")
    runner.close()
events.append(f"SIGTERM's handler given back: {signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}")
print(events)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_cancels_the_running_task_before_the_runs_cleanup(sigint: str):
    def setup() -> None:
        if sigint == "ignored":  # as a shell starts a background job
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    result = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, timeout=60,
                            preexec_fn=setup)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(["rollouts released their sandboxes", "interrupted, exit status 143",
                                         "the run's cleanup", "SIGTERM's handler given back: True"])
