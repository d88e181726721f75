"""The code env: the model writes a Python function, hidden unit tests grade it; reward = fraction passed.

Model-written code is untrusted, so this env runs it only inside a sandbox: it is meant to be served by
``envkit serve code`` in a container (``envkit.make("code", sandbox="docker")``), where ``ENVKIT_SANDBOX=docker``
is set. Anywhere else constructing it raises, unless ``ENVKIT_CODE_UNSAFE=1`` says the caller accepts the risk.

The submission runs through :mod:`envkit.agents.untrusted` in a child process that only returns the function's outputs;
the expected values stay in this process, so printing a fake verdict earns nothing. In the env image the child
runs as a uid of its own: it cannot read this package (the image keeps it readable by root only), and every
process it starts is killed when the run ends.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import envkit
from envkit.agents import untrusted
from envkit.tasks import check_task

UNSAFE_ENV = "ENVKIT_CODE_UNSAFE"
SANDBOX_ENV = "ENVKIT_SANDBOX"
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

# Runs in the child: read {"code", "function", "inputs"} on stdin, print one JSON line of results.
_RUNNER = r"""
import json, sys
job = json.loads(sys.stdin.read())
sys.stdin = None
results = []
try:
    scope = {"__name__": "submission"}
    exec(compile(job["code"], "<submission>", "exec"), scope)
    fn = scope[job["function"]]
except BaseException as e:
    print("\x00" + json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}))
    raise SystemExit(0)
for args in job["inputs"]:
    try:
        results.append({"ok": fn(*args)})
    except BaseException as e:
        results.append({"error": f"{type(e).__name__}: {e}"[:300]})
print("\x00" + json.dumps({"results": results}, default=repr))
"""


@dataclass(frozen=True)
class Problem:
    """One task: write ``function`` as described; ``tests`` are hidden (arguments, expected result) pairs."""

    id: str
    function: str
    prompt: str
    tests: tuple[tuple[tuple[Any, ...], Any], ...]


PROBLEMS: tuple[Problem, ...] = (
    Problem("add", "add", "Write `add(a, b)` that returns the sum of two integers.",
            (((1, 2), 3), ((-5, 5), 0), ((100, 23), 123), ((0, 0), 0))),
    Problem("reverse-words", "reverse_words",
            "Write `reverse_words(s)` that returns the words of `s` in reverse order, joined by single spaces.",
            ((("hello world",), "world hello"), (("a b c",), "c b a"), (("  one  ",), "one"), (("",), ""))),
    Problem("palindrome", "is_palindrome",
            "Write `is_palindrome(s)` that returns True when `s` reads the same backwards, ignoring case and "
            "non-alphanumeric characters.",
            ((("Racecar",), True), (("A man, a plan, a canal: Panama",), True), (("hello",), False),
             (("",), True))),
    Problem("fizzbuzz", "fizzbuzz",
            "Write `fizzbuzz(n)` that returns a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for "
            "multiples of 5, 'FizzBuzz' for both, else the number.",
            (((3,), ["1", "2", "Fizz"]), ((5,), ["1", "2", "Fizz", "4", "Buzz"]), ((0,), []),
             ((15,), ["1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz", "11", "Fizz", "13", "14",
                      "FizzBuzz"]))),
    Problem("gcd", "gcd", "Write `gcd(a, b)` that returns the greatest common divisor of two non-negative integers.",
            (((12, 18), 6), ((7, 13), 1), ((0, 9), 9), ((100, 75), 25))),
    Problem("running-sum", "running_sum",
            "Write `running_sum(xs)` that returns the list of prefix sums of the list of numbers `xs`.",
            ((([1, 2, 3],), [1, 3, 6]), (([],), []), (([5],), [5]), (([1, -1, 1],), [1, 0, 1]))),
    Problem("count-vowels", "count_vowels",
            "Write `count_vowels(s)` that returns how many characters of `s` are vowels (a, e, i, o, u; any case).",
            ((("hello",), 2), (("AEIOU",), 5), (("xyz",), 0), (("",), 0))),
    Problem("second-largest", "second_largest",
            "Write `second_largest(xs)` that returns the second largest distinct value in the list `xs`, or None "
            "when there is none.",
            ((([1, 2, 3],), 2), (([3, 3, 1],), 1), (([5],), None), (([2, 2],), None))),
)
_BY_ID = {p.id: p for p in PROBLEMS}
_SPLITS = {"train": PROBLEMS[:6], "test": PROBLEMS[6:]}

SYSTEM_PROMPT = "You are a careful Python programmer. Answer with one ```python code block defining the function."


def extract_code(text: str) -> str:
    """The last fenced code block of ``text``, or all of it when there is none."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


