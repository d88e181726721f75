"""ArithmeticEnv: procedurally generated, seeded arithmetic with exactly checkable answers, in one turn or several."""

from __future__ import annotations

import functools
import itertools
import math
import operator
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from envkit import Env, Message, StepResult, Task, system, user
from envkit.errors import ResetNeededError
from envkit.parsing import grade_number
from envkit.tasks import TaskList, check_split, check_task, pick_task, stable_split

DEFAULT_SYSTEM_PROMPT = 'Solve the math problem. End your reply with "The answer is N." where N is the result.'

LEVELS: dict[int, tuple[int, str, int]] = {
    # level: (digits per operand, operators, operations per problem)
    1: (1, "+", 1),  # "3 + 5": 100 problems, small enough for a 135M model to learn
    2: (2, "+-", 1),  # "47 - 19"
    3: (2, "+-*", 1),  # "47 * 19"
    4: (2, "+-*", 2),  # "(12 + 7) * 3"
    5: (3, "+-*", 3),  # "(123 + 456) * (789 - 12)"
}

_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_TEST_SHARE = 0.2
# Spaces up to this size are enumerated and shuffled, so each split holds exactly the problems it owns.
_ENUMERABLE = 100_000

_Shape: TypeAlias = "tuple[_Shape, _Shape] | None"  # None is a number, a pair is an operation on two subtrees


@functools.cache
def _shapes(steps: int) -> tuple[_Shape, ...]:
    """Every binary tree with ``steps`` operations."""
    if steps == 0:
        return (None,)
    return tuple((left, right) for k in range(steps) for left in _shapes(k) for right in _shapes(steps - 1 - k))


@dataclass(frozen=True, slots=True)
class _Problem:
    expression: str
    key: str
    """The expression with the operands of + and * sorted: "3 + 5" and "5 + 3" must land in the same split."""
    answer: int
    ops: str
    """The operators it uses, in the order of _OPS: "+", "-*", ..."""


def _build(shape: _Shape, numbers: Iterator[int], ops: Iterator[str]) -> tuple[str, str, int]:
    """(expression, key, value) of a subtree, consuming numbers and operators left to right."""
    if shape is None:
        n = next(numbers)
        return str(n), str(n), n
    left, left_key, a = _build(shape[0], numbers, ops)
    op = next(ops)
    right, right_key, b = _build(shape[1], numbers, ops)
    # Parenthesising every inner operation makes each tree print differently, so distinct problems stay distinct.
    if shape[0] is not None:
        left, left_key = f"({left})", f"({left_key})"
    if shape[1] is not None:
        right, right_key = f"({right})", f"({right_key})"
    if op in "+*":
        left_key, right_key = sorted((left_key, right_key))
    return f"{left} {op} {right}", f"{left_key} {op} {right_key}", _OPS[op](a, b)


@dataclass(frozen=True, slots=True)
class _Space:
    """All problems of ``steps`` operations from ``ops`` on numbers of up to ``digits`` digits, indexed 0..size-1."""

    digits: int
    ops: str
    steps: int

    @property
    def size(self) -> int:
        return len(_shapes(self.steps)) * len(self.ops) ** self.steps * 10 ** (self.digits * (self.steps + 1))

    def problem(self, index: int) -> _Problem:
        index, shape = divmod(index, len(_shapes(self.steps)))
        ops = []
        for _ in range(self.steps):
            index, k = divmod(index, len(self.ops))
            ops.append(self.ops[k])
        numbers = []
        for _ in range(self.steps + 1):
            index, n = divmod(index, 10**self.digits)
            numbers.append(n)
        expression, key, answer = _build(_shapes(self.steps)[shape], iter(numbers), iter(ops))
        return _Problem(expression, key, answer, _in_order(ops))


def _split_tasks(spaces: dict[int, _Space], split: str, size: int) -> TaskList:
    """The tasks of one split, taken in turn from each level's problems; task i depends only on (spaces, split, i).

    A seeded walk visits each problem space without repetition and keeps the problems this split owns, so
    problems never repeat within a split. Small spaces are shuffled whole and hold only the problems they own
    (level 1 owns about 80 train and 20 test problems): a level that runs out leaves the turns to the others, and
    the split is capped at what all of them own. Spaces too large to count are capped at half the split's
    expected share: far below exhaustion, so sampling stays fast.
    """
    walks, available = [], 0
    for level, space in spaces.items():
        walk, owned = _walk(space, split)
        walks.append(zip(itertools.repeat(level), walk))
        available += owned
    tasks = (
        {"question": f"What is {p.expression}?", "answer": p.answer, "level": level, "expression": p.expression,
         "ops": p.ops}
        for level, p in _in_turn(walks)
    )
    return TaskList(tasks, min(size, available), prefix="-".join([split, *map(str, spaces)]))


