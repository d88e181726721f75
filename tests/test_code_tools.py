"""The python/bash tools for agents (sandboxes.tools) and the compute env that uses them, on the real Docker engine:
state within an episode, timeouts, output caps, a clean container for the next episode, graders out of reach,
and infrastructure failures failing the rollout. (Compute's episodes in the generator's loop on vLLM are the agent
recipe's test's, tests/test_agent_recipe.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

import envkit
from envkit import assistant
from sandboxes.base import SandboxError, owner_id
from sandboxes.docker import OWNER_LABEL
from sandboxes.tools import CodeTools, PythonTool, close_code_pools, code_pool


def call(name: str, **arguments: str) -> envkit.Message:
    return assistant(f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>")


class Probe(CodeTools):
    """A tool env with one pooled sandbox and a short timeout; the task is 'answer 1'."""

    code_sandbox = "docker"
    code_timeout_s = 2.0
    code_pool_size = 1
    code_output_chars = 300

    async def start_episode(self, *, seed, task):
        return [envkit.user("Run code, then answer 1.")], {}

    async def grade(self, answer):
        return float(answer.strip() == "1"), {}


async def tool_output(env: envkit.Env, name: str, **arguments: str) -> str:
    result = await env.step(call(name, **arguments))
    assert not (result.terminated or result.truncated)
    [message] = result.observation
    assert message["role"] == "tool" and message["name"] == name
    return message["content"]


def _ours(client) -> list:
    return client.containers.list(all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner_id()}"})


async def test_an_episode_keeps_its_files_between_calls_and_the_next_gets_a_clean_container(docker_client) -> None:
    env = Probe()
    try:
        await env.reset()
        assert [t.name for t in env.tools] == ["bash", "python"]
        host = await tool_output(env, "bash", command="hostname; id -u; pwd")
        assert host.splitlines()[1:] == ["1000", "/work"]
        await tool_output(env, "python", code="open('notes.txt', 'w').write('42'); open('/tmp/t', 'w').write('x')")
        assert await tool_output(env, "bash", command="cat notes.txt /tmp/t") == "42x"
        # a sleeper started by one call is gone before the next: only files carry over
        await tool_output(env, "bash", command="setsid sleep 300 & disown; nohup sleep 300 >/dev/null 2>&1 &")
        # Live ones: a killed sleeper stays a zombie until the container's init reaps it, which may be after the
        # next call starts (seen once in a full run: "['18', '19']").
        others = ("import os\n"
                  "def live(p):\n"
                  "    try:\n"
                  "        state = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
                  "        return os.stat(f'/proc/{p}').st_uid == 1000 and state != 'Z'\n"
                  "    except OSError:\n"
                  "        return False\n"
                  "print([p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid() and live(p)])")
        assert await tool_output(env, "python", code=others) == "[]"
        result = await env.step(assistant("1"))
        assert (result.reward, result.terminated) == (1.0, True)
        # The next episode gets the same (pool of one) container back, scrubbed.
        await env.reset()
        assert (await tool_output(env, "bash", command="hostname")).splitlines()[0] == host.splitlines()[0]
        assert await tool_output(env, "bash", command="ls -A /work /tmp") == "/tmp:\n\n/work:"
    finally:
        await env.close()
        await close_code_pools()
    assert not _ours(docker_client)


class Pair(Probe):
    """Probe with room for two episodes' sandboxes at once."""

    code_pool_size = 2


async def test_a_snapshot_holds_the_episodes_files_and_a_restore_leases_a_sandbox_holding_them(docker_client):
    """A code-tool episode snapshotted mid-episode: another env restored from it works in a sandbox of its own that
    holds the files the code had made by then and none of its own (the one it held went back to the pool, which
    scrubbed it, and may lend it again); the original goes on in its own; a snapshot from before any code call
    restores with no sandbox leased."""
    env, fork = Pair(), Pair()
    try:
        await asyncio.gather(env.reset(), fork.reset())
        early = await env.snapshot()
        await tool_output(env, "bash", command="mkdir d && echo 42 > d/n && ln -s d/n link")
        snapshot = await env.snapshot()
        await tool_output(env, "bash", command="rm -r d link && echo later > later")
        await tool_output(fork, "bash", command="echo mine > mine")
        await fork.restore(snapshot)
        assert fork._lease[1] is not env._lease[1]
        assert await tool_output(fork, "bash", command="ls -A; cat link") == "d\nlink\n42"
        assert await tool_output(env, "bash", command="ls -A") == "later"
        assert fork.turn == env.turn - 1  # the attributes came back too: one call fewer than the original
        result = await fork.step(assistant("1"))
        assert (result.reward, result.terminated, fork._lease) == (1.0, True, None)
        await env.restore(early)
        assert env._lease is None and env.turn == 0
        assert await tool_output(env, "bash", command="ls -A /work") == "[no output]"
    finally:
        await asyncio.gather(env.close(), fork.close())
        await close_code_pools()
    assert not _ours(docker_client)


