"""Session-wide real components, started once: the bundled model, its tokenizer, one vLLM server."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from required import missing

pytest_plugins = ("suite_report",)

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("ENVKIT_CACHE_DIR", str(REPO / ".cache"))
# verifiers:ENV_ID runs its envs in the venv `make install` builds for them (envkit/integrations/verifiers.py)
os.environ.setdefault("ENVKIT_VERIFIERS_PYTHON", str(REPO / ".venv-verifiers" / "bin" / "python"))
# Every process this run starts inherits it (xdist's workers too): the session-end check finds the run's own leftovers.
RUN_MARK = "ENVKIT_TEST_RUN"
os.environ.setdefault(RUN_MARK, f"{os.getpid()}-{time.time_ns()}")
# vLLM servers the tests start (cpu_cores=auto) keep vLLM's own binding, one core on 2 vCPUs: the other pytest worker
# computes meanwhile (`inference.cpu_cores` is resolved in test_weight_sync).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
# Each xdist worker's torch (and its subprocesses': trainers, torchrun ranks, HF engines) computes on its share of the
# cores. Two processes of 2 OpenMP threads each on 2 cores spin at each other's barriers: two 1-rank updates side
# by side took 237 s with 2 threads each, 65 s with 1 (set before anything here imports torch).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
# A test that needs one of these is end-to-end whether or not its module says so: `make test-fast` leaves it out.
E2E_FIXTURES = {"vllm_engine", "tiny_vllm", "docker_client", "ray_cluster"}
# The real part a fixture runs (its marker, tests/suite_report.py); tests that reach a part otherwise are marked.
PART_OF_FIXTURE = {"vllm_engine": "vllm", "tiny_vllm": "vllm", "docker_client": "docker", "ray_cluster": "ray"}
# Under `pytest -n 2 --dist loadgroup` (`make test`) the tests that use one of these session servers run on one worker,
# as one unit of work: one server per worker otherwise, and the training runs that load new weights into it would
# change them under each other's feet. Every other test goes to whichever worker is free.
SHARED_SERVERS = {"vllm_engine": "bundled-vllm", "tiny_vllm": "tiny-vllm"}
GROUPS_FILE = "xdist-groups.json"
"""Written by each worker at collection: test id -> its group, for the scheduler in the controller."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a session server, the Docker engine or the Ray cluster (directly or through a
    fixture) ``e2e`` and with its real part; group the tests of each shared server (:data:`SHARED_SERVERS`); order
    them: the groups, then the other end-to-end tests, then the light ones (the sort is stable)."""
    groups: dict[str, str] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture in fixtures & PART_OF_FIXTURE.keys():
            item.add_marker(PART_OF_FIXTURE[fixture])
        if E2E_FIXTURES & fixtures:
            item.add_marker(pytest.mark.e2e)
        for fixture in sorted(fixtures & SHARED_SERVERS.keys()):
            if item.nodeid in groups:
                raise pytest.UsageError(f"{item.nodeid} uses two session servers ({sorted(SHARED_SERVERS)}): under "
                                        "xdist they may live on two workers")
            groups[item.nodeid] = SHARED_SERVERS[fixture]
    if "PYTEST_XDIST_WORKER" in os.environ:
        record = _run_dir(config._tmp_path_factory) / GROUPS_FILE
        tmp = record.with_name(f"{record.name}.{os.environ['PYTEST_XDIST_WORKER']}")
        tmp.write_text(json.dumps(groups))
        tmp.replace(record)  # both workers write the same content; the last rename wins whole
    # xdist hands out the two groups first (the largest units), one to each worker; then the single tests in this
    # order as workers free up: the end-to-end ones early, so that the light ones even out the end of the run.
    items.sort(key=lambda item: (item.nodeid not in groups, item.get_closest_marker("e2e") is None))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: each shared server's tests (:data:`SHARED_SERVERS`) as one unit of work, every other test
    on its own. (xdist's own ``xdist_group`` marks do not work under pytest 9.2: xdist 3.8 tags a grouped test by
    rewriting ``item._nodeid``, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    record = _run_dir(config._tmp_path_factory) / GROUPS_FILE

    class SharedServerScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (and written the file)
                self.groups = json.loads(record.read_text())
            return self.groups.get(nodeid, nodeid)

    return SharedServerScheduling(config, log)


def _local_sandboxes_left() -> dict[int, str]:
    """Live local-sandbox processes (``ENVKIT_SANDBOX`` in their environment) this run started, with their command."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    left = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mark in environ and any(e.startswith(b"ENVKIT_SANDBOX=") for e in environ):
            left[int(proc.name)] = command.strip()
    return left


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Iterator[None]:
    """No local sandbox outlives the run: each is a session of its own, which a killed owner leaves orphaned (the
    Docker check's counterpart, :func:`docker_client`). Leftovers are killed and fail the run; only the process that
    ran the session checks, after every worker ended and every other plugin finished. The run's Ray cluster is
    stopped before those plugins: when every test passed, pytest's own sessionfinish removes the base temp dir, and
    with it the record that a cluster was started (a green run used to leave the cluster running)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return (yield)
    _stop_cluster(session.config)
    result = yield
    deadline = time.monotonic() + 10  # a sandbox closed just now may still be shutting down
    while (left := _local_sandboxes_left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return result
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line(f"local sandboxes left behind by this test session: {left}", red=True, bold=True)
    return result


PRUNE_FROM_BYTES = 16 << 20
"""A failed test's tmp_path keeps its logs and metrics, not files this big (checkpoints, weights, optimizer state)."""
_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


