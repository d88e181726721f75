"""Containment on the real engine: each attack runs in a tightly limited container, bounded in time, and must leave
the host, the attacked sandbox's own server, and a bystander sandbox working. Besides resource bombs and escapes,
what a policy would try for reward or a foothold: processes that outlive their exec, state left for the next
lease, and submissions that read the grader's hidden tests instead of solving the task."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from archives import hostile_archives, setuid_archive

import envkit
from envkit.errors import SnapshotError
from sandboxes.base import SandboxLimits
from sandboxes.docker import DockerSandbox
from sandboxes.pool import SandboxPool

TIGHT = SandboxLimits(cpus=0.5, memory_mb=128, pids=48, tmpfs_mb=8)

# Prints [[pid, uid, command], ...] of every live process but init, the server (root) and the lister itself.
OTHERS = """
import json, os
found = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        status = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status'))
        command = open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()
    except OSError:
        continue
    uid = int(status['Uid'].split()[0])
    if int(pid) not in (1, os.getpid()) and uid != 0 and status['State'].split()[0] not in 'ZX':
        found.append([int(pid), uid, command])
print(json.dumps(found))
"""
# Forks a daemon in a new session that ignores every catchable signal and spins; the exec itself returns at once.
ESCAPE = """
import os, signal
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass
    os._exit(0)
"""


async def leftovers(sandbox: DockerSandbox) -> list[list]:
    """Processes in the sandbox other than init, the server and the lister."""
    result = await sandbox.exec(OTHERS, timeout=10)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


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
    # Killed is events: the timeout flag, and no process left. The lower bound is an ordering (the kill came no
    # earlier than the deadline), which load cannot break. A loop never killed leaves the exec unanswered, and the
    # client's own deadline (timeout + EXEC_KILL_GRACE_S) raises. The 30 s guard only ends a hang: 20x the 1.5 s
    # timeout, over 10x the exec and the checks after it.
    async with asyncio.timeout(30):
        result = await victim.exec("while True:\n    pass", timeout=1.5)
        assert result.timed_out and result.exit_code == -1 and result.duration_s >= 1.5, result
        assert await leftovers(victim) == []
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


async def test_a_snapshots_files_cannot_land_outside_the_workdir(victim, bystander) -> None:
    """Files restored from a snapshot come from the policy's own sandbox, so a policy can craft them: an archive
    that climbs out of /work, links out of it, or makes a device is refused by the server (422) before anything is
    written; setuid bits are dropped; files it cannot read fail the snapshot; the server stays up."""
    marker = f"envkit-archive-{uuid.uuid4().hex}"
    async with asyncio.timeout(60):
        for attack, archive in hostile_archives(marker).items():
            with pytest.raises(SnapshotError, match=r"422.*refused archive member"):
                await victim.load_files(archive)
            found = await victim.exec(["find", "/tmp", "/work", "/", "-maxdepth", "1", "-name", marker, "-o",
                                       "-name", "before"], timeout=10)
            assert found.stdout == "", attack  # nothing of a refused archive is written, not even its harmless file
        await victim.load_files(setuid_archive())
        assert (await victim.exec(["stat", "-c", "%a %u", "/work/tool"], timeout=10)).stdout == "755 1000\n"
        # a file the policy made unreadable cannot be saved: the snapshot fails, saying so, and the server lives on
        await victim.exec(["sh", "-c", "echo x > locked && chmod 000 locked"], timeout=10)
        with pytest.raises(SnapshotError, match=r"500.*could not be archived.*locked"):
            await victim.save_files()
        await victim.load_files(b"")
        assert (await victim.exec(["ls", "-A", "/work"], timeout=10)).stdout == ""
        await _unaffected(victim, bystander)


async def test_a_50_mb_output_flood_is_capped(victim, bystander) -> None:
    flood = "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(50):\n    os.write(1, chunk)\n    os.write(2, chunk)"
    async with asyncio.timeout(60):
        result = await victim.exec(flood, timeout=30)
        assert result.exit_code == 0 and result.truncated and not result.timed_out, result.exit_code
        cap = TIGHT.output_limit_bytes
        assert len(result.stdout) == cap and len(result.stderr) == cap  # 100 MB written, 2 x 64 KiB kept
        await _unaffected(victim, bystander)


async def test_disk_and_inode_exhaustion_are_contained_and_gone_for_the_next_lease(docker_client,
                                                                                  arithmetic_image) -> None:
    fill = """
