"""Rubrics: an episode's reward built from named parts (checks, the env's own reward, LLM judges), each part's score
kept in a breakdown that reaches the metrics, the report and ``envkit eval``.

A :class:`Rubric` scores a finished :class:`Episode` (its task, messages, the env's own reward) and returns a
:class:`Score`: a value and a breakdown by part name. Parts combine with :class:`WeightedSum`, :class:`Gate`,
:class:`AllOf`, :class:`AnyOf` and :class:`Max`::

    from envkit.rewards.rubrics import Check, EnvReward, Gate, WeightedSum

    correct, concise = EnvReward(), Check(lambda ep: float(len(ep.reply) < 200), name="concise")
    rubric = Gate(correct, WeightedSum({correct: 0.8, concise: 0.2}))   # no style points for a wrong answer
    env = envkit.make("arithmetic", rubric=rubric)

Any env takes ``rubric=`` through :func:`envkit.make` (a :class:`Rubric`, or ``"module:attr"`` naming one, as configs
and ``envkit serve --kwargs`` pass text): :class:`RubricEnv` scores the episode when it ends, the score is the last
step's reward (the steps before it give 0, so the episode's return is the score) and its breakdown is
``info["rubric"]``. An :class:`~envkit.agents.agent.AgentEnv` takes the rubric itself: its grade is the env reward the
rubric sees, and :meth:`~envkit.agents.agent.AgentEnv.score` scores the episode. A rubric that raises fails the rollout
(:class:`~envkit.errors.RubricError`): a judge that could not score is never a silent 0.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from envkit.core import Env, StepResult, Task, Wrapper
from envkit.errors import RubricError
from envkit.imports import import_ref
from envkit.messages import Message

T = TypeVar("T")


@dataclass(frozen=True)
class Episode:
    """A finished episode, as a rubric sees it."""

    task: Task | None
    messages: list[Message]
    """The whole chat: the opening messages, then each action and the env's reply to it."""
    env_reward: float = 0.0
    """The env's own return (the sum of its step rewards)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The last step's info."""
    result: Any = None
    """What an :class:`~envkit.agents.agent.AgentEnv`'s agent returned (None for stepped envs)."""

    @property
    def reply(self) -> str:
        """The text of the last assistant message (an agent's result, if it is text)."""
        if isinstance(self.result, str):
            return self.result
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return str(message.get("content") or "")
        return ""


@dataclass(frozen=True)
class Score:
    """A rubric's ``value`` and every part's score by name (the rubric's own included)."""

    value: float
    breakdown: dict[str, float] = field(default_factory=dict)


class Rubric(abc.ABC):
    """Scores an episode. Subclasses implement :meth:`evaluate`; ``name`` keys the part in breakdowns."""

    name: str = "rubric"

    @abc.abstractmethod
    async def evaluate(self, episode: Episode) -> Score:
        """The episode's score, with the breakdown of the parts below this one."""

    async def score(self, episode: Episode) -> Score:
        """:meth:`evaluate`, with this rubric's own value added to the breakdown; a failure is a
        :class:`~envkit.errors.RubricError` naming the part."""
        try:
            score = await self.evaluate(episode)
        except RubricError:
            raise
        except Exception as e:
            raise RubricError(f"rubric part {self.name!r} failed: {type(e).__name__}: {e}") from e
        return Score(float(score.value), {**score.breakdown, self.name: float(score.value)})

    def parts(self) -> list[Rubric]:
        """The rubrics this one combines (none for a leaf)."""
        return []


class Check(Rubric):
    """A leaf: ``fn(episode) -> float`` (sync or async)."""

    def __init__(self, fn: Callable[[Episode], float | Awaitable[float]], *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "check")

    async def evaluate(self, episode: Episode) -> Score:
        value = self.fn(episode)
        if inspect.isawaitable(value):
            value = await value
        return Score(float(value))


class EnvReward(Rubric):
    """A leaf: the env's own return."""

    name = "env"

    async def evaluate(self, episode: Episode) -> Score:
        return Score(episode.env_reward)


class _Combined(Rubric):
    """A rubric over parts, all scored concurrently."""

    def __init__(self, parts: Iterable[Rubric], name: str) -> None:
        self._parts = list(parts)
        self.name = name
        if not self._parts:
            raise ValueError(f"{type(self).__name__} needs at least one part")
        names = [r.name for r in {id(r): r for r in _walk(self)}.values()]  # a part used twice is one part
        if len(names) != len(set(names)):
            raise ValueError(f"rubric part names must be unique (they key the breakdown): {sorted(names)}")

    def parts(self) -> list[Rubric]:
        return self._parts

    async def _scores(self, episode: Episode) -> tuple[list[float], dict[str, float]]:
        scores = await asyncio.gather(*(part.score(episode) for part in self._parts))
        breakdown: dict[str, float] = {}
        for s in scores:
            breakdown.update(s.breakdown)
        return [s.value for s in scores], breakdown


class WeightedSum(_Combined):
    """``sum(weight * part)`` over ``{part: weight}``."""

    def __init__(self, weights: Mapping[Rubric, float], *, name: str = "weighted_sum") -> None:
        self.weights = [float(w) for w in weights.values()]
        super().__init__(weights.keys(), name)

    async def evaluate(self, episode: Episode) -> Score:
        values, breakdown = await self._scores(episode)
        return Score(sum(w * v for w, v in zip(self.weights, values, strict=True)), breakdown)


