"""NumberDuel: two seats each name a whole number up to a limit, the first, then the second; the higher one wins."""

from __future__ import annotations

from envkit import Message, Task, extract_answer, system, user
from envkit.multi_agent import MultiAgentEnv, Seat, Turn

SYSTEM_PROMPT = 'Solve the problem. End your reply with "The answer is N."'
TEST_LIMITS = (7, 13, 19)
"""The held-out limits: a policy that wins there reads the limit, rather than remembering one number."""


class NumberDuel(MultiAgentEnv):
    """A competitive game: the seat that names the higher whole number from 1 to the task's ``limit`` wins.

    ``first`` names its number; ``second`` is told it, then names its own. The winner gets 1, the loser 0, a tie
    0.5 each. A reply whose answer (:func:`envkit.parse_number` of its last number) is not a whole number within
    1..limit loses to a valid one (both invalid: 0 each). Moving second is an advantage (only a first move of
    ``limit`` cannot be beaten), which per-seat baselines keep from being learned as skill.

    Tasks: one per limit from 5 to 20, the limits in :data:`TEST_LIMITS` held out as ``test``.
    """

    seats = ("first", "second")
    reward_range = (0.0, 1.0)

    def __init__(self) -> None:
        self.limit = 10
        self.picks: dict[Seat, int | None] = {}

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"no split {split!r}: train or test")
        limits = [m for m in range(5, 21) if (m in TEST_LIMITS) == (split == "test")]
        return [{"id": f"up-to-{m}", "limit": m} for m in limits]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        self.limit = int(task["limit"]) if task is not None else 5 + (seed or 0) % 16
        self.picks = {}
        rules = (f"We play a number duel. Name a whole number from 1 to {self.limit}. "
                 "The higher number wins.")
        return Turn({"first": [system(SYSTEM_PROMPT), user(rules)]}, to_act=("first",))

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        (seat, action), = actions.items()
        self.picks[seat] = self._valid(str(action.get("content") or ""))
        if seat == "first":
            told = "nothing valid" if self.picks["first"] is None else str(self.picks["first"])
            rules = (f"We play a number duel. Name a whole number from 1 to {self.limit}. The higher number wins. "
                     f"Your opponent named {told}.")
            return Turn({"second": [system(SYSTEM_PROMPT), user(rules)]}, to_act=("second",))
        first, second = self.picks["first"], self.picks["second"]
        rewards = {"first": _score(first, second), "second": _score(second, first)}
        ended = f"First named {first}, second named {second}."
        return Turn({s: [user(ended)] for s in self.seats}, to_act=(), rewards=rewards, terminated=True,
                    info={"limit": self.limit, "first": first, "second": second})

    def _valid(self, reply: str) -> int | None:
        answer = extract_answer(reply)
        if answer is None or answer.value != int(answer.value) or not 1 <= answer.value <= self.limit:
            return None
        return int(answer.value)


def _score(mine: int | None, theirs: int | None) -> float:
    if mine is None:
        return 0.0
    if theirs is None or mine > theirs:
        return 1.0
    return 0.5 if mine == theirs else 0.0