@pytest.fixture(autouse=True)
def prune_failed_tmp_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed training test kept GBs in its tmp_path (``tmp_path_retention_policy`` keeps failed tests' dirs): a few
    failures filled a CI disk, and every later test then failed on "No space left on device", which buried the first
    failures. Its big files go (listed in ``PRUNED.txt``); what says why it failed stays."""
    yield  # autouse: torn down after tmp_path, which removed the dir of a test that passed
    path = request.node.funcargs.get("tmp_path")
    report = request.node.stash.get(_CALL_REPORT, None)
    if path is None or report is None or not report.failed or not path.exists():
        return
    pruned = [f for f in path.rglob("*") if f.is_file() and not f.is_symlink() and f.stat().st_size >= PRUNE_FROM_BYTES]
    for f in pruned:
        f.unlink()
    if pruned:
        (path / "PRUNED.txt").write_text("".join(f"{f.relative_to(path)}\n" for f in pruned))


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF checkpoint dir (converted once, cached)."""
    from generators.models import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="session")
def chat_tokenizer(bundled_model: Path):
    """The bundled model's tokenizer with its chat template."""
    from generators.chat import ChatTokenizer

    return ChatTokenizer.from_pretrained(bundled_model)


@pytest.fixture(scope="session")
async def vllm_engine(bundled_model: Path) -> AsyncIterator:
    """One real vLLM-CPU server for the whole session (startup is 60-100 s)."""
    from generators.engines.managed import ServerOptions
    from generators.engines.vllm import VLLMEngine

    # 1 GiB of KV cache holds ~45k tokens of this model, more than any test keeps in flight; it leaves the memory to
    # the other worker's training runs.
    options = ServerOptions(served_model_name="policy",
                            log_path=Path(os.environ["ENVKIT_CACHE_DIR"]) / "logs" / "vllm-tests.log")
    engine = VLLMEngine(bundled_model, options, kv_cache_gib=1)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="session")
async def tiny_vllm() -> AsyncIterator:
    """A real vLLM-CPU server of the tiny model (tests/tiny.py) for the training runs whose checks need no knowledge
    of the bundled model's: their updates cost a fraction of the bundled model's, which is most of a run on a CPU."""
    from tiny import SERVER_CORE, tiny_model_dir

    from generators.engines.managed import ServerOptions
    from generators.engines.vllm import VLLMEngine

    options = ServerOptions(served_model_name="policy",
                            log_path=Path(os.environ["ENVKIT_CACHE_DIR"]) / "logs" / "vllm-tests-tiny.log")
    # held to one core: the other pytest worker computes on the rest (test_generators_vllm checks that it is held)
    engine = VLLMEngine(tiny_model_dir(), options, kv_cache_gib=1, cpu_cores=SERVER_CORE)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
async def policy_url(vllm_engine, bundled_model: Path) -> AsyncIterator[str]:
    """The shared bundled vLLM server's URL for a training run, which changes its weights: the initial ones are
    loaded back after."""
    yield vllm_engine.base_url
    await vllm_engine.load_weights(bundled_model, 0)


@pytest.fixture
async def tiny_url(tiny_vllm) -> AsyncIterator[str]:
    """The session's tiny vLLM server's URL for a training run; its initial weights are loaded back after."""
    from tiny import tiny_model_dir

    yield tiny_vllm.base_url
    await tiny_vllm.load_weights(tiny_model_dir(), 0)


