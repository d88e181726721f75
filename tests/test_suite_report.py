"""The suite's time report (tests/suite_report.py): a run against the run before, so that a run over budget says
whether the suite grew or the machine was slower."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_report import against_previous


def test_the_budget_is_the_machine_kinds():
    """20 minutes where the CPU has AMX, 30 on the AVX2-only kind (bf16 emulated, training in fp32)."""
    from suite_report import BUDGETS_S, cpu_kind

    amx = "flags\t\t: fpu avx2 avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    epyc = "flags\t\t: fpu avx2 fma sha_ni\n"
    assert (cpu_kind(amx), cpu_kind(epyc)) == ("AMX", "AVX2-only")
    assert BUDGETS_S[cpu_kind(amx)] == 20 * 60 and BUDGETS_S[cpu_kind(epyc)] == 30 * 60


def test_a_run_against_the_run_before_tells_a_slower_machine_from_a_grown_suite():
    before = {"a": 10.0, "b": 2.0, "tiny": 0.5, "dropped": 5.0}
    slower = {"a": 15.0, "b": 3.0, "tiny": 0.9, "added": 7.0}
    lines = against_previous(slower, before)
    assert "the 2 tests of 1 s or more that both passed: 12 s then, 18 s now; the median test took 1.50x" in lines[1]
    assert lines[2].startswith("passed in this run only: 1 tests (7 s); in the run before only: 1 (5 s)")
    assert lines[3] == "grew most: a 10 -> 15 s; b 2 -> 3 s"
    grown = against_previous({**before, "added": 7.0}, before)
    assert "took 1.00x as long" in grown[1] and "this run only: 1 tests (7 s)" in grown[2]
    assert grown[3] == "grew most: none"  # the same tests, none of them longer
    assert against_previous(slower, {}) == []  # the first run has nothing to compare


def test_make_tests_report_keeps_the_run_before_and_compares_with_it(tmp_path: Path):
    """Two runs of a suite with the plugin and ENVKIT_TEST_REPORT, as `make test` runs it: the second keeps the
    first's durations.jsonl as durations-previous.jsonl and its durations.md compares the two."""
    (tmp_path / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(1.1)\n")
    report = tmp_path / "report"
    env = {"PATH": "/usr/bin:/bin", "ENVKIT_TEST_REPORT": str(report), "PYTHONPATH": str(Path(__file__).parent)}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_report", "-p", "no:cacheprovider",
                               "test_sleeps.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    assert (report / "durations-previous.jsonl").read_text().count('"test_sleeps.py::test_sleeps"') == 1
    assert "the 1 tests of 1 s or more that both passed" in (report / "durations.md").read_text()
