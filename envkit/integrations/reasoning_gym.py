"""The ``reasoning_gym`` scheme: ``envkit.make("reasoning_gym:leg_counting")``, any reasoning-gym dataset as a
one-turn env (the ``reasoning-gym`` extra).

The dataset's questions are the tasks, in disjoint train and test splits, and its own ``score_answer`` is the
reward. A procedural dataset draws item ``i`` from ``Random(seed + i)``, so a test split seeded with the train
seed + 1 is the train split shifted by one item: here the test split starts at seed ``seed + num_train``, past every
train item, and any test question that also appears in train (small datasets repeat questions) is left out.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.utils import SYSTEM_PROMPTS
from reasoning_gym.utils import extract_answer as extract_tag

from envkit.core import Env, StepResult, Task
from envkit.integrations import build
from envkit.messages import Message, system, user
from envkit.parsing import extract_answer

_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*(.+?)\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)


def _answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    return found[-1].strip() if found else None


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def _last_number(text: str) -> str | None:
    found = extract_answer(text)
    return None if found is None else found.text.replace(",", "")


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "tag": extract_tag,  # <answer>...</answer>, reasoning-gym's own format (its default system prompt asks for it)
    "answer_is": _answer_is,  # "The answer is X."
    "last_number": _last_number,  # the marked number (#### 4, \boxed{4}, "the answer is 4"), else the last one
    "last_line": _last_line,
    "whole": lambda text: text.strip() or None,
}
"""How the answer is read out of the reply (``answer=``); ``auto`` tries tag, then answer_is, then last_line."""


def extract(text: str, how: str) -> str | None:
    """The answer in ``text`` as ``how`` (a key of :data:`EXTRACTORS`, or ``auto``) reads it; None if none."""
    if how != "auto":
        return EXTRACTORS[how](text)
    for name in ("tag", "answer_is", "last_line"):
        found = EXTRACTORS[name](text)
        if found is not None:
            return found
    return None


class ReasoningGymEnv(Env):
    """A reasoning-gym dataset: answer its question in one reply, scored by the dataset's own scorer (0 to 1)."""

    reward_range = (0.0, 1.0)

    def __init__(self, dataset: str, *, num_train: int = 1000, num_test: int = 100, seed: int = 0,
                 answer: str = "auto", system_prompt: str | None = None, config: dict[str, Any] | None = None
                 ) -> None:
        if answer != "auto" and answer not in EXTRACTORS:
            raise ValueError(f"answer must be auto or one of {sorted(EXTRACTORS)}, got {answer!r}")
        if num_train < 1 or num_test < 0:
            raise ValueError(f"num_train must be >= 1 and num_test >= 0, got {num_train} and {num_test}")
        self.dataset, self.answer = dataset, answer
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        # reasoning-gym checks the name and the config here: a bad one fails at make()
        self._splits: dict[str, ProceduralDataset] = {
            "train": reasoning_gym.create_dataset(dataset, seed=seed, size=num_train, **(config or {})),
            "test": reasoning_gym.create_dataset(dataset, seed=seed + num_train, size=num_test, **(config or {})),
        }
        self._tasks: dict[str, list[Task]] = {}
        self._rng = random.Random()
        self._entry: dict[str, Any] | None = None
        self._scorer = self._splits["train"]

    def tasks(self, split: str = "train") -> list[Task]:
        """The split's questions; test leaves out any question train also asks."""
        if split not in self._splits:
            raise ValueError(f"reasoning_gym:{self.dataset} has splits train and test, not {split!r}")
        if split not in self._tasks:
            seen = {t["question"] for t in self.tasks("train")} if split == "test" else set()
            listed = [{"id": f"{split}-{i}", "split": split, "index": i, "question": entry["question"],
                       "answer": str(entry["answer"])}
                      for i, entry in enumerate(self._splits[split]) if entry["question"] not in seen]
            if self._splits[split].size and not listed:
                raise ValueError(f"reasoning_gym:{self.dataset}: every test question is also a train question (the "
                                 "config's question space is that small): lower num_train or widen the config")
            self._tasks[split] = listed
        return self._tasks[split]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Ask ``task``'s question, else train question ``seed % num_train``, else a random train question."""
        if task is None:
            train = self._splits["train"]
            task = {"split": "train", "index": (self._rng.randrange(len(train)) if seed is None else seed % len(train))}
        split, index = task.get("split"), task.get("index")
        if split not in self._splits or not isinstance(index, int) or not 0 <= index < len(self._splits[split]):
            raise ValueError(f"a reasoning_gym:{self.dataset} task names its split and index, as tasks() lists them; "
                             f"got {task!r:.160}")
        self._scorer = self._splits[split]
        self._entry = self._scorer[index]
        if "question" in task and task["question"] != self._entry["question"]:
            raise ValueError(f"task {task.get('id')!r} is not this env's {split} item {index} (another seed or "
                             "config made it)")
        opening = [system(self.system_prompt)] if self.system_prompt else []
        return [*opening, user(self._entry["question"])], {"split": split, "index": index}

    async def step(self, action: Message) -> StepResult:
        """Score the reply's answer with the dataset's scorer; the episode ends."""
        assert self._entry is not None  # the ContractChecker refuses step() before reset()
        found = extract(action.get("content") or "", self.answer)
        score = float(self._scorer.score_answer(found, self._entry))
        return StepResult([], reward=score, terminated=True,
                          info={"extracted": found, "expected": str(self._entry["answer"]), "correct": score == 1.0})

    def spaces(self) -> dict[str, Any]:
        return {"observation": f"a {self.dataset} question from reasoning-gym", "action": "a reply whose answer is "
                f"read as {self.answer}", "reward": "the dataset's score_answer, 0 to 1"}


def make_reasoning_gym(name: str, **kwargs: Any) -> ReasoningGymEnv:
    """The ``reasoning_gym`` scheme of ``envkit.make``: ``reasoning_gym:<dataset name>``."""
    return build(name, ReasoningGymEnv, kwargs)