@pytest.fixture(scope="session")
def docker_client():
    """The real Docker engine (brought up once, as `make docker-up` does) and, at session end, the check that no
    container this test process started is left (`docker ps -a --filter label=org.envkit.owner=<this process>`)."""
    from sandboxes.base import owner_id
    from sandboxes.docker import OWNER_LABEL
    from sandboxes.engine import docker_client as make_client
    from sandboxes.engine import up

    failure = None
    try:
        up()
    except SystemExit as e:  # no engine, or none that starts: a failure under `make test`, which brings it up
        failure = str(e)
    if failure is not None:
        missing("Docker", f"its engine cannot be brought up: {failure}")
    client = make_client(timeout_s=600)
    yield client
    left = client.containers.list(all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner_id()}"})
    for container in left:
        container.remove(force=True)
    client.close()
    assert not left, f"containers left behind by this test session: {[c.name for c in left]}"


@pytest.fixture(scope="session")
def arithmetic_image(docker_client) -> str:
    """The `arithmetic` env image, built once per session (a no-op when its inputs did not change)."""
    from sandboxes.images import build

    return build("arithmetic", client=docker_client).tag


@pytest.fixture(scope="session")
def code_image(docker_client) -> str:
    """The `code` env image, built once per session (a no-op when its inputs did not change)."""
    from sandboxes.images import build

    return build("code", client=docker_client).tag


class Machine:
    """The test run's machine lock as one test holds it: shared, from the test's start; alone within :meth:`hold`."""

    def __init__(self, lock: IO[str], wanted: Path) -> None:
        self.lock, self.wanted = lock, wanted

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The machine alone for the block (a container cluster's nodes, vLLM and a trainer fill 2 cores and 24 GB):
        from when the other worker's test in progress ends; that worker starts nothing new meanwhile."""
        self.wanted.touch()
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX)  # this test's shared lock, converted
            yield
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_SH)
            self.wanted.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    """Every test holds the run's machine lock shared, and starts only while no test wants it alone
    (:meth:`Machine.hold`; such tests are marked ``hold_machine``)."""
    lock_path = _run_dir(tmp_path_factory) / "machine.lock"
    wanted = lock_path.with_suffix(".wanted")
    with open(lock_path, "a") as lock:
        while wanted.exists():
            time.sleep(0.5)
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield Machine(lock, wanted)


RAY = Path(sys.executable).with_name("ray")


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dir of this test run that every xdist worker shares (the controller's base temp dir)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One local Ray cluster for the whole test run, as `ray start --head` on a node: the first worker to need it
    starts it, and the session's end stops it (:func:`pytest_sessionfinish`). 16 logical CPUs: two runs' trainer
    ranks, replicas and env workers may be placed at once, one on each pytest worker."""
    with pytest.MonkeyPatch.context() as env:
        # Ray 2.59+ turns token auth on for clusters ray.init() starts, not (before 2.61) for `ray start` ones, so
        # clients and this cluster would disagree; a loopback test cluster needs none.
        env.setenv("RAY_AUTH_MODE", "disabled")
        # The other pytest worker's training runs share this machine's memory; Ray's monitor would count them and
        # kill this cluster's actors at 95% in use.
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        # Its workers (env workers included) import the test modules' envs, as the runs' trainer processes do.
        from tiny import env_with_tests

        env.setenv("PYTHONPATH", env_with_tests()["PYTHONPATH"])
        record = _run_dir(tmp_path_factory) / "ray-address"
        with open(record.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not record.is_file():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=16",
                                          "--include-dashboard=false", "--disable-usage-stats"],
                                         capture_output=True, text=True)
                assert started.returncode == 0, started.stdout + started.stderr
                record.write_text(f"127.0.0.1:{port}")
        yield record.read_text()


@pytest.fixture
def cluster(ray_cluster: str) -> Iterator[str]:
    """The run's Ray cluster with this process connected as a driver for one test (the tests after it, in no
    cluster, see none)."""
    import ray

    ray.init(address=ray_cluster)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()  # disconnect: another worker may still use the cluster


def _stop_cluster(config: pytest.Config) -> None:
    """Stop the run's Ray cluster if a test started one (the process that ran the session, after every worker)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None and (_run_dir(factory) / "ray-address").is_file():
        subprocess.run([RAY, "stop", "--force"], capture_output=True)
