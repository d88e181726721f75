"""A process running Command agents that is killed outright (SIGKILL, as the OOM killer or a lost Ray worker is)
leaves nothing running. Unisolated, its agent process dies with it, and what that agent started is killed by the next
process's first Command; a live process's agents are left alone. Isolated, the agent's namespace dies with it, a
child that made a session of its own included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

OWNER = """
import asyncio, sys
from envkit.agents.agent import AgentClient, Command
from envkit.agents.untrusted import python
client = AgentClient(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", episode_url="")
command = Command([python(), "-c", sys.argv[1]], timeout_s=600, isolate=sys.argv[2] == "isolated")
print(asyncio.run(command({"id": "t"}, client)))
"""
AGENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] if len(sys.argv) > 1 else {pids!r}, "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def owner(agent: str, mode: str = "unisolated") -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    return subprocess.Popen([sys.executable, "-c", OWNER, agent, mode], env=env, stdout=subprocess.PIPE, text=True)


def started(path: Path) -> tuple[int, int]:
    assert wait_for(lambda: path.exists() and path.read_text().count(" ") == 1, 30), "the agent did not start"
    agent, child = (int(p) for p in path.read_text().split())
    return agent, child


def test_an_owner_killed_outright_leaves_no_agent_process_behind(tmp_path):
    killed, live = tmp_path / "killed.pids", tmp_path / "live.pids"
    doomed = owner(AGENT.format(pids=str(killed)))
    survivor = owner(AGENT.format(pids=str(live)))
    try:
        agent, child = started(killed)
        live_agent, live_child = started(live)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()
        assert wait_for(lambda: not alive(agent)), "the agent outlived its owner (no parent-death signal)"
        assert alive(child)  # it left the agent's group behind: only the next owner can find it

        nxt = owner("print('done')")
        assert nxt.communicate(timeout=60)[0].strip() == "done" and nxt.returncode == 0
        assert wait_for(lambda: not alive(child)), "the next process's first Command did not kill the orphan"
        assert alive(live_agent) and alive(live_child), "a live owner's agent processes were killed"
    finally:
        for proc in (doomed, survivor):
            proc.kill()
            proc.wait()
        for path in (killed, live):
            for pid in (int(p) for p in (path.read_text().split() if path.exists() else [])):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


MARKED = """
import os, subprocess, sys
sleep = [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}]
subprocess.Popen(sleep, start_new_session=True)
os.execv(sys.executable, sleep)
"""


def test_an_isolated_agents_processes_die_with_an_owner_killed_outright():
    from agent_envs import marked

    marker = f"envkit-orphan-{os.getpid()}"
    doomed = owner(MARKED.format(marker=marker), "isolated")
    try:
        assert wait_for(lambda: len(marked(marker)) == 2, 30), "the agent did not start"
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()
        assert wait_for(lambda: not marked(marker)), "an isolated agent's process outlived its owner"
    finally:
        doomed.kill()
        doomed.wait()
        for process in marked(marker):
            process.kill()


def test_a_machine_that_cannot_isolate_agents_is_said_loudly(monkeypatch):
    """Where neither a uid switch nor a user namespace works, a Command still runs, unisolated, and says so once."""
    import asyncio

    import envkit.agents.agent
    from envkit.agents.agent import AgentClient, Command
    from envkit.agents.isolation import announce
    from envkit.agents.untrusted import python

    monkeypatch.setattr(envkit.agents.agent, "isolation", lambda: None)  # what `unshare --user` failing gives
    announce.cache_clear()
    client = AgentClient(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", episode_url="")
    with pytest.warns(RuntimeWarning, match="unisolated on this machine"):
        assert asyncio.run(Command([python(), "-c", "import os; print(os.getuid())"])({"id": "t"}, client)) == "0"