import os
for top in ("/work", "/tmp"):
    try:
        with open(f"{top}/fill", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
    except OSError as e:
        print(top, "bytes", e.strerror)
    os.unlink(f"{top}/fill")
    os.mkdir(f"{top}/many")
    try:
        for i in range(10**6):
            open(f"{top}/many/{i}", "w").close()
    except OSError as e:
        print(top, "files", i, e.strerror)
"""
    limits = SandboxLimits(cpus=0.5, memory_mb=128, pids=48, tmpfs_mb=8, tmpfs_inodes=2048)
    async with (DockerSandbox(arithmetic_image, limits=TIGHT) as bystander,
                SandboxPool(lambda: DockerSandbox(arithmetic_image, limits=limits), size=1) as pool):
        victim = await pool.acquire()
        async with asyncio.timeout(90):
            result = await victim.exec(fill, timeout=60)
            lines = result.stdout.splitlines()
            assert [line.split()[:2] for line in lines] == [["/work", "bytes"], ["/work", "files"],
                                                            ["/tmp", "bytes"], ["/tmp", "files"]], result
            assert all(line.endswith("No space left on device") for line in lines), lines
            assert all(int(line.split()[2]) < 2048 for line in lines if line.split()[1] == "files"), lines
            # Full disks refuse the attacker's writes, not the server's work: exec and the env still run.
            assert (await victim.exec("print(1)", timeout=10)).stdout == "1\n"
            await _unaffected(victim, bystander)
            await pool.release(victim)
            again = await pool.acquire()
            assert again is victim  # the scrub emptied it, so the pool recycled it
            listing = await again.exec(["sh", "-c", "ls -A /work /tmp; echo > /work/ok && echo writable"], timeout=10)
            assert listing.stdout.split() == ["/tmp:", "/work:", "writable"], listing
            await pool.release(again)


async def test_a_daemon_in_a_new_session_dies_with_its_exec(victim, bystander) -> None:
    async with asyncio.timeout(30):
        # An ordering, not a clock: not timed out means the exec answered when its command exited, before its 10 s
        # deadline, rather than waiting on the daemon (which holds its pipes and never ends); none is left after.
        result = await victim.exec(ESCAPE, timeout=10)
        assert result.exit_code == 0 and not result.timed_out, result
        assert await leftovers(victim) == []
        await _unaffected(victim, bystander)


@pytest.mark.parametrize("command", [
    ["sh", "-c", "nohup sleep 600 >/dev/null 2>&1 & sleep 600"],  # a sleeper in the background, past the timeout
    ["sh", "-c", "setsid sh -c 'trap \"\" TERM HUP; while :; do :; done' & wait"],  # setsid(1), traps, then timeout
    ["python3", "-c", ESCAPE + "\nimport time; time.sleep(600)"],
])
async def test_nothing_outlives_a_timed_out_exec(victim, bystander, command: list[str]) -> None:
    async with asyncio.timeout(30):
        result = await victim.exec(command, timeout=1.5)
        assert result.timed_out, result
        assert await leftovers(victim) == []
        await _unaffected(victim, bystander)


async def test_exec_cannot_read_the_server_the_env_packages_or_use_its_routes(victim, bystander) -> None:
    probe = """
import glob, json, os
tried = {}
server = [p for p in filter(str.isdigit, os.listdir('/proc'))
          if b'envkit' in open(f'/proc/{p}/cmdline', 'rb').read() and int(p) != os.getpid()][0]
for path in (f'/proc/{server}/environ', f'/proc/{server}/mem', '/proc/1/environ', f'/proc/{server}/root/etc/hostname',
             '/opt/envkit/pyvenv.cfg'):
    try:
        open(path, 'rb').read(16)
        tried[path] = 'read'
    except OSError as e:
        tried[path] = type(e).__name__
try:
    import envkit
    tried['import envkit'] = 'imported'
except ImportError as e:
    tried['import envkit'] = type(e).__name__
tried['packages'] = glob.glob('/opt/envkit/lib/*/site-packages/*')
tried['token'] = [k for k in os.environ if k.startswith('ENVKIT')]
import urllib.error, urllib.request
try:  # the server's own /exec, from inside: the token is the server's secret
    urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:8000/exec', data=b'{"argv": ["id"]}',
                                                  headers={'content-type': 'application/json'}), timeout=5)
    tried['exec route'] = 'ran'
