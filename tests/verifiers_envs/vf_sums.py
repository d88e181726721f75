"""A verifiers environment (the classic API) for envkit's adapter tests, loaded from PYTHONPATH by name: ``vf_sums`` is
multi-turn (the env asks again after the first reply), and with ``tools=True`` a tool env with an ``add`` tool. The
rubric pays a reply that contains the sum; the dataset is 12 sums, the eval dataset 4 others."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _rows(pairs: list[tuple[int, int]]) -> Dataset:
    return Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs])


def contains_answer(completion: vf.Messages, answer: str, **_: object) -> float:
    """1.0 when the last assistant message contains the sum."""
    replies = [m for m in completion if m["role"] == "assistant"]
    return float(bool(replies) and answer in str(replies[-1].get("content") or ""))


class AskTwice(vf.MultiTurnEnv):
    """Two model turns: after the first reply the env asks for the answer alone."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: object) -> vf.Messages:
        return [{"role": "user", "content": "Say only the number."}]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def load_environment(tools: bool = False) -> vf.Environment:
    """The multi-turn sums env, or with ``tools=True`` the tool env."""
    train = _rows([(a, b) for a in range(1, 5) for b in range(1, 4)])
    test = _rows([(5, 5), (6, 1), (7, 2), (8, 1)])
    rubric = vf.Rubric(funcs=[contains_answer])
    if tools:
        return vf.ToolEnv(dataset=train, eval_dataset=test, tools=[add], rubric=rubric, max_turns=3)
    return AskTwice(dataset=train, eval_dataset=test, rubric=rubric, max_turns=2)