def _walk(space: _Space, split: str) -> tuple[Iterator[_Problem], int]:
    """The problems of ``space`` that ``split`` owns, in a seeded order, and how many it may take."""
    rng = random.Random(f"{split}:{space.digits}:{space.ops}:{space.steps}")
    if space.size <= _ENUMERABLE:
        order = list(range(space.size))
        rng.shuffle(order)
        problems = [p for p in map(space.problem, order) if stable_split(p.key, _TEST_SHARE) == split]
        return iter(problems), len(problems)
    return _sample(space, split, rng), int(space.size * (_TEST_SHARE if split == "test" else 1 - _TEST_SHARE) / 2)


def _in_turn(walks: list[Iterator[tuple[int, _Problem]]]) -> Iterator[tuple[int, _Problem]]:
    """One item from each walk in turn, skipping the walks that ran out."""
    while walks:
        for walk in list(walks):
            item = next(walk, None)
            if item is None:
                walks.remove(walk)
            else:
                yield item


def _sample(space: _Space, split: str, rng: random.Random) -> Iterator[_Problem]:
    seen: set[int] = set()
    while True:
        index = rng.randrange(space.size)
        if index not in seen:
            seen.add(index)
            problem = space.problem(index)
            if stable_split(problem.key, _TEST_SHARE) == split:
                yield problem


def _space(level: int, digits: int | None, ops: str | None, steps: int | None) -> _Space:
    """``level``'s problem space, with any of its preset's digits, operators and operations overridden."""
    preset_digits, preset_ops, preset_steps = LEVELS[level]
    digits = preset_digits if digits is None else digits
    ops = preset_ops if ops is None else ops
    steps = preset_steps if steps is None else steps
    if not 1 <= digits <= 9:
        raise ValueError(f"digits must be between 1 and 9, got {digits!r}")
    if not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops must be a non-empty string of operators from {''.join(_OPS)!r}, got {ops!r}")
    if not 1 <= steps <= 6:
        raise ValueError(f"steps must be between 1 and 6, got {steps!r}")
    # Canonical operator order, so "*+" and "+*" generate the same problems.
    return _Space(digits, _in_order(ops), steps)


def _in_order(ops: Iterable[str]) -> str:
    """The distinct operators of ``ops`` in the order of _OPS ("+-*")."""
    return "".join(op for op in _OPS if op in ops)


