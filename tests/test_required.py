"""A part `make test` installs that is missing fails the run under it (ENVKIT_TESTS_STRICT=1), naming the part; run
by hand without it, the tests that need the part skip, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NEEDS_A_MISSING_PART = """
from required import require_module

require_module("envkit_no_such_part", "`make install` installs it")


def test_uses_it():
    pass
"""


@pytest.mark.parametrize("strict", [True, False])
def test_a_missing_part_fails_under_make_test_and_skips_elsewhere(tmp_path, strict: bool) -> None:
    (tmp_path / "test_needs_part.py").write_text(NEEDS_A_MISSING_PART)
    env = {key: value for key, value in os.environ.items() if key != "ENVKIT_TESTS_STRICT"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if strict:
        env["ENVKIT_TESTS_STRICT"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(tmp_path / "test_needs_part.py")], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=120)
    if strict:
        assert result.returncode != 0 and "1 error" in result.stdout, result.stdout[-2000:]
        assert "envkit_no_such_part is required under `make test`" in result.stdout, result.stdout[-2000:]
    else:
        # the whole module skipped: pytest counts no test collected
        assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in result.stdout, (
            result.stdout[-2000:])
        assert "envkit_no_such_part cannot be used here" in result.stdout, result.stdout[-2000:]
