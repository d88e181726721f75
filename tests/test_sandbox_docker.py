"""DockerSandbox against the real engine: an env in a container, cleanup on every failure path, the reaper, the
warm pool, exec, and the code env whose submissions run only in containers."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from oom import oom_kill

import envkit
from envkit.errors import EnvLoadError
from sandboxes.base import EXEC_UID, SandboxLost, SandboxStartError, SandboxStateError
from sandboxes.docker import DockerSandbox, reap_orphans
from sandboxes.pool import SandboxPool

REPO = Path(__file__).resolve().parents[1]


def _exists(client, name: str) -> bool:
    return bool(client.containers.list(all=True, ignore_removed=True, filters={"name": f"^{name}$"}))


def _ours(client) -> dict[str, str]:
    """Every container this test process started, by name: its status."""
    from sandboxes.base import owner_id
    from sandboxes.docker import OWNER_LABEL

    return {c.name: c.status for c in client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner_id()}"})}


async def test_env_runs_in_its_own_container(docker_client, arithmetic_image) -> None:
    env = envkit.make("arithmetic", sandbox="docker", level=1)
    try:
        messages, _ = await env.reset(seed=0)
        assert messages[-1]["content"] == "What is 4 + 5?"
        result = await env.step(envkit.assistant("The answer is 9."))
        assert (result.reward, result.terminated) == (1.0, True)
        sandbox = env.env.sandbox  # ContractChecker -> SandboxedEnv
        assert _exists(docker_client, sandbox.name)
        container = docker_client.containers.get(sandbox.name)
        host = container.attrs["HostConfig"]
        assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"] and host["PidsLimit"] == 128
        # root for the server, but only the capabilities it needs to run exec'd code as another uid and kill it
        assert sorted(host["CapAdd"]) == ["CAP_KILL", "CAP_SETGID", "CAP_SETUID"] or sorted(host["CapAdd"]) == [
            "KILL", "SETGID", "SETUID"]
        assert container.attrs["Config"]["User"] == "0:0"
        assert "no-new-privileges" in host["SecurityOpt"]
        assert container.image.labels["org.envkit.env"] == "arithmetic"
        # the image checks its health for standalone use; a sandbox leaves that to the host's /health polls, which
        # costs no process in the container every 10 s
        assert container.image.attrs["Config"]["Healthcheck"]["Test"][0] == "CMD"
        assert container.attrs["Config"]["Healthcheck"]["Test"] == ["NONE"] and "Health" not in container.attrs["State"]
    finally:
        await env.close()
    assert not _exists(docker_client, sandbox.name)


async def test_unchanged_env_is_not_rebuilt(docker_client, arithmetic_image, monkeypatch) -> None:
    from sandboxes import images

    def rebuilding(*args: object) -> None:
        raise AssertionError("an unchanged env's wheels were built again")

    # Not rebuilding is an event, not a speed: a rebuild starts by building the wheels, so it must never get there.
    monkeypatch.setattr(images, "_build_wheels", rebuilding)
    again = images.build("arithmetic", client=docker_client)
    assert (again.tag, again.built) == (arithmetic_image, False)


def test_an_images_inputs_are_the_projects_sources_and_nothing_it_ran_or_built(tmp_path, monkeypatch) -> None:
    """What a local project's image tag hashes: its source files, not what runs, builds and virtualenvs leave beside
    them (a docs build changed every image's tag, and a checkout with gigabytes of runs/ took seconds to hash), nor
    a nested project, which is a distribution of its own. Only the project's directories are walked."""
    from sandboxes import images

    project = tmp_path / "project"
    wanted = ["README.md", "pkg/__init__.py", "pkg/.kept.json", "pkg/conf/a.yaml"]
    left_out = ["runs/m1/metrics.json", "site/search/search_index.json", ".venv/lib/x.py", ".hidden.toml",
                "nested/pyproject.toml", "nested/b.py", "pkg.egg-info/top_level.txt", "build/lib/pkg/__init__.py",
                "pkg/__pycache__/x.py", "pkg/data.bin"]
    for rel in wanted + left_out:
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(rel)
    entered = []
    os_walk = images.os.walk

    def walk(top: Path):  # os.walk, noting each directory it enters (its dirs list is os.walk's own: pruning holds)
        for folder, dirs, names in os_walk(top):
            entered.append(folder)
            yield folder, dirs, names

    monkeypatch.setattr(images.os, "walk", walk)
    assert images._project_files(project) == sorted(project / rel for rel in wanted)
    assert sorted(Path(f).relative_to(project).as_posix() for f in entered) == [".", "pkg", "pkg/conf"]


def test_a_stale_egg_info_in_the_working_directory_does_not_shadow_the_project(tmp_path, arithmetic_image) -> None:
    """`pip install -e .` and wheel builds leave `envkit_rl.egg-info` in the project root; a build run from there
    sees it first on sys.path. It must still find envkit as the local project and never ask an index for it."""
    stale = tmp_path / "envkit_rl.egg-info"
    stale.mkdir()
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: envkit-rl\nVersion: 0.0.1\n")
    probe = ("import json; from sandboxes.images import plan; tag, sources, _ = plan('arithmetic'); "
             "print(json.dumps([tag, sources['envkit-rl'].version, str(sources['envkit-rl'].project_dir)]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tag, version, project = json.loads(done.stdout)
    assert (version, project) == (envkit.__version__, str(REPO))
    assert tag == arithmetic_image  # the same inputs as a build from anywhere else


def test_a_distribution_with_no_local_source_is_named_when_it_cannot_be_fetched(tmp_path, monkeypatch) -> None:
    from sandboxes.images import _build_wheels, _Source

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # this machine has no index to ask: fail at once, not after retries
    ghost = {"envkit-no-such-dist": _Source("envkit-no-such-dist", "9.9.9", None)}
    with pytest.raises(RuntimeError, match=r"fetching envkit-no-such-dist==9\.9\.9 \(installed here from a package "
                                           r"index[\s\S]*pip exit"):
        _build_wheels(ghost, tmp_path, "")


async def test_health_timeout_leaves_no_container(docker_client, arithmetic_image) -> None:
    # An ordering, not a clock: the container ends on its own after 20 s (13x the 1.5 s start deadline), and start()
    # notices that within 0.5 s ("exited with status 0"). Only a deadline that fired before then says "did not
    # answer"; one that was ignored (the default is 30 s) or fired late reads as the exit and fails the match.
    sandbox = DockerSandbox(arithmetic_image, command=["sleep", "20"], start_timeout_s=1.5)
    with pytest.raises(SandboxStartError, match="did not answer"):
        await sandbox.start()
    assert not _exists(docker_client, sandbox.name)
    with pytest.raises(SandboxStateError):
        await sandbox.exec("print(1)")


async def test_server_that_exits_fails_fast_with_its_log(docker_client, arithmetic_image) -> None:
    sandbox = DockerSandbox(arithmetic_image, command=["python3", "-c", "import sys; sys.exit('boom')"],
                            start_timeout_s=600)
    # "Fast" means before the start deadline, not after it. The 60 s guard only ends a wait for that deadline: it is
    # 20x the few seconds a start and the 0.5 s exit check take on a loaded machine, and the 600 s deadline it
    # guards against is 10x beyond it. Its TimeoutError is not the SandboxStartError expected, so it fails the test.
    with pytest.raises(SandboxStartError, match=r"exited with status 1[\s\S]*boom"):
        async with asyncio.timeout(60):
            await sandbox.start()
    assert not _exists(docker_client, sandbox.name)


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.4])
async def test_cancelled_start_leaves_no_container(docker_client, arithmetic_image, after_s: float) -> None:
    sandbox = DockerSandbox(arithmetic_image)
    task = asyncio.create_task(sandbox.start())
    await asyncio.sleep(after_s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _exists(docker_client, sandbox.name)


ORPHAN_SCRIPT = """
import asyncio, sys
from sandboxes.docker import DockerSandbox

async def main():
    sandbox = DockerSandbox(sys.argv[1])
    await sandbox.start()
    print(sandbox.name, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_reaper_removes_containers_of_dead_owners(docker_client, arithmetic_image) -> None:
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", ORPHAN_SCRIPT, arithmetic_image,
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        name = (await asyncio.wait_for(owner.stdout.readline(), 60)).decode().strip()
        assert _exists(docker_client, name)
        assert name not in reap_orphans(docker_client)  # its owner is alive
    finally:
        owner.send_signal(signal.SIGKILL)  # no cleanup runs: the container is orphaned
        await owner.wait()
    assert _exists(docker_client, name)
    assert name in await asyncio.to_thread(reap_orphans, docker_client)
    assert not _exists(docker_client, name)


async def test_pool_acquire_is_a_handoff_and_release_recycles_or_replaces(docker_client, arithmetic_image) -> None:
    pool = SandboxPool(lambda: DockerSandbox(arithmetic_image), size=2, max_lifetime_s=300)
    try:
        await pool.start()
        assert pool.idle == 2
        before = _ours(docker_client)
        first = await pool.acquire()
        second = await pool.acquire()
        assert first is not second and pool.idle == 0
        # A handoff: both were running before anyone asked for them, and asking created no container (how fast
        # that is: benchmarks/sandbox_latency.py, against a cold start).
        assert before.get(first.name) == before.get(second.name) == "running"
        assert _ours(docker_client) == before
        waiting = asyncio.create_task(pool.acquire())  # all leased: waits for a release
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await pool.release(first)  # clean and healthy: recycled
        assert await asyncio.wait_for(waiting, 5) is first and first.uses == 2
        await pool.release(second, dirty=True)  # replaced by a fresh container
        await pool.wait_ready()
        third = await pool.acquire()
        assert third is not second and not _exists(docker_client, second.name)
        result = await third.exec("print('warm')")
        assert result.stdout == "warm\n"
        await pool.release(third)
        await pool.release(first)
        names = [first.name, third.name]
    finally:
        await pool.close()
    assert not any(_exists(docker_client, n) for n in names)
    with pytest.raises(SandboxStateError):
        await pool.acquire()


async def test_make_with_a_pool_borrows_a_container(docker_client, arithmetic_image) -> None:
    async with SandboxPool(lambda: DockerSandbox(arithmetic_image), size=1) as pool:
        for seed in (0, 1):
            env = envkit.make("arithmetic", sandbox="docker", pool=pool, level=1)
            messages, _ = await env.reset(seed=seed)
            assert "What is" in messages[-1]["content"]
            name = env.env.sandbox.name
            await env.close()
            assert _exists(docker_client, name) and pool.idle == 1  # back in the pool, not removed
        # Its container OOM-killed mid-episode: the episode fails naming it and how, and the pool replaces it.
        env = envkit.make("arithmetic", sandbox="docker", pool=pool, level=1)
        await env.reset(seed=2)
        await asyncio.to_thread(oom_kill, docker_client.containers.get(name))
        with pytest.raises(SandboxLost, match=rf"sandbox container {name} .* was OOM-killed \(its memory limit: "
                                              rf"512 MiB\); the episode it served failed"):
            await env.step({"role": "assistant", "content": "42"})
        await env.close()
        await pool.wait_ready()
        assert pool.lost == 1 and pool.idle == 1 and not _exists(docker_client, name)


async def test_operator_kwargs_start_the_containers_server(docker_client, arithmetic_image, monkeypatch) -> None:
    """Kwargs a session may not set (a two-player game's opponent) go to the container's ``envkit serve --kwargs``;
    arithmetic's level stands in for them here, as its image is built already."""
    from sandboxes.env import open_pool

    monkeypatch.setattr("sandboxes.env.OPERATOR_KWARGS", frozenset({"level"}))
    async with envkit.make("arithmetic", sandbox="docker", level=3) as env:
        messages, _ = await env.reset(seed=0)
        assert messages[-1]["content"] == "What is 28 - 58?"  # level 3's question for seed 0; level 1 asks 4 + 5
        command = docker_client.containers.get(env.env.sandbox.name).attrs["Config"]["Cmd"]
        assert command[-2:] == ["--kwargs", '{"level": 3}']
    pool = await open_pool("arithmetic", "docker", size=1, server_kwargs={"level": 3})
    try:
        async with envkit.make("arithmetic", sandbox="docker", pool=pool, level=3) as env:
            messages, _ = await env.reset(seed=0)
            assert messages[-1]["content"] == "What is 28 - 58?"
        with pytest.raises(ValueError, match=r"needs a pool whose servers were started with them"):
            envkit.make("arithmetic", sandbox="docker", pool=pool, level=1)
    finally:
        await pool.close()


@pytest.fixture(scope="module")
async def sandbox(docker_client, arithmetic_image):
    """One running container for the exec tests."""
    async with DockerSandbox(arithmetic_image) as sb:
        yield sb


async def test_exec_python_and_argv(sandbox) -> None:
    result = await sandbox.exec("import sys; print(sys.stdin.read().upper()); sys.exit(3)", stdin="hi")
    assert (result.stdout, result.exit_code, result.timed_out) == ("HI\n", 3, False)
    result = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; pwd; id -u"], timeout=5)
    assert result.stdout.split() == ["out", "/work", str(EXEC_UID)] and result.stderr == "err\n"
    # Killed at the timeout is the server's report, no clock here: a kill that never came would leave the request
    # unanswered past the client's own deadline (timeout + EXEC_KILL_GRACE_S), which raises SandboxError.
    result = await sandbox.exec("import time\nwhile True: time.sleep(0.01)", timeout=1)
    assert result.timed_out and result.exit_code == -1


async def test_exec_output_is_capped(sandbox) -> None:
    result = await sandbox.exec("print('x' * 1_000_000)")
    assert result.truncated and len(result.stdout) == sandbox.limits.output_limit_bytes and result.exit_code == 0


async def test_code_env_runs_submissions_in_its_container(code_image) -> None:
    env = envkit.make("code", sandbox="docker")
    try:
        messages, _ = await env.reset(task={"id": "add"})
        assert "add(a, b)" in messages[-1]["content"]
        result = await env.step(envkit.assistant("```python\ndef add(a, b):\n    return a + b\n```"))
        assert result.reward == 1.0 and result.info["passed"] == 4
        await env.reset(task={"id": "gcd"})
        result = await env.step(envkit.assistant("def gcd(a, b):\n    return 6"))  # passes one of four
        assert result.reward == 0.25
        await env.reset(task={"id": "add"})
        cheat = "print('\\x00{\"results\": [{\"ok\": 3}, {\"ok\": 0}, {\"ok\": 123}, {\"ok\": 0}]}'); exit()"
        assert (await env.step(envkit.assistant(cheat))).reward == 0.0
        await env.reset(task={"id": "add"})
        result = await env.step(envkit.assistant("while True: pass"))
        assert result.reward == 0.0 and "timed out" in result.info["error"]
    finally:
        await env.close()


def test_code_env_refuses_to_run_outside_a_sandbox(monkeypatch) -> None:
    monkeypatch.delenv("ENVKIT_SANDBOX", raising=False)
    monkeypatch.delenv("ENVKIT_CODE_UNSAFE", raising=False)
    with pytest.raises(EnvLoadError, match="runs only inside a container"):
        envkit.make("code")


async def test_code_env_refuses_the_local_sandbox() -> None:
    env = envkit.make("code", sandbox="local")  # its server refuses to start: the env will not construct there
    with pytest.raises(SandboxStartError, match="executes model-written code"):
        await env.reset(task={"id": "add"})
    await env.close()


async def test_pool_replaces_expired_sandboxes_and_reports_failed_starts(docker_client, arithmetic_image) -> None:
    async with SandboxPool(lambda: DockerSandbox(arithmetic_image), size=1, max_lifetime_s=1.0) as pool:
        old = await pool.acquire()
        await asyncio.sleep(1.1)
        await pool.release(old)  # past its lifetime: closed and replaced
        await pool.wait_ready()
        new = await pool.acquire()
        assert new is not old and not _exists(docker_client, old.name)
        await pool.release(new)
    broken = SandboxPool(lambda: DockerSandbox(arithmetic_image, command=["false"]), size=1)
    try:
        with pytest.raises(SandboxStartError, match="exited with status 1"):
            await broken.start()
        with pytest.raises(SandboxStartError):
            await broken.acquire()
    finally:
        await broken.close()


async def test_a_sandboxed_envs_snapshot_restores_into_another_container(docker_client, arithmetic_image):
    """Two Docker sandboxes of arithmetic with follow-ups (two containers, two servers sharing this process's
    snapshot key): the snapshot of one's episode after its first answer restores into the other, which plays on as
    the first did, and whose /work then holds the files the first's held at the snapshot (3 MB of them: more than a
    request body may otherwise be), not its own nor the ones the first made later."""
    first, second = (envkit.make("arithmetic", followups=3, sandbox="docker") for _ in range(2))
    try:
        await asyncio.gather(first.reset(seed=2), second.reset(seed=5))
        await first.step(envkit.assistant("7"))
        boxes = first.unwrapped.sandbox, second.unwrapped.sandbox
        await boxes[0].exec("import os; os.mkdir('d'); open('d/blob', 'wb').write(bytes(range(256)) * 12288)")
        snapshot = await first.snapshot()
        await boxes[0].exec(["sh", "-c", "rm -r d; echo later > later"])
        replies = [envkit.assistant(n) for n in ("9", "12", "20")]
        original = [await first.step(reply) for reply in replies]
        await boxes[1].exec(["sh", "-c", "echo mine > mine"])
        await second.restore(snapshot)
        assert boxes[0].url != boxes[1].url and second.unwrapped.sandbox is boxes[1]
        again = [await second.step(reply) for reply in replies]
        assert [(r.observation, r.reward, r.done) for r in again] == [(r.observation, r.reward, r.done)
                                                                       for r in original]
        assert original[-1].done and not original[0].done
        check = "import os; print(os.listdir('.'), open('d/blob', 'rb').read() == bytes(range(256)) * 12288)"
        assert (await boxes[1].exec(check)).stdout == "['d'] True\n"
        assert (await boxes[0].exec(["ls", "-A"])).stdout == "later\n"
    finally:
        await asyncio.gather(first.close(), second.close())