class ArithmeticEnv(Env):
    """Arithmetic: answer "What is 3 + 5?" for reward 1.0; one turn, or several with followups ("Now add 7").

    Problems are generated from (split, level, index), so they are reproducible and cheap. Levels, with
    operands of up to the given number of digits (0..9, 0..99, ...): 1 one-digit addition (100 problems),
    2 two-digit + and -, 3 two-digit +, - and *, 4 two operations with parentheses on two-digit numbers,
    5 three operations on three-digit numbers. ``digits``, ``ops`` and ``steps`` override the level's preset.
    A list of levels (``level=[2, 3, 4]``) is a mixture of difficulties: each split takes its problems from
    the levels in turn. Each task names its ``level`` and the operators its expression uses (``ops``: "+", "-*",
    ...), which a curriculum can group tasks by (``curriculum.group_by=[level,ops]``).
    Answers are integers and may be negative. Train and test never share a problem: each problem belongs to
    one split by a stable hash of its expression, with a + b and b + a counted as one problem.

    The final number of the reply is graded (see :func:`envkit.extract_answer`); ``format_bonus`` is added when
    the reply marks it explicitly (``#### N``, ``\\boxed{N}``, "The answer is N"), right or wrong.
    ``reset(seed=s)`` gives train task ``s % len(tasks("train"))``, so seeds beyond the split size repeat tasks.

    ``followups=k`` makes each episode k + 1 model turns: after each answer the env says whether it was right,
    gives the right value, and asks to add a one-digit number to it ("Now add 7 to it."). Each turn earns
    1 / (k + 1) when right, so an episode scores 1.0 only when every answer is. Giving the right value keeps each
    turn gradeable on its own: one wrong answer does not doom the rest of the episode.
    """

    snapshot_exclude = frozenset({"_splits"})  # generated task lists: the same in every env of these kwargs

    def __init__(
        self,
        *,
        level: int | Sequence[int] = 1,
        digits: int | None = None,
        ops: str | None = None,
        steps: int | None = None,
        format_bonus: float = 0.0,
        system_prompt: str | None = None,
        num_train: int = 10_000,
        num_test: int = 500,
        followups: int = 0,
    ) -> None:
        levels = [level] if isinstance(level, int) else list(level)
        if not levels or any(lv not in LEVELS for lv in levels) or len(set(levels)) < len(levels):
            raise ValueError(f"level must be one of {sorted(LEVELS)}, or a list of distinct ones, got {level!r}")
        if len(levels) > 1 and (digits, ops, steps) != (None, None, None):
            raise ValueError(f"digits, ops and steps override one level's preset, not a mixture's (level={level!r})")
        self._spaces = {lv: _space(lv, digits, ops, steps) for lv in levels}
        if not math.isfinite(format_bonus) or format_bonus < 0:
            raise ValueError(f"format_bonus must be a finite number >= 0, got {format_bonus!r}")
        if num_train < 1:
            raise ValueError(f"num_train must be >= 1 (reset(seed=...) draws from it), got {num_train!r}")
        if num_test < 0:
            raise ValueError(f"num_test must be >= 0, got {num_test!r}")
        if not 0 <= followups <= 16:
            raise ValueError(f"followups must be between 0 and 16, got {followups!r}")
        if followups and format_bonus * (followups + 1) >= 1:
            raise ValueError(f"format_bonus={format_bonus!r} with followups={followups!r} lets marked wrong answers "
                             "reach reward 1.0 (a pass): keep format_bonus below 1/(followups+1)")
        self.level = levels[0] if len(levels) == 1 else levels
        self.format_bonus = float(format_bonus)
        self.reward_range = (0.0, (1.0 + self.format_bonus) / (followups + 1))
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self._sizes = {"train": num_train, "test": num_test}
        self.followups = followups
        self._splits: dict[str, TaskList] = {}
        self._rng = random.Random()
        self._expected: int | float | None = None
        self._addends: list[int] = []

    def tasks(self, split: str = "train") -> Sequence[Task]:
        """The tasks of ``split`` ("train" or "test") as a lazily generated sequence of task dicts."""
        if check_split(split) not in self._splits:
            self._splits[split] = _split_tasks(self._spaces, split, self._sizes[split])
        return self._splits[split]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task`` if given, else on the train task picked by ``seed``, else a random one."""
        if task is not None:
            check_task(task, question=str, answer=(int, float))
        else:
            task = pick_task(self.tasks("train"), seed, self._rng)
        self._expected = task["answer"]
        # The addends depend only on the question, so a task is the same episode every time it is played.
        addends = random.Random(f"followups:{task['question']}")
        self._addends = [addends.randint(1, 9) for _ in range(self.followups)]
        return [system(self.system_prompt), user(task["question"])], {"task": task}

    async def step(self, action: Message) -> StepResult:
        """Grade the reply; ask the next follow-up, or end the episode after the last one."""
        if self._expected is None:
            raise ResetNeededError("step() needs an active episode; call reset() first.")
        expected = self._expected
        info = grade_number(action.get("content"), expected)
        explicit = info.pop("explicit")
        reward = (float(info["correct"]) + (self.format_bonus if explicit else 0.0)) / (self.followups + 1)
        if not self._addends:
            self._expected = None
            return StepResult([], reward=reward, terminated=True, info=info)
        addend = self._addends.pop(0)
        self._expected = expected + addend
        verdict = "Correct" if info["correct"] else f"Not quite: it is {expected}"
        return StepResult([user(f"{verdict}. Now add {addend} to it. What is the result?")], reward=reward,
                          info=info)

    def spaces(self) -> dict[str, Any]:
        # one level's preset, as overridden; a mixture has one per level
        [space, *rest] = self._spaces.values()
        return {
            "observation": 'system prompt, then a user message "What is <expression>?"; with followups, after each '
            'answer: the right value and "Now add <k> to it."',
            "action": "assistant message whose final (preferably marked) number is the answer",
            "reward": f"per turn 1/(followups+1) if correct else 0.0, plus format_bonus={self.format_bonus} for a "
            "marked answer (divided alike)",
            "followups": self.followups,
            "level": self.level,
            **({} if rest else {"digits": space.digits, "ops": space.ops, "steps": space.steps}),
        }