async def test_each_call_reports_how_it_went_and_where_it_ran(docker_client) -> None:
    env = Probe()
    cases = [("python", {"code": "print(1)"}, "ok"), ("python", {"code": "1/0"}, "error"),
             ("bash", {"command": "exit 3"}, "error"), ("python", {"code": "import time; time.sleep(60)"}, "timeout"),
             ("python", {"source": "print(1)"}, "error")]  # the last never reaches the sandbox: a wrong argument
    try:
        await env.reset()
        for name, arguments, status in cases:
            result = await env.step(call(name, **arguments))
            [entry] = result.info["tool_results"]
            assert (entry["name"], entry["status"]) == (name, status), (arguments, entry)
            ran = "source" not in arguments
            assert (entry.get("sandbox"), entry.get("exec_s", 0) > 0) == (("docker", True) if ran else (None, False))
    finally:
        await env.close()
        await close_code_pools()


async def test_timeouts_output_caps_and_errors_reach_the_model_as_text(docker_client) -> None:
    env = Probe()
    try:
        await env.reset()
        out = await tool_output(env, "python", code="import time\nprint('started', flush=True)\ntime.sleep(60)")
        assert out == "started\n[killed after 2 s]"
        out = await tool_output(env, "python", code="print('x' * 10**6)")  # 1 MB against a 16 KiB sandbox cap
        assert out.startswith("x" * 300) and out.endswith("more characters cut]") and len(out) < 400
        out = await tool_output(env, "python", code="1/0")
        assert "ZeroDivisionError" in out and out.endswith("[exit code 1]")
        assert await tool_output(env, "bash", command="exit 3") == "[exit code 3]"
        out = await tool_output(env, "bash", command="true")
        assert out == "[no output]"
        result = await env.step(call("python", source="print(1)"))
        assert result.observation[0]["content"] == "Error: missing required argument(s): code"
    finally:
        await env.close()
        await close_code_pools()


async def test_tool_code_cannot_reach_the_env_or_its_grader(docker_client) -> None:
    env = envkit.make("compute")
    try:
        _, info = await env.reset(seed=3)
        answer = info["task"]["answer"]
        probes = {
            "import": "import envkit_compute",
            "package files": "import glob; print(glob.glob('/opt/envkit/**/envkit_compute*', recursive=True))",
            "answer anywhere": f"import os; print([p for p in ('/proc/1/environ', '/proc/1/cmdline') "
                               f"if str({answer}) in open(p, errors='replace').read()])",
        }
        outputs = {name: await tool_output(env, "python", code=code) for name, code in probes.items()}
        assert "ModuleNotFoundError" in outputs["import"]
        assert "PermissionError" in outputs["package files"] or outputs["package files"] == "[]"
        assert "PermissionError" in outputs["answer anywhere"] or outputs["answer anywhere"] == "[]"
        # The question is in the conversation; the answer is nowhere in the container.
        assert str(answer) not in json.dumps(outputs)
    finally:
        await env.close()
        await close_code_pools()


async def test_a_dead_sandbox_fails_the_rollout_instead_of_talking_to_the_model(docker_client) -> None:
    class PythonOnly(PythonTool):
        code_sandbox = "docker"
        code_pool_size = 1
        start_episode, grade = Probe.start_episode, Probe.grade

    env = PythonOnly()
    assert [t.name for t in env.tools] == ["python"]
    try:
        await env.reset()
        await tool_output(env, "python", code="print(1)")
        assert env._lease is not None
        docker_client.containers.get(env._lease[1].name).kill()
        with pytest.raises(SandboxError):
            await env.step(call("python", code="print(2)"))
    finally:
        await env.close()
        await close_code_pools()
    assert not _ours(docker_client)  # the dead container was retired, not recycled


async def test_concurrent_first_calls_share_one_pool(docker_client) -> None:
    try:
        first, second = await asyncio.gather(*(code_pool("docker", size=1) for _ in range(2)))
        assert first is second
    finally:
        await close_code_pools()
    assert not _ours(docker_client)


def test_the_pool_is_drained_when_the_event_loop_shuts_down(docker_client) -> None:
    async def episode() -> str:
        env = Probe()
        await env.reset()
        return await tool_output(env, "bash", command="echo ok")  # the episode never ends: no release, no close

    assert asyncio.run(episode()) == "ok"
    assert not _ours(docker_client)
