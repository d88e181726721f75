"""``make mutants`` still breaks what it says it breaks: each mutation of tests/mutate.py applies where it says (its
symbol in its file, its snippet there once) and leaves code that parses. Code moved since a mutation was written
would otherwise leave a mutant that no longer applies, which ``make mutants`` reports only when someone runs it. And a
test that fails without its mutant is no kill."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from mutate import MUTATIONS, Mutation, attempt, mutated


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_where_it_says(mutation: Mutation) -> None:
    source = mutation.path.read_text()
    broken = mutated(source, mutation)
    assert broken != source
    ast.parse(broken)


def test_a_test_that_fails_unmutated_kills_nothing(tmp_path: Path) -> None:
    """A guarding test that fails on the product as it is (here: always) would fail with any mutant in too; its
    mutation is "not a kill", and the product file is never touched."""
    failing = tmp_path / "test_always_fails.py"
    failing.write_text("def test_it():\n    assert False, 'broken before any mutant'\n")
    mutation = dataclasses.replace(MUTATIONS[0], test=f"{failing}::test_it")
    before = mutation.path.read_text()
    baselines: dict[str, tuple[str, str]] = {}
    assert attempt(mutation, baselines) == ("not a kill: the test fails unmutated",
                                            "AssertionError: broken before any mutant")
    assert mutation.path.read_text() == before
    assert list(baselines) == [mutation.test]  # run once, for every mutation it guards
