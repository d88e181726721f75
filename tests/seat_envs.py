"""Multi-agent envs for the tests: what they check does not depend on what the model knows.

``GradedPair``: two seats take turns twice each, every seat told a secret of its own that the other must never see;
its per-seat reward varies with any reply (so a tiny model's groups are never flat and every step updates both
policies); ``JudgedPair``, the same scored half by the run's judge. ``Simultaneous``: both seats move at once each
round, each seeing the other's last move; ``SecretDuet``, the same with a secret told to each seat. ``one_call`` is
an agent that owns its loop, at its simplest.
"""

from __future__ import annotations

import random
from dataclasses import replace

from envkit import Message, Task, system, user
from envkit.agents.agent import AgentClient
from envkit.multi_agent import MultiAgentEnv, Seat, Turn
from envkit.rewards.judges import LLMJudge
from envkit.rewards.rubrics import Episode


def secret(seat: Seat, seed: int | None) -> str:
    """The private words ``seat`` is told in the episode of ``seed``."""
    return f"SECRET-{seat}-{seed}-{random.Random(f'{seat}{seed}').randrange(10**6)}"


def graded(reply: str) -> float:
    """A reward in [0, 1] that changes with almost any change of the reply."""
    return (sum(map(ord, reply)) % 11) / 10


class GradedPair(MultiAgentEnv):
    """``first`` and ``second`` alternate, ``rounds`` turns each; each sees the other's last reply as data."""

    seats = ("first", "second")
    reward_range = (0.0, 1.0)

    def __init__(self, *, rounds: int = 2, flat_odd: bool = False) -> None:
        self.rounds = rounds
        self.flat_odd = flat_odd
        """Score every reply of an odd seed's episode 0: starts no policy learns from (a curriculum's refill draws
        again for them)."""
        self.seed: int | None = None
        self.turns = 0

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": f"{split}-{i}", "seed": i + (0 if split == "train" else 1000)} for i in range(20)]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        self.seed = task["seed"] if task is not None else seed
        self.turns = 0
        return Turn({seat: [system(f"Keep this to yourself: {secret(seat, self.seed)}."),
                            user("Say something.")] for seat in self.seats}, to_act=("first",))

    def secrets(self, seat: Seat) -> list[str]:
        return [secret(seat, self.seed)]

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        (seat, action), = actions.items()
        other = "second" if seat == "first" else "first"
        self.turns += 1
        reply = str(action.get("content") or "")
        done = self.turns == 2 * self.rounds
        return Turn({other: [user(f"Your partner said: {reply}")]}, to_act=() if done else (other,),
                    rewards={seat: 0.0 if self.flat_odd and (self.seed or 0) % 2 else graded(reply)},
                    terminated=done, info={"turns": self.turns})


class JudgedPair(GradedPair):
    """GradedPair whose per-step reward is half its grade and half the run's judge's score of the reply (an LLM
    judge made with no endpoint calls the judge the run publishes: ``judge.model``); the grade keeps a small judge's
    alike scores from making a group flat."""

    def __init__(self, *, rounds: int = 2) -> None:
        super().__init__(rounds=rounds)
        self.judge = LLMJudge("The reply is friendly.", constrain="regex", max_tokens=16, second_look=False)

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        turn = await super().step(actions)
        (seat, action), = actions.items()
        score = await self.judge.score(Episode(task=None, messages=[user("Say something."), action]))
        return replace(turn, rewards={seat: (turn.rewards[seat] + score.value) / 2})


class Simultaneous(MultiAgentEnv):
    """Both seats move at once for ``rounds`` rounds; each then sees the other's move. A move with more words than
    the other's wins the round."""

    seats = ("east", "west")

    def __init__(self, *, rounds: int = 2, flat_odd: bool = False) -> None:
        self.rounds = rounds
        self.flat_odd = flat_odd
        """Score every reply of an odd seed's episode 0: starts no policy learns from (a curriculum's refill draws
        again for them)."""
        self.round = 0

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        self.round = 0
        return Turn({seat: [user("Move.")] for seat in self.seats}, to_act=self.seats)

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        self.round += 1
        words = {seat: len(str(a.get("content") or "").split()) for seat, a in actions.items()}
        done = self.round == self.rounds
        return Turn({"east": [user(f"West moved: {actions['west'].get('content')}")],
                     "west": [user(f"East moved: {actions['east'].get('content')}")]},
                    to_act=() if done else self.seats, terminated=done,
                    rewards={seat: float(words[seat] > words[other])
                             for seat, other in (("east", "west"), ("west", "east"))})


class SecretDuet(Simultaneous):
    """Simultaneous, each seat told a secret of its own first: two agent processes hold theirs at the same time."""

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        self.seed = seed
        turn = await super().reset(seed=seed, task=task)
        for seat in self.seats:
            turn.observations[seat].insert(0, system(f"Keep this to yourself: {secret(seat, seed)}."))
        return turn

    def secrets(self, seat: Seat) -> list[str]:
        return [secret(seat, self.seed)]


async def one_call(task: Task, client: AgentClient) -> str:
    """An agent for a seat: one call per turn with the seat's chat so far, through the openai SDK; its move is the
    reply signed ``[one_call]``."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
        reply = await llm.chat.completions.create(model=client.model, messages=task["messages"])
    return f"{reply.choices[0].message.content or ''} [one_call]"


class LeakyPair(GradedPair):
    """GradedPair with a bug: it shows ``second`` the opening ``first`` was told, secret included."""

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        turn = await super().step(actions)
        if "second" in turn.observations and self.turns == 1:
            turn.observations["second"].insert(0, user(f"First was told: Keep this to yourself: "
                                                       f"{secret('first', self.seed)}."))
        return turn
