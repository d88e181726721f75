"""The README's Python examples run as written, and print what their comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
RUN_BY_THEIR_TESTS = {"GRPOTrainer(": "tests/test_trl_env.py"}
"""Blocks (by a word in them) that another test runs as written, with checks of its own on what they made: one run
shows both."""


def readme_block(containing: str) -> str:
    """The README's one Python block that contains ``containing``."""
    (code,) = [code for code in BLOCKS if containing in code]
    return code


def expected_prints(code: str) -> list[str]:
    """The `# comment` after each print(...) line, in order: that is what the README promises it prints."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.+)$", code, re.MULTILINE)]


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


def _param(code: str) -> object:
    heavy = any(word in code for word in ("sandbox", "VLLMEngine", "trainer"))  # Docker, vLLM or a training run
    # the real parts a block runs: a container (sandbox="auto" or code tools, where Docker is up), vLLM, TRL
    parts = [mark for mark, words in ((pytest.mark.docker, ('sandbox="auto"', 'sandbox="docker"', "CodeTools")),
                                      (pytest.mark.vllm, ("VLLMEngine(",)), (pytest.mark.trl, ("from trl ",)))
             if any(word in code for word in words)]
    return pytest.param(code, marks=([pytest.mark.e2e] if heavy else []) + parts)


OURS = [(i, code) for i, code in enumerate(BLOCKS) if not any(word in code for word in RUN_BY_THEIR_TESTS)]


def test_the_blocks_other_tests_run_are_there_and_theirs_run_them():
    for word, test in RUN_BY_THEIR_TESTS.items():
        assert readme_block(word) and f'readme_block("{word}")' in (README.parent / test).read_text()


@pytest.mark.parametrize("code", [_param(code) for _, code in OURS], ids=[f"block{i}" for i, _ in OURS])
def test_readme_example_runs_and_prints_what_it_says(code: str, tmp_path: Path):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    expected = expected_prints(code)
    printed = out.stdout.strip().splitlines()
    for want in expected:
        assert want in printed, f"README promises {want!r}; the example printed {printed}"