class Gate(_Combined):
    """``then``'s score where ``gate`` scores at least ``threshold``, else ``otherwise``; ``then`` is not scored
    (no judge call is spent) when the gate is shut."""

    def __init__(self, gate: Rubric, then: Rubric, *, threshold: float = 1.0, otherwise: float = 0.0,
                 name: str = "gate") -> None:
        super().__init__([gate, then], name)
        self.gate, self.then, self.threshold, self.otherwise = gate, then, threshold, otherwise

    async def evaluate(self, episode: Episode) -> Score:
        opened = await self.gate.score(episode)
        if opened.value < self.threshold:
            return Score(self.otherwise, opened.breakdown)
        scored = await self.then.score(episode)
        return Score(scored.value, {**opened.breakdown, **scored.breakdown})


class _Passing(_Combined):
    """1 where enough parts (``quantifier``: all or any) score at least ``threshold``, else 0."""

    quantifier: Callable[[Iterable[bool]], bool] = all
    default_name = ""

    def __init__(self, *parts: Rubric, threshold: float = 1.0, name: str | None = None) -> None:
        super().__init__(parts, name or self.default_name)
        self.threshold = threshold

    async def evaluate(self, episode: Episode) -> Score:
        values, breakdown = await self._scores(episode)
        return Score(float(type(self).quantifier(v >= self.threshold for v in values)), breakdown)


class AllOf(_Passing):
    """1 where every part scores at least ``threshold``, else 0."""

    quantifier = all
    default_name = "all_of"


class AnyOf(_Passing):
    """1 where some part scores at least ``threshold``, else 0."""

    quantifier = any
    default_name = "any_of"


class Max(_Combined):
    """The greatest part's score."""

    def __init__(self, *parts: Rubric, name: str = "max") -> None:
        super().__init__(parts, name)

    async def evaluate(self, episode: Episode) -> Score:
        values, breakdown = await self._scores(episode)
        return Score(max(values), breakdown)


class GroupRubric(abc.ABC):
    """Scores the episodes of one group together (the samples of one task): a relative judge ranks them in one
    call. A generator with ``group_rubric=`` applies it as each group finishes; its score becomes each episode's
    reward, and its breakdown joins the episode's."""

    name: str = "group"

    @abc.abstractmethod
    async def score_group(self, episodes: list[Episode]) -> list[Score]:
        """One score per episode, in order."""


def load_group_rubric(rubric: GroupRubric | str) -> GroupRubric:
    """``rubric`` itself, or the group rubric ``"module:attr"`` names (an instance, or a factory taking no
    arguments)."""
    return rubric if isinstance(rubric, GroupRubric) else _load(rubric, GroupRubric)


def _walk(rubric: Rubric) -> list[Rubric]:
    return [rubric, *(r for part in rubric.parts() for r in _walk(part))]


def load_rubric(rubric: Rubric | str) -> Rubric:
    """``rubric`` itself, or the rubric ``"module:attr"`` names (an instance, or a callable returning one)."""
    return rubric if isinstance(rubric, Rubric) else _load(rubric, Rubric)


def _load(ref: str, kind: type[T]) -> T:
    """The ``kind`` that ``"module:attr"`` names: an instance, or a class or factory making one without
    arguments."""
    if not str(ref).partition(":")[2]:
        raise ValueError(f"expected an envkit.rewards.rubrics.{kind.__name__} or a 'module:attr' path, got {ref!r}")
    try:
        found = import_ref(str(ref))
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{ref!r} could not be loaded: {type(e).__name__}: {e}") from e
    if not isinstance(found, kind) and callable(found):
        try:
            found = found()
        except TypeError as e:
            raise ValueError(f"{ref!r} is not an envkit.rewards.rubrics.{kind.__name__}, nor makes one without "
                             f"arguments: {e}") from e
    if not isinstance(found, kind):
        raise ValueError(f"{ref!r} is a {type(found).__name__}, not an envkit.rewards.rubrics.{kind.__name__}")
    return found


class RubricEnv(Wrapper):
    """``env`` scored by ``rubric`` when each episode ends (see the module docstring)."""

    snapshot_exclude = frozenset({"env", "rubric"})

    def __init__(self, env: Env, rubric: Rubric | str) -> None:
        super().__init__(env)
        self.rubric = load_rubric(rubric)
        self._task: Task | None = None
        self._messages: list[Message] = []
        self._return = 0.0

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        messages, info = await self.env.reset(seed=seed, task=task)
        self._task = task if task is not None else info.get("task")
        self._messages, self._return = list(messages), 0.0
        return messages, info

    async def step(self, action: Message) -> StepResult:
        result = await self.env.step(action)
        self._messages += [action, *result.observation]
        self._return += result.reward
        if not result.done:
            return StepResult(result.observation, 0.0, result.terminated, result.truncated, result.info)
        score = await self.rubric.score(Episode(self._task, list(self._messages), self._return, result.info))
        return StepResult(result.observation, score.value, result.terminated, result.truncated,
                          {**result.info, "rubric": score.breakdown})


@runtime_checkable
class HoldsRubric(Protocol):
    """An env that scores its episodes itself, with the rubric it holds (an :class:`~envkit.agents.agent.AgentEnv`:
    its grade is the env reward the rubric sees): ``rubric=`` is given to it, not wrapped around it."""

    rubric: Rubric | None

    async def score(self, result: Any) -> Score:
        """The episode's reward and its breakdown, through :attr:`rubric` where there is one."""


def with_rubric(env: Env, rubric: Rubric | str) -> Env:
    """``env`` scored by ``rubric``, as ``envkit.make(..., rubric=)`` gives it: an env that holds its rubric
    (:class:`HoldsRubric`) is given it, any other is wrapped in a :class:`RubricEnv`."""
    if isinstance(env.unwrapped, HoldsRubric):
        env.unwrapped.rubric = load_rubric(rubric)
        return env
    return RubricEnv(env, rubric)
