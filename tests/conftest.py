"""Session-wide real components, started once: the bundled model, its tokenizer, one vLLM server."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from required import missing

pytest_plugins = ("suite_report",)

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("ENVKIT_CACHE_DIR", str(REPO / ".cache"))
# verifiers:ENV_ID runs its envs in the venv `make install` builds for them (envkit/adapters/verifiers.py)
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
HEAVY_FIXTURES = {"vllm_engine", "docker_client"}
# The real part a fixture runs (its marker, tests/suite_report.py); tests that reach a part otherwise are marked.
PART_OF_FIXTURE = {"vllm_engine": "vllm", "docker_client": "docker", "cluster": "ray"}
# Under `pytest -n 2 --dist loadgroup` (`make test`) these modules' tests run on one worker, as one group: they share
# the session's vLLM server (one per worker otherwise), the Docker engine and the Ray cluster, and their checks that
# a run left no container, vLLM server or Ray actor behind then see only their own runs. Every other test goes to
# whichever worker is free.
SHARED_MODULES = {"test_agent_recipe", "test_code_tools", "test_eval_e2e", "test_gateway", "test_generators_vllm",
                  "test_gym_bridge", "test_mcp", "test_ray", "test_rubrics", "test_sandbox_containment",
                  "test_sandbox_docker", "test_scaffold", "test_train_anywhere", "test_verifiers"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the vLLM server or the Docker engine (directly or through a fixture) ``e2e``; such a
    test outside :data:`SHARED_MODULES` is a usage error (it would start a second vLLM server under xdist)."""
    outside = []
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture in fixtures & PART_OF_FIXTURE.keys():
            item.add_marker(PART_OF_FIXTURE[fixture])
        if HEAVY_FIXTURES & fixtures:
            item.add_marker(pytest.mark.e2e)
            if item.path.stem not in SHARED_MODULES:
                outside.append(item.nodeid)
    if outside:
        raise pytest.UsageError(f"add the modules of {outside} to SHARED_MODULES in tests/conftest.py: they use "
                                f"{sorted(HEAVY_FIXTURES)}")
    # The shared group first, led by the modules that have an exclusive test and, in them, by those tests; then the
    # light tests; then the other e2e ones (the sort is stable: every other order stays). Under xdist the group's
    # worker starts on the exclusive tests while the other worker runs light tests, which they do not block. Placed
    # among the e2e tests, an exclusive test idled a worker for minutes: waiting its turn, then holding the machine.
    exclusive = {item.nodeid for item in items if item.get_closest_marker("exclusive")}
    leading = {item.path.stem for item in items if item.nodeid in exclusive}

    def run_order(item: pytest.Item) -> tuple[int, int]:
        if item.path.stem in SHARED_MODULES:
            return (0, 0 if item.nodeid in exclusive else 1 if item.path.stem in leading else 2)
        return (1 if item.get_closest_marker("e2e") is None else 2, 0)

    items.sort(key=run_order)


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


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """No local sandbox outlives the run: each is a session of its own, which a killed owner leaves orphaned (the
    Docker check's counterpart, :func:`docker_client`). Leftovers are killed and fail the run; only the process that
    ran the session checks, after every worker ended."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    deadline = time.monotonic() + 10  # a sandbox closed just now may still be shutting down
    while (left := _local_sandboxes_left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line(f"local sandboxes left behind by this test session: {left}", red=True, bold=True)


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the tests of :data:`SHARED_MODULES` as one unit of work, every other test on its own.
    (xdist's own ``xdist_group`` marks do not work under pytest 9.2: xdist 3.8 tags a grouped test by rewriting
    ``item._nodeid``, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedModulesScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "shared" if Path(nodeid.split("::", 1)[0]).stem in SHARED_MODULES else nodeid

    return SharedModulesScheduling(config, log)


@pytest.fixture(autouse=True)
def machine_share(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under xdist, a test marked ``exclusive`` (it needs most of the machine's memory) runs while the other worker
    runs no ``e2e`` test: each e2e test holds a shared lock, an exclusive one waits for it (ahead of later tests)."""
    exclusive = request.node.get_closest_marker("exclusive") is not None
    if "PYTEST_XDIST_WORKER" not in os.environ or not (exclusive or request.node.get_closest_marker("e2e")):
        yield
        return
    base = tmp_path_factory.getbasetemp().parent  # the run's base temp dir, which the workers share
    with open(base / "machine.turn", "w") as turn, open(base / "machine.lock", "w") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)  # a turnstile: an exclusive test waiting here blocks later shared ones
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turn, fcntl.LOCK_UN)
        yield


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
