"""``make mutants`` still breaks what it says it breaks: each mutation of tests/mutate.py applies where it says (its
symbol in its file, its snippet there once) and leaves code that parses. Code moved since a mutation was written
would otherwise leave a mutant that no longer applies, which ``make mutants`` reports only when someone runs it."""

from __future__ import annotations

import ast

import pytest
from mutate import MUTATIONS, Mutation, mutated


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_where_it_says(mutation: Mutation) -> None:
    source = mutation.path.read_text()
    broken = mutated(source, mutation)
    assert broken != source
    ast.parse(broken)
