"""OOM-kill a sandbox container for real: its env server is made the kernel's first choice (``oom_score_adj`` 1000,
set from this host), then a process inside allocates past the container's memory limit. The kernel's OOM killer
ends the server, the container exits, and Docker records ``OOMKilled``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil


def oom_kill(container: Any) -> None:
    """OOM-kill ``container`` (a sandbox: docker's init, then the env server); returns once Docker says so."""
    container.reload()
    for server in psutil.Process(container.attrs["State"]["Pid"]).children():
        Path(f"/proc/{server.pid}/oom_score_adj").write_text("1000")
    limit_mb = container.attrs["HostConfig"]["Memory"] // 2**20
    container.exec_run(["python3", "-c", f"bytearray({limit_mb + 64} * 2**20)"])
    deadline = time.monotonic() + 30  # Docker records the exit a moment after the kill; a hang guard
    while container.status == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
        container.reload()
    assert container.attrs["State"]["OOMKilled"], container.attrs["State"]