class CodeEnv(envkit.Env):
    """Write a Python function that passes hidden unit tests; reward = fraction passed (runs only in a sandbox)."""

    reward_range = (0.0, 1.0)

    def __init__(self, *, timeout_s: float = 5.0, max_output_bytes: int = 1 << 20) -> None:
        if os.environ.get(SANDBOX_ENV) != "docker" and os.environ.get(UNSAFE_ENV) != "1":
            raise RuntimeError(
                "the code env executes model-written code and runs only inside a container: use "
                "envkit.make('code', sandbox='docker') (or serve it in an image from `envkit build code`); "
                f"{UNSAFE_ENV}=1 overrides this at your own risk")
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.problem: Problem | None = None

    def tasks(self, split: str = "train") -> Iterable[envkit.Task]:
        """``{"id": ...}`` for each problem of ``split`` (train: 6, test: 2)."""
        return [{"id": p.id} for p in _SPLITS[split]]

    async def reset(self, *, seed: int | None = None, task: envkit.Task | None = None
                    ) -> tuple[list[envkit.Message], dict]:
        """A problem by ``task={"id": ...}`` or by ``seed`` (index into all problems)."""
        if task is not None:
            problem_id = check_task(task, id=str)["id"]
            if problem_id not in _BY_ID:
                raise envkit.errors.InvalidTaskError(f"unknown problem {problem_id!r}; known: {sorted(_BY_ID)}")
            self.problem = _BY_ID[problem_id]
        else:
            self.problem = PROBLEMS[(seed or 0) % len(PROBLEMS)]
        return [envkit.system(SYSTEM_PROMPT), envkit.user(self.problem.prompt)], {"problem": self.problem.id}

    async def step(self, action: envkit.Message) -> envkit.StepResult:
        """Run the submission on the hidden tests in a child process; one step ends the episode."""
        assert self.problem is not None
        outcome = await self._run(extract_code(action.get("content") or ""), self.problem)
        total = len(self.problem.tests)
        passed = 0
        if "results" in outcome:
            for (_, expected), got in zip(self.problem.tests, outcome["results"], strict=False):
                passed += int("ok" in got and got["ok"] == json.loads(json.dumps(expected)))
        info = {"passed": passed, "total": total, **{k: v for k, v in outcome.items() if k != "results"}}
        feedback = f"{passed}/{total} hidden tests passed."
        return envkit.StepResult([envkit.user(feedback)], reward=passed / total, terminated=True, info=info)

    async def _run(self, code: str, problem: Problem) -> dict[str, Any]:
        job = json.dumps({"code": code, "function": problem.function, "inputs": [list(a) for a, _ in problem.tests]})
        # A uid of its own where the server may switch users (in its image): the submission cannot read this
        # package (the hidden tests), nor outlive the run by starting a new session.
        async with untrusted.users.lease() as uid:
            result = await untrusted.run([untrusted.python(), "-I", "-c", _RUNNER], stdin=job.encode(), user=uid,
                                         timeout_s=self.timeout_s, output_limit=self.max_output_bytes, cwd="/tmp")
            if uid is not None:
                await untrusted.remove_files(uid, "/tmp")
        if result.timed_out:
            return {"error": f"timed out after {self.timeout_s:g} s"}
        _, marker, last = result.stdout.decode(errors="replace").rpartition("\x00")
        if not marker:
            return {"error": f"the submission exited with status {result.exit_code} without results"}
        try:
            return json.loads(last.strip().splitlines()[0])
        except (json.JSONDecodeError, IndexError):
            return {"error": "the submission garbled its results"}
