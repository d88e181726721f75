"""ReferentialGame: a speaker sees a hidden target, a listener sees four options and the speaker's message."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from envkit import Message, Task, system, user
from envkit.multi_agent import MultiAgentEnv, Seat, Turn

WORDS = ("cat", "dog", "fish", "bird", "horse", "cow", "frog", "bear", "lion", "duck", "goat", "sheep")
"""The words targets and options are drawn from."""

SYSTEM_PROMPT = 'Solve the problem. End your reply with "The answer is W."'


def pick(reply: str, options: list[str]) -> str | None:
    """The option a reply picks: the last of the options it names (whole words, any case); None if it names none."""
    named = [m.group(0).lower() for m in re.finditer(r"[A-Za-z]+", reply) if m.group(0).lower() in options]
    return named[-1] if named else None


class ReferentialGame(MultiAgentEnv):
    """Two seats must agree: the speaker is told a target word, the listener must pick it among four options.

    The speaker moves first and sees only the target; the listener sees the options (the target among them, in a
    seeded order) and the speaker's message, and answers. Both seats get reward 1 when the listener's reply picks
    the target (:func:`pick`: the last option it names), else 0: chance is 25% for a listener that ignores the
    speaker. The speaker's view never holds the options, the listener's never the target.

    Tasks are enumerable: every choice of four options and a target among them, split once into ``train`` and a
    held-out ``test`` of ``test_size`` tasks.
    """

    seats = ("speaker", "listener")
    reward_range = (0.0, 1.0)

    def __init__(self, *, words: tuple[str, ...] | list[str] = WORDS, test_size: int = 200) -> None:
        self.words = tuple(w.lower() for w in words)
        if len(set(self.words)) < 4:
            raise ValueError(f"words must hold at least 4 distinct words, got {words!r}")
        everything = [{"options": list(options), "target": target}
                      for options in itertools.combinations(self.words, 4) for target in options]
        random.Random(0).shuffle(everything)
        if not 0 < test_size < len(everything):
            raise ValueError(f"test_size must be between 1 and {len(everything) - 1}, got {test_size}")
        self._splits = {"test": everything[:test_size], "train": everything[test_size:]}
        for split, tasks in self._splits.items():
            for i, task in enumerate(tasks):
                task["id"] = f"{split}-{i}"
        self._task: Task | None = None
        self._message = ""

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"no split {split!r}: train or test")
        return self._splits[split]

    def secrets(self, seat: Seat) -> list[str]:
        """The speaker's: which option is the target (the listener is shown the options, not which)."""
        return [f"The target is {self._task['target']}"] if seat == "speaker" and self._task else []

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        if task is None:
            rng = random.Random(seed)
            options = rng.sample(self.words, 4)
            task = {"id": f"seed-{seed}", "options": options, "target": rng.choice(options)}
        options = [str(o).lower() for o in task["options"]]
        if len(set(options)) != len(options) or str(task["target"]).lower() not in options:
            raise ValueError(f"a task needs distinct options and its target among them, got {task!r}")
        order = list(options)
        random.Random(str(task.get("id", options))).shuffle(order)  # the target's place says nothing
        self._task = {**task, "options": order, "target": str(task["target"]).lower()}
        self._message = ""
        return Turn({"speaker": [system(SYSTEM_PROMPT),
                                 user(f"Name the target for your partner. The target is {self._task['target']}.")]},
                    to_act=("speaker",))

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        assert self._task is not None
        if "speaker" in actions:
            self._message = str(actions["speaker"].get("content") or "").strip()
            options = ", ".join(self._task["options"])
            return Turn({"listener": [system(SYSTEM_PROMPT),
                                      user(f"Which of {options} does your partner name here: {self._message}")]},
                        to_act=("listener",))
        choice = pick(str(actions["listener"].get("content") or ""), self._task["options"])
        won = float(choice == self._task["target"])
        told = f"The listener picked {choice or 'none of the options'}; the target was {self._task['target']}."
        info: dict[str, Any] = {"target": self._task["target"], "picked": choice, "message": self._message}
        return Turn({"speaker": [user(told)], "listener": [user(told)]}, to_act=(),
                    rewards={"speaker": won, "listener": won}, terminated=True, info=info)
