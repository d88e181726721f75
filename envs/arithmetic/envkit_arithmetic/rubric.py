"""A rubric that grades an arithmetic answer from the chat alone: the question it answers is read off the first user
message and computed, so traffic the env never produced (a served policy's calls) can be scored as the env would."""

from __future__ import annotations

import ast
import operator
import re

from envkit.parsing import grade_number
from envkit.rewards.rubrics import Check, Episode

_QUESTION = re.compile(r"What is (?P<expression>[\d\s()+*-]+)\?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"not an arithmetic expression: {ast.dump(node)}")


def expected_answer(question: str) -> int | None:
    """The value of the problem in ``question`` ("What is 3 + (4 * 5)?"), or None where it holds none."""
    found = _QUESTION.search(question)
    if found is None or len(found["expression"]) > 200:
        return None
    try:
        return _value(ast.parse(found["expression"], mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _graded(episode: Episode) -> float:
    question = next((str(m.get("content") or "") for m in episode.messages if m.get("role") == "user"), "")
    expected = expected_answer(question)
    return 0.0 if expected is None else float(grade_number(episode.reply, expected)["correct"])


answer = Check(_graded, name="arithmetic_answer")
"""1.0 where the reply's final number is the answer to the chat's first question, else 0.0."""
