"""Every code block of the README and the documentation site runs as written and prints what its comments say.

- ``python`` blocks run in a fresh interpreter, in a directory of their page's own; a ``print(...)  # X`` line
  promises that X is printed.
- ``bash`` blocks run with ``bash -e`` in that directory, with this venv's commands first on ``PATH``. A
  ``python -m trainer ...`` command (or ``torchrun ... -m trainer ...``) is composed and validated with its
  overrides, as the trainer does before anything starts, rather than trained: the training runs themselves are the
  trainer tests' (at tiny settings, on the session's servers).
- ``<!-- file: NAME -->`` before a block saves it as NAME in its page's directory, for the blocks after it.
- ``<!-- not run: REASON -->`` before a block says why it cannot run in the suite (a long-lived server, a multi-node
  cluster, the suite itself, a command that starts its own vLLM server for minutes: the reason names the test that
  runs it at tiny settings); such a block is no test at all, rather than a skipped one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "console": "bash"}
MARK = re.compile(r"^<!--\s*(not run|file):\s*(.+?)\s*-->$")
RUN_BY_THEIR_TESTS = {"GRPOTrainer(": "tests/test_trl_env.py"}
"""Blocks (by a word in them) that another test runs as written, with checks of its own on what they made: one run
shows both."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None = None
    file: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (at any indentation), each with the marker on the line before it."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang, start = opening.group(1), opening.group(2), i
        i += 1
        body = []
        while lines[i].strip() != "```":
            body.append(lines[i].removeprefix(indent))
            i += 1
        marker = MARK.match(lines[start - 1].strip()) if start else None
        kind, value = (marker.group(1), marker.group(2)) if marker else (None, None)
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n",
                            not_run=value if kind == "not run" else None, file=value if kind == "file" else None))
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUN = [b for b in BLOCKS if b.lang in RUNNABLE and b.file is None and b.not_run is None
       and not any(word in b.code for word in RUN_BY_THEIR_TESTS)]


def readme_block(containing: str) -> str:
    """The one Python block of the README or the docs that contains ``containing``."""
    (code,) = [b.code for b in BLOCKS if RUNNABLE.get(b.lang) == "python" and containing in b.code]
    return code


def expected_prints(code: str) -> list[str]:
    """The `# comment` after each print(...) line, in order: that is what the page promises it prints."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.+)$", code, re.MULTILINE)]


def trainer_commands(code: str) -> list[list[str]]:
    """The overrides of each ``python -m trainer`` / ``torchrun ... -m trainer`` command in a shell block."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if "-m" in words and words[words.index("-m") + 1] == "trainer":
            args = iter(words[words.index("-m") + 2:])
            # Hydra's own flags are not overrides: `--cfg job` prints the config the overrides compose
            commands.append([a for a in args if not (a.startswith("-") and (a != "--cfg" or next(args)))])
    return commands


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    code = block.code
    heavy = any(word in code for word in ("sandbox", "VLLMEngine", "from trainer", "import trainer"))
    parts = [mark for mark, words in ((pytest.mark.docker, ('sandbox="auto"', 'sandbox="docker"', "CodeTools")),
                                      (pytest.mark.vllm, ("VLLMEngine(",)), (pytest.mark.trl, ("from trl ",)))
             if any(word in code for word in words)]
    return ([pytest.mark.e2e] if heavy else []) + parts


def test_the_readme_is_a_front_page_and_links_into_the_site():
    readme = PAGES[0].read_text()
    assert len(readme.splitlines()) <= 200  # the rest lives on the site
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", readme))
    assert len(linked) > 25 and all((ROOT / path).exists() for path in linked), linked


def test_the_pages_have_blocks_and_every_block_left_out_says_why():
    assert len(RUN) >= 30
    left_out = [b for b in BLOCKS if b.not_run is not None]
    assert all(len(b.not_run) > 20 for b in left_out), [b.id for b in left_out if len(b.not_run) <= 20]
    assert not [b.id for b in left_out if b.lang not in RUNNABLE], "only runnable blocks need a reason"
    assert len(left_out) < len(RUN)  # the exception, not the rule


def test_the_blocks_other_tests_run_are_there_and_theirs_run_them():
    for word, test in RUN_BY_THEIR_TESTS.items():
        assert readme_block(word) and f'readme_block("{word}")' in (ROOT / test).read_text()


def _page_dir(block: Block, tmp_path: Path) -> Path:
    """A directory for the block holding its page's ``file:`` blocks."""
    for other in BLOCKS:
        if other.page == block.page and other.file:
            (tmp_path / other.file).write_text(other.code)
    return tmp_path


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=b.id) for b in RUN])
def test_block_runs_as_written(block: Block, tmp_path: Path):
    cwd = _page_dir(block, tmp_path)
    bindir = str(Path(sys.executable).parent)  # `python` and `envkit` in a block are this venv's
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    if RUNNABLE[block.lang] == "python":
        out = subprocess.run([sys.executable, "-c", block.code], capture_output=True, text=True, cwd=cwd, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        printed = out.stdout.strip().splitlines()
        for want in expected_prints(block.code):
            assert want in printed, f"{block.id} promises {want!r}; the example printed {printed}"
        return
    composed = trainer_commands(block.code)
    if composed:
        assert all(("-m trainer" in line) or not line.strip() or line.lstrip().startswith("#")
                   for line in block.code.replace("\\\n", " ").splitlines()), \
            f"{block.id} mixes trainer commands with others: split it, or mark it not run"
        check = "import sys, json, trainer\nfor o in json.loads(sys.argv[1]): trainer.compose(o)\n"
        out = subprocess.run([sys.executable, "-c", check, json.dumps(composed)], capture_output=True, text=True,
                             cwd=cwd, env=env, timeout=300)
        assert out.returncode == 0, f"{block.id}: {out.stderr[-3000:]}"
        return
    out = subprocess.run(["bash", "-e", "-c", block.code], capture_output=True, text=True, cwd=cwd, env=env,
                         timeout=600)
    assert out.returncode == 0, f"{block.id} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
