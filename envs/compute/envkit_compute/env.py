"""ComputeEnv: number questions that a short program answers, solved by running Python or bash in a sandbox."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from envkit import Message, Task, assistant
from envkit.errors import InvalidTaskError, ResetNeededError
from envkit.tasks import Splits, split_problems
from envkit.tool_env import NumberQuestions
from sandboxes.tools import CodeTools

DEFAULT_SYSTEM_PROMPT = """\
You can run code. To run Python, write exactly:
<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>
To run a shell command, call "bash" with {"command": "..."}. What the code prints comes back in the next message.
When you are done, end your reply with "The answer is N." where N is the final number."""

_TEST_SHARE = 0.2


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytes(len(range(p * p, n, p)))
    return [i for i in range(n) if sieve[i]]


def _fibonacci_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def _divisor_count(n: int) -> int:
    return sum(1 if d * d == n else 2 for d in range(1, int(n**0.5) + 1) if n % d == 0)


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


@dataclass(frozen=True, slots=True)
class _Kind:
    text: str
    ranges: tuple[tuple[int, int], ...]
    answer: Callable[..., int]
    program: Callable[..., str]
    """A short Python program that prints the answer (what a demonstration runs in the sandbox)."""


_IS_PRIME = "all(p % d for d in range(2, int(p ** 0.5) + 1))"

_KINDS: dict[str, _Kind] = {
    "prime_sum": _Kind("What is the sum of all prime numbers below {}?", ((100, 20_000),),
                       lambda n: sum(_primes_below(n)),
                       lambda n: f"n = {n}\nprint(sum(p for p in range(2, n) if {_IS_PRIME}))"),
    "prime_count": _Kind("How many prime numbers are there below {}?", ((100, 50_000),),
                         lambda n: len(_primes_below(n)),
                         lambda n: f"n = {n}\nprint(sum(1 for p in range(2, n) if {_IS_PRIME}))"),
    "divisors": _Kind("How many positive divisors does {} have?", ((1_000, 999_999),),
                      _divisor_count,
                      lambda n: f"n = {n}\nprint(sum(1 for d in range(1, n + 1) if n % d == 0))"),
    "fibonacci": _Kind("What is the {}th Fibonacci number modulo {}? (F(0) = 0, F(1) = 1)", ((50, 5_000), (97, 9_973)),
                       _fibonacci_mod,
                       lambda n, m: f"n, m = {n}, {m}\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % m\n"
                                    "print(a)"),
    "digit_sum": _Kind("What is the sum of the decimal digits of 2 to the power {}?", ((50, 2_000),),
                       lambda k: sum(map(int, str(2**k))),
                       lambda k: f"print(sum(int(c) for c in str(2 ** {k})))"),
    "collatz": _Kind("Starting from {}, how many steps of the Collatz map (n/2 if n is even, else 3n+1) reach 1?",
                     ((10, 100_000),), _collatz_steps,
                     lambda n: f"n = {n}\nsteps = 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
                               "    steps += 1\nprint(steps)"),
    "multiples": _Kind("How many integers from 1 to {} are divisible by {} or by {}?",
                       ((1_000, 1_000_000), (3, 30), (31, 97)), lambda n, a, b: n // a + n // b - n // math.lcm(a, b),
                       lambda n, a, b: f"n, a, b = {n}, {a}, {b}\n"
                                       "print(sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0))"),
}


def _draw(rng: random.Random) -> tuple[str, Task]:
    """One (kind, numbers) problem, keyed by both."""
    name = rng.choice(list(_KINDS))
    kind = _KINDS[name]
    numbers = [rng.randint(lo, hi) for lo, hi in kind.ranges]
    task = {"question": kind.text.format(*numbers), "answer": kind.answer(*numbers), "kind": name, "args": numbers}
    return f"{name}:{','.join(map(str, numbers))}", task


def _problems(split: str) -> Iterator[Task]:
    """Seeded, repeat-free problems owned by ``split``; the i-th depends only on the split."""
    return split_problems("compute", split, _draw, _TEST_SHARE)


class ComputeEnv(NumberQuestions, CodeTools):
    """Number questions a short program answers (sums of primes, divisor counts, Fibonacci residues, ...);
    reward 1.0 for the right final number.

    Each turn the model either runs code with the ``python`` or ``bash`` tool, in a sandbox leased for the episode
    (files persist between calls; see :mod:`sandboxes.tools`), or answers, which ends the episode. Running out of
    ``max_turns`` (default 6) truncates with reward 0. Train and test never share a problem.

    It demonstrates its own tasks (:meth:`demonstrate`): a ``python`` call with a short program for the question,
    then "The answer is N." with N what the program printed in the sandbox.
    """

    answer_types = int

    reward_range = (0.0, 1.0)

    max_turns = 6
    code_pool_size = 4

    def __init__(self, *, max_turns: int | None = None, system_prompt: str | None = None, num_train: int = 10_000,
                 num_test: int = 500, pool_size: int | None = None, allowed_tools: Sequence[str] | None = None,
                 code_sandbox: str | None = None) -> None:
        super().__init__(max_turns=max_turns)
        if code_sandbox is not None:  # docker: never run model code unisolated, fail instead
            if code_sandbox not in ("docker", "local", "auto"):
                raise ValueError(f"code_sandbox must be docker, local or auto, got {code_sandbox!r}")
            self.code_sandbox = code_sandbox
        if allowed_tools is not None:  # e.g. ["python"]: a shorter prompt, one way to run code
            unknown = sorted(set(allowed_tools) - {t.name for t in self.tools})
            if unknown or not allowed_tools:
                raise ValueError(f"allowed_tools must name some of {[t.name for t in self.tools]}, got "
                                 f"{list(allowed_tools)}")
            self.tools = [t for t in self.tools if t.name in allowed_tools]  # type: ignore[misc]
        if pool_size is not None:
            if pool_size < 1:
                raise ValueError(f"pool_size must be >= 1, got {pool_size}")
            self.code_pool_size = pool_size
        self._splits = Splits(_problems, num_train=num_train, num_test=num_test)
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self._rng = random.Random()
        self._task: Task | None = None

    def tasks(self, split: str = "train") -> Sequence[Task]:
        """The tasks of ``split`` ("train" or "test") as a lazily generated sequence of task dicts."""
        return self._splits(split)

    async def demonstrate(self, messages: list[Message]) -> Message:
        """Run the task's program with the ``python`` tool; once it printed, answer with what it printed."""
        if self._task is None:
            raise ResetNeededError("demonstrate() needs an active episode; call reset() first.")
        outputs = [m for m in messages if m["role"] == "tool"]
        if outputs:
            return assistant(f"The answer is {(outputs[-1]['content'] or '').strip()}.")
        kind, args = self._task.get("kind"), self._task.get("args")
        if kind not in _KINDS or not isinstance(args, list):
            raise InvalidTaskError(f"only the env's own tasks can be demonstrated (a known 'kind' and its 'args'), "
                                   f"got {self._task!r:.120}")
        code = _KINDS[kind].program(*args)
        return assistant(None, [{"id": "call_0", "type": "function",
                                 "function": {"name": "python", "arguments": json.dumps({"code": code})}}])

    def spaces(self) -> dict[str, Any]:
        return {
            "observation": "system prompt and a number question; then tool output after each call",
            "action": "assistant message: python/bash tool calls, or a final answer ending 'The answer is N.'",
            "reward": "1.0 if the final answer is correct else 0.0; 0.0 when max_turns runs out",
            "max_turns": self.max_turns,
            "tools": [t.to_openai() for t in self.tools],
        }