except urllib.error.HTTPError as e:
    tried['exec route'] = e.code
tried['kill server'] = 'sent'
try:
    os.kill(int(server), 9)
except OSError as e:
    tried['kill server'] = type(e).__name__
print(json.dumps(tried))
"""
    result = await victim.exec(probe, timeout=10)
    tried = json.loads(result.stdout)
    assert tried.pop("packages") == [] and tried.pop("token") == [], tried
    assert "read" not in tried.values() and tried["import envkit"] == "ModuleNotFoundError", tried
    assert tried["kill server"] == "PermissionError" and tried["exec route"] == 401, tried
    await _unaffected(victim, bystander)


async def test_a_recycled_container_is_handed_out_clean(docker_client, arithmetic_image) -> None:
    """State a lease leaves (files in /work and /tmp, locked directories, running processes) is gone for the next,
    and the workdir itself cannot be locked."""
    plant = ("! chmod 000 /work 2>/dev/null"
             " && mkdir -p /work/locked/deep /tmp/mine && touch /work/a /work/.hidden /work/locked/deep/f /tmp/mine/b"
             " && chmod 000 /work/locked && (setsid sleep 600 &) && echo planted")
    async with SandboxPool(lambda: DockerSandbox(arithmetic_image, limits=TIGHT), size=1) as pool:
        first = await pool.acquire()
        assert (await first.exec(["sh", "-c", plant], timeout=10)).stdout == "planted\n"
        await pool.release(first)
        second = await pool.acquire()
        try:
            assert second is first  # recycled, not replaced: the scrub is what made it clean
            listing = await second.exec(["sh", "-c", "ls -A /work /tmp"], timeout=10)
            assert listing.stdout.split() == ["/tmp:", "/work:"], listing
            assert await leftovers(second) == []
        finally:
            await pool.release(second)


async def test_what_the_engine_runs_inside_is_no_lease_leftover(docker_client, arithmetic_image) -> None:
    """A process the container engine starts from outside (its HEALTHCHECK probe, `docker exec`) is not a lease's:
    a scrub that meets one still recycles the container (it used to replace it, which under load happened to a
    tenth of the leases, whenever a release met the health probe)."""
    async with SandboxPool(lambda: DockerSandbox(arithmetic_image, limits=TIGHT), size=1) as pool:
        first = await pool.acquire()
        docker_client.containers.get(first.name).exec_run(["sleep", "60"], detach=True)
        running = await first.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline"], timeout=10)
        assert "sleep\x0060" in running.stdout  # it runs while the pool scrubs the container
        await pool.release(first)
        second = await pool.acquire()
        try:
            assert second is first
        finally:
            await pool.release(second)


GRADER_HACKS = {
    # the hidden tests through the installed env package
    "import": """
def gcd(a, b):
    from envkit_code.env import _BY_ID
    return dict(_BY_ID["gcd"].tests)[(a, b)]
""",
    # the package's source on disk, parsed
    "read": """
import ast, glob
def gcd(a, b):
    for path in glob.glob("{site}/envkit_code/env.py"):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Problem" and node.args[0].value == "gcd":
                return dict(ast.literal_eval(node.args[3]))[(a, b)]
    return -1
""",
    # the grader's memory, through /proc of the parent process: its private mappings a MiB at a time, once per
    # submission (a long-lived grader maps gigabytes, and the function is called once per test)
    "proc": """
