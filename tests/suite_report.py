"""Where the suite's time goes, kept on disk and printed at the end of every run, passed or failed.

`make test` sets ``ENVKIT_TEST_REPORT`` to ``$ENVKIT_CACHE_DIR/test-report/`` and the plugin writes there (other
pytest runs, a single test say, write nothing and so never clobber a full run's record):
- ``junit.xml``: pytest's own per-test record (``--junitxml``);
- ``durations.jsonl``: one line per finished test (node id, worker, seconds of setup + call + teardown, start and
  stop, the machine's cores busy meanwhile), appended as the run goes, so a run that is killed still says where its
  time went;
- ``durations.md``: the pytest phase's wall time against the machine kind's :data:`BUDGETS_S`, each worker's wall and
  busy time, the slowest tests (with the cores busy while each ran) and modules, how many tests exercise each real part
  (:data:`PARTS`), and the machine's lowest available memory in the run with the tests that were running then, and
  how busy its cores were on average;
- ``durations-previous.jsonl``: the run before's ``durations.jsonl``, and in ``durations.md`` this run against it
  (:func:`against_previous`): whether a run over budget has more tests or a slower machine.

Memory is watched, not rationed: the tests that once needed most of the machine (an `exclusive` lock idled the other
worker's end-to-end tests while they ran) now train the tiny model, and the low-water mark shows the margin left.

The budget line never fails the run: the same suite takes up to 1.5x longer on a slow machine of the same kind, and a
slow machine must not block a landing. It is there so that growth shows up long before CI's limit does.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUDGETS_S = {"AMX": 20 * 60, "AVX2-only": 30 * 60}
"""The pytest phase of `make test` on the 2-core CI machine, by its CPU kind: with AMX (bf16 in hardware), and on the
AVX2-only kind, where bf16 is emulated and training computes in fp32, several times slower per update. CI stops at 90
minutes, setup (venvs, model, Docker image, Chromium) takes 8-13 of them on a fresh machine, and a slow machine runs
1.5x longer: these keep a slow run of a grown suite well inside the limit."""


def cpu_kind(cpuinfo: str | None = None) -> str:
    """``AMX`` or ``AVX2-only``: which of the machine kinds this is (``/proc/cpuinfo``'s flags)."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "AMX" if "amx_bf16" in cpuinfo else "AVX2-only"

PARTS = ("vllm", "docker", "ray", "openenv", "verifiers", "agent_frameworks", "deepspeed", "trl", "chromium")
"""The real parts the suite runs for real, one pytest marker each (pyproject.toml): the collected count per marker is
how much of the suite exercises it."""

SLOWEST = 25


@dataclass
class _Test:
    worker: str = "main"
    seconds: float = 0.0
    start: float = float("inf")
    stop: float = 0.0
    outcome: str = "passed"


@dataclass
class _Run:
    started: float = field(default_factory=time.time)
    tests: dict[str, _Test] = field(default_factory=lambda: defaultdict(_Test))
    parts: dict[str, int] = field(default_factory=dict)
    collected: int = 0
    lowest_memory: tuple[float, float] = (float("inf"), 0.0)
    """The least available memory seen (bytes), and when."""
    previous: dict[str, float] = field(default_factory=dict)
    """The seconds of each test the run before passed (its ``durations.jsonl``)."""
    cpu_at_start: tuple[float, float] = field(default_factory=lambda: _cpu_times())
    busy_cores: list[tuple[float, float]] = field(default_factory=list)
    """Each second's end, and how many of the machine's cores were busy in it."""

    def watch_machine(self) -> None:
        """Sample MemAvailable and the cores busy every second for the rest of the process (a daemon thread's
        loop)."""
        cores, before = os.cpu_count() or 1, _cpu_times()
        while True:
            time.sleep(1.0)
            available, now = _available_memory(), _cpu_times()
            if available < self.lowest_memory[0]:
                self.lowest_memory = (available, time.time())
            busy, total = (end - start for end, start in zip(now, before, strict=True))
            self.busy_cores.append((time.time(), cores * busy / total if total else 0.0))
            before = now

    def cores_busy(self, start: float, stop: float) -> float | None:
        """The machine's busy cores on average from ``start`` to ``stop`` (None for a span not sampled)."""
        seen = [cores for when, cores in self.busy_cores if start < when <= stop + 1.0]
        return sum(seen) / len(seen) if seen else None


def _cpu_times() -> tuple[float, float]:
    """The machine's busy and total CPU time so far (clock ticks, all cores): whether the suite waits or computes."""
    with open("/proc/stat") as stat:
        ticks = [float(x) for x in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def _available_memory() -> float:
    with open("/proc/meminfo") as meminfo:
        return next(float(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


_run: _Run | None = None
"""This session's record; set in the process that runs the session (xdist's controller, or pytest without xdist)."""


REPORT_VAR = "ENVKIT_TEST_REPORT"


def report_dir() -> Path:
    """Where the report goes (``$ENVKIT_TEST_REPORT``: the Makefile points it into the project cache)."""
    return Path(os.environ[REPORT_VAR])


def pytest_configure(config: pytest.Config) -> None:
    global _run
    if REPORT_VAR in os.environ and not hasattr(config, "workerinput"):  # the controller, or pytest without xdist
        _run = _Run()
        threading.Thread(target=_run.watch_machine, name="machine-watch", daemon=True).start()
        report_dir().mkdir(parents=True, exist_ok=True)
        durations = report_dir() / "durations.jsonl"
        if durations.is_file() and durations.stat().st_size:
            durations.replace(report_dir() / "durations-previous.jsonl")
        _run.previous = _passed_seconds(report_dir() / "durations-previous.jsonl")
        durations.write_text("")


@pytest.hookimpl(trylast=True)  # after conftest.py's hook has marked the tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parts = {part: sum(1 for item in items if item.get_closest_marker(part)) for part in PARTS}
    if hasattr(config, "workerinput"):  # each xdist worker collects the whole suite: the controller reads one
        if REPORT_VAR in os.environ:
            config.workeroutput["parts"], config.workeroutput["collected"] = parts, len(items)
    elif _run is not None:
        _run.parts, _run.collected = parts, len(items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # node: xdist's WorkerController
    output = getattr(node, "workeroutput", {})
    if _run is not None and "parts" in output:
        _run.parts, _run.collected = output["parts"], output["collected"]


_kept: list[str] = []
"""What passing tests left on disk for people to look at (their ``record_property("kept", ...)``), printed at the
end: pytest deletes a passing test's tmp_path."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _kept.extend(value for name, value in report.user_properties if name == "kept" and report.when == "call")
    if _run is None:
        return
    test = _run.tests[report.nodeid]
    node = getattr(report, "node", None)  # the xdist worker that ran it
    test.worker = node.gateway.id if node is not None else "main"
    test.seconds += report.duration
    test.start, test.stop = min(test.start, report.start), max(test.stop, report.stop)
    if report.failed:
        test.outcome = "failed"
    elif report.skipped and test.outcome == "passed":
        test.outcome = "skipped"
    if report.when == "teardown":
        with (report_dir() / "durations.jsonl").open("a") as out:
            cores = _run.cores_busy(test.start, test.stop)
            out.write(json.dumps({"test": report.nodeid, "worker": test.worker, "seconds": round(test.seconds, 2),
                                  "start": test.start, "stop": test.stop, "outcome": test.outcome,
                                  "cores_busy": None if cores is None else round(cores, 2)}) + "\n")


def _passed_seconds(path: Path) -> dict[str, float]:
    """Each passed test's seconds in a ``durations.jsonl`` (none if there is no such file)."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["test"]: row["seconds"] for row in rows if row["outcome"] == "passed"}


def against_previous(now: dict[str, float], before: dict[str, float], *, floor: float = 1.0) -> list[str]:
    """This run's passed tests' seconds (``now``) against the run before's (``before``): the tests of ``floor``
    seconds or more that both passed, each one's ratio (the median says whether the same tests took longer: a slower
    machine), the time of the tests only one of them had (the suite grew or shrank), and the tests that grew most."""
    both = [t for t in now if t in before and before[t] >= floor]
    if not both:
        return []
    ratio = statistics.median(now[t] / before[t] for t in both)
    new, gone = set(now) - set(before), set(before) - set(now)
    grew = sorted((t for t in both if now[t] > before[t]), key=lambda t: before[t] - now[t])[:5]
    return ["\n## Against the run before (durations-previous.jsonl)\n",
            f"the {len(both)} tests of {floor:g} s or more that both passed: {sum(before[t] for t in both):.0f} s "
            f"then, {sum(now[t] for t in both):.0f} s now; the median test took {ratio:.2f}x as long (well above 1: "
            "the same tests took longer, a slower machine or a costlier product)",
            f"passed in this run only: {len(new)} tests ({sum(now[t] for t in new):.0f} s); in the run before only: "
            f"{len(gone)} ({sum(before[t] for t in gone):.0f} s)",
            "grew most: " + ("; ".join(f"{t} {before[t]:.0f} -> {now[t]:.0f} s" for t in grew) or "none")]


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def summary(run: _Run, now: float) -> list[str]:
    """The report's lines: budget, workers, slowest tests and modules, parts."""
    wall, kind = now - run.started, cpu_kind()
    over = wall - BUDGETS_S[kind]
    verdict = (f"OVER BUDGET by {_clock(over)}: fold new checks into the wide runs (tests/suite_report.py)"
               if over > 0 else f"within budget ({_clock(-over)} to spare)")
    lines = ["# The suite's time\n", f"pytest phase: {_clock(wall)} wall against the {kind} kind's budget of "
             f"{_clock(BUDGETS_S[kind])}: {verdict}",
             f"tests finished: {len(run.tests)} of {run.collected} collected\n",
             "| worker | tests | busy | first start to last stop | idle in it |", "|---|---|---|---|---|"]
    workers: dict[str, list[_Test]] = defaultdict(list)
    for test in run.tests.values():
        workers[test.worker].append(test)
    for worker, tests in sorted(workers.items()):
        busy = sum(t.seconds for t in tests)
        span = max(t.stop for t in tests) - min(t.start for t in tests)
        lines.append(f"| {worker} | {len(tests)} | {_clock(busy)} | {_clock(span)} | {_clock(max(0.0, span - busy))} |")
    lines += [f"\n## The {SLOWEST} slowest tests (setup + call + teardown)\n",
              "Cores busy: the whole machine's while the test ran, the other worker's tests included; well under "
              f"{os.cpu_count() or 1}, the machine had time to spare then (a test that waits, or holds it alone).\n",
              "| s | cores busy | worker | test |", "|---|---|---|---|"]
    ranked = sorted(run.tests.items(), key=lambda kv: -kv[1].seconds)
    for nodeid, t in ranked[:SLOWEST]:
        cores = run.cores_busy(t.start, t.stop)
        lines.append(f"| {t.seconds:.1f} | {'-' if cores is None else f'{cores:.2f}'} | {t.worker} | {nodeid} |")
    modules: dict[str, list[float]] = defaultdict(list)
    for nodeid, t in run.tests.items():
        modules[nodeid.split("::", 1)[0]].append(t.seconds)
    lines += ["\n## Modules by time\n", "| s | tests | module |", "|---|---|---|"]
    lines += [f"| {sum(s):.0f} | {len(s)} | {module} |"
              for module, s in sorted(modules.items(), key=lambda kv: -sum(kv[1]))]
    available, when = run.lowest_memory
    if when:
        running = sorted(nodeid for nodeid, t in run.tests.items() if t.start <= when <= t.stop)
        lines += [f"\nlowest available memory: {available / 2**30:.1f} GiB at {_clock(when - run.started)}, "
                  f"while these ran: {', '.join(running) or 'none (between tests)'}"]
    busy, total = (end - start for end, start in zip(_cpu_times(), run.cpu_at_start, strict=True))
    cores = os.cpu_count() or 1
    lines += [f"CPU busy: {cores * busy / total:.2f} of {cores} cores on average over the run (all of them: the wall "
              "time is work, not waiting)"]
    lines += against_previous({nodeid: t.seconds for nodeid, t in run.tests.items() if t.outcome == "passed"},
                              run.previous)
    if run.parts:
        lines += ["\n## Tests per real part (collected)\n", "| part | tests |", "|---|---|"]
        lines += [f"| {part} | {n} |" for part, n in run.parts.items()]
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _kept:
        terminalreporter.section("kept by the tests")
        for line in _kept:
            terminalreporter.write_line(line)
    if _run is None:
        return
    lines = summary(_run, time.time())
    (report_dir() / "durations.md").write_text("\n".join(lines) + "\n")
    terminalreporter.section("durations (also in " + str(report_dir() / "durations.md") + ")")
    for line in lines:
        terminalreporter.write_line(line, red="OVER BUDGET" in line, bold="OVER BUDGET" in line)
