"""CalculatorEnv: multi-step arithmetic word problems, solved by calling a safe calculator tool."""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from envkit import Task, ToolEnv, tool
from envkit.tasks import Splits, split_problems
from envkit.tool_env import NumberQuestions

DEFAULT_SYSTEM_PROMPT = """\
You can use a calculator. To call it, write exactly:
<tool_call>{"name": "calculator", "arguments": {"expression": "37*24-158"}}</tool_call>
It understands numbers, + - * / // % ** and parentheses. Its result comes back in the next message.
When you are done, end your reply with "The answer is N." where N is the final number."""

_TEST_SHARE = 0.2
_MAX_SPLIT_SIZE = 100_000  # far below the millions of problems the templates can make, so sampling stays fast
_MAX_EXPRESSION_LENGTH = 200
_MAX_EXPONENT = 100
_MAX_MAGNITUDE = 10**100
_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate(expression: str) -> int | float:
    """Evaluate an arithmetic expression without ``eval``: numbers, + - * / // % **, unary minus, parentheses.

    Raises ValueError with a message written for the model: bad syntax, division by zero, an exponent above
    100, or a result beyond 1e100 (the bounds keep a hostile expression from eating memory or time).
    """
    if len(expression) > _MAX_EXPRESSION_LENGTH:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ValueError(f"{expression!r} is not a valid arithmetic expression") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponents above {_MAX_EXPONENT} are not supported")
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"unsupported syntax {ast.unparse(node)!r}; use numbers, + - * / // % ** and parentheses")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > _MAX_MAGNITUDE:
        raise ValueError("the result is too large")
    return value


def _format(value: int | float) -> str:
    # 12.0 reads as 12, but only where the float still holds every digit of the integer.
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else str(value)


@dataclass(frozen=True, slots=True)
class _Template:
    text: str
    ranges: tuple[tuple[int, int], ...]
    """Inclusive range of each number, chosen so every answer is a whole number >= 0."""
    answer: Callable[..., int]


_TEMPLATES: dict[str, _Template] = {
    "pens": _Template(
        "A shop sells {} boxes of {} pens each, and then {} pens are returned. How many pens were sold?",
        ((12, 99), (12, 99), (10, 143)),
        lambda a, b, c: a * b - c,
    ),
    "orchard": _Template(
        "An orchard has {} rows of {} trees. A storm knocks down {} trees and {} new ones are planted. "
        "How many trees are there now?",
        ((12, 99), (12, 99), (10, 143), (10, 99)),
        lambda a, b, c, d: a * b - c + d,
    ),
    "bus": _Template(
        "A bus makes {} trips a day and carries {} passengers on each trip. "
        "How many passengers does it carry in {} days?",
        ((3, 12), (12, 99), (7, 60)),
        lambda a, b, c: a * b * c,
    ),
    "crates": _Template(
        "A factory makes {} bottles an hour for {} hours and packs them in crates of {}. "
        "How many crates can it fill completely?",
        ((100, 999), (5, 24), (6, 48)),
        lambda a, b, c: a * b // c,
    ),
    "savings": _Template(
        "Maria saves {} dollars every week for {} weeks, then spends {} dollars on a bike. "
        "How many dollars does she have left?",
        ((12, 99), (12, 52), (50, 143)),
        lambda a, b, c: a * b - c,
    ),
    "theater": _Template(
        "A theater has {} rows of {} seats. At each of {} shows, {} tickets are sold. "
        "How many seats stay empty over all the shows?",
        ((12, 40), (12, 40), (2, 9), (10, 143)),
        lambda a, b, c, d: (a * b - d) * c,
    ),
}


def _draw(rng: random.Random) -> tuple[str, Task]:
    """One (template, numbers) problem, keyed by both."""
    name = rng.choice(list(_TEMPLATES))
    template = _TEMPLATES[name]
    numbers = [rng.randint(lo, hi) for lo, hi in template.ranges]
    task = {"question": template.text.format(*numbers), "answer": template.answer(*numbers), "template": name}
    return f"{name}:{','.join(map(str, numbers))}", task


def _problems(split: str) -> Iterator[Task]:
    """Seeded, repeat-free problems owned by ``split``; the i-th depends only on the split."""
    return split_problems("calculator", split, _draw, _TEST_SHARE)


class CalculatorEnv(NumberQuestions, ToolEnv):
    """Multi-step arithmetic word problems with a calculator tool; reward 1.0 for the right final number.

    Each turn the model either calls ``calculator`` (native ``tool_calls`` or ``<tool_call>`` text) and gets
    the result as a ``tool`` message, or answers, which ends the episode: the final number of that reply is
    graded with :func:`envkit.extract_answer`. Running out of ``max_turns`` (default 6) truncates with reward 0.
    Problems come from a few word-problem templates with seeded numbers; train and test never share a problem
    (a stable hash of template and numbers picks the split). ``reset(seed=s)`` gives train task
    ``s % len(tasks("train"))``.
    """

    reward_range = (0.0, 1.0)

    max_turns = 6

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        system_prompt: str | None = None,
        num_train: int = 10_000,
        num_test: int = 500,
    ) -> None:
        super().__init__(max_turns=max_turns)
        self._splits = Splits(_problems, num_train=num_train, num_test=num_test, max_size=_MAX_SPLIT_SIZE)
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self._rng = random.Random()
        self._task: Task | None = None

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "37*24-158"
        """
        try:
            return _format(evaluate(expression))
        except ValueError as e:
            return f"Error: {e}"

    def tasks(self, split: str = "train") -> Sequence[Task]:
        """The tasks of ``split`` ("train" or "test") as a lazily generated sequence of task dicts."""
        return self._splits(split)

    def spaces(self) -> dict[str, Any]:
        return {
            "observation": "system prompt and a word problem; then tool results or feedback after each turn",
            "action": "assistant message: calculator tool calls, or a final answer ending 'The answer is N.'",
            "reward": "1.0 if the final answer is correct else 0.0; 0.0 when max_turns runs out",
            "max_turns": self.max_turns,
            "tools": [t.to_openai() for t in self.tools],
        }