import os
SEEN = []
def scan():
    with open(f"/proc/{os.getppid()}/maps") as maps, open(f"/proc/{os.getppid()}/mem", "rb") as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not (perms.startswith("r") and perms.endswith("p")):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            for at in range(start, end, 1 << 20):
                try:
                    mem.seek(at)
                    if b"gcd" in mem.read(min(1 << 20, end - at)):
                        return True
                except (OSError, OverflowError):  # an unreadable mapping: try the next
                    break
    return False
def gcd(a, b):
    if not SEEN:
        SEEN.append(scan())
    return {(12, 18): 6, (7, 13): 1, (0, 9): 9, (100, 75): 25}[(a, b)] if SEEN[0] else -1
""",
}


IMAGE_SITE_PACKAGES = "/opt/envkit/lib/python3*/site-packages"
"""Where the code env's image installs the env packages (the "read" hack looks there)."""


def grader_hack(name: str, site_packages: str = IMAGE_SITE_PACKAGES) -> str:
    """The submission that plays hack ``name``, as a fenced reply."""
    return f"```python\n{GRADER_HACKS[name].replace('{site}', site_packages)}```"


@pytest.mark.parametrize("hack", sorted(GRADER_HACKS))
async def test_a_submission_cannot_read_the_hidden_tests(code_image, hack: str) -> None:
    """Each hack returns the expected values only if it reached the grader's data (reward 1.0); isolated, it
    fails (reward 0); the controls below show each hack wins where the grader is not isolated."""
    env = envkit.make("code", sandbox="docker")
    try:
        await env.reset(task={"id": "gcd"})
        result = await env.step(envkit.assistant(grader_hack(hack)))
        assert result.reward == 0.0, (hack, result.info)
        await env.reset(task={"id": "gcd"})  # the env still grades honest work
        honest = "```python\nimport math\ndef gcd(a, b):\n    return math.gcd(a, b)\n```"
        assert (await env.step(envkit.assistant(honest))).reward == 1.0
    finally:
        await env.close()


async def test_a_submission_leaves_no_process_behind(code_image) -> None:
    env = envkit.make("code", sandbox="docker")
    try:
        await env.reset(task={"id": "gcd"})
        result = await env.step(envkit.assistant(f"```python\n{ESCAPE}\ndef gcd(a, b):\n    return -1\n```"))
        assert result.reward == 0.0 and "error" not in result.info, result.info
        sandbox = env.env.sandbox  # ContractChecker -> SandboxedEnv
        assert await leftovers(sandbox) == []
    finally:
        await env.close()


def test_the_read_hack_finds_the_hidden_tests_where_the_image_installs_them(docker_client, code_image) -> None:
    """The "read" hack's control in the image itself: run as root (what the exec user is not), it finds the package
    under IMAGE_SITE_PACKAGES and reads the hidden tests, so its 0 in the sandbox is the isolation's doing."""
    hack = GRADER_HACKS["read"].replace("{site}", IMAGE_SITE_PACKAGES)
    out = docker_client.containers.run(code_image, ["python3", "-c", f"{hack}\nprint(gcd(12, 18))"], user="0",
                                       network_disabled=True, remove=True)
    assert out.decode().strip() == "6"


@pytest.mark.parametrize("hack", sorted(GRADER_HACKS))
def test_each_grader_hack_wins_against_an_unisolated_grader(monkeypatch, hack: str) -> None:
    """The controls for the grader tests: graded in-process as this user, each hack does reach the hidden tests
    (the package's modules, its source, where it is installed here, the grader's memory), so reward 0 in the
    container comes from the isolation, not from a broken hack."""
    import envkit_code

    monkeypatch.setenv("ENVKIT_CODE_UNSAFE", "1")
    monkeypatch.setattr("envkit.agents.untrusted.python", lambda: __import__("sys").executable)
    monkeypatch.setattr("envkit.agents.untrusted.can_switch_user", lambda: False)
    site_packages = str(Path(envkit_code.__file__).parents[1])  # the directory envkit_code/env.py is found under

    async def play() -> float:
        async with envkit.make("code") as env:
            await env.reset(task={"id": "gcd"})
            return (await env.step(envkit.assistant(grader_hack(hack, site_packages)))).reward

    assert asyncio.run(play()) == 1.0
