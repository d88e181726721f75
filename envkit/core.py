"""The Env contract: what every envkit environment is, in one file.

An environment is an async, gym-style episode over chat messages::

    env = envkit.make("arithmetic")          # or construct your Env subclass directly
    await env.init()                         # acquire resources once (make() defers it to the first reset)
    messages, info = await env.reset(seed=0) # first observation: a list of chat messages
    result = await env.step({"role": "assistant", "content": "The answer is 7"})
    result.observation, result.reward, result.terminated, result.truncated, result.info
    await env.close()                        # idempotent

Every subclass must implement ``reset`` and ``step``; it may set ``tools`` (OpenAI function tools the model can
call), override ``init``/``close`` for resources, ``tasks(split)`` when its task set is enumerable,
``demonstrate`` when it can show how a task is solved (supervised data before RL), and ``snapshot``/``restore``
when its state is more than plain data (a group of rollouts can then branch from one mid-episode state).
``make()`` wraps every env in :class:`ContractChecker`, which enforces call order and validates both sides.
"""

from __future__ import annotations

import abc
import math
import pickle
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

from envkit.errors import (
    EnvClosedError,
    EnvLoadError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidStepResultError,
    ResetNeededError,
    SnapshotError,
)
from envkit.imports import import_ref
from envkit.messages import Message, is_message, validate_action

if TYPE_CHECKING:
    from envkit.tools import Tool

Task = dict[str, Any]
"""One task: a JSON-serializable dict, conventionally with a unique ``"id"``."""


@dataclass(slots=True)
class StepResult:
    """What ``Env.step`` returns.

    ``terminated`` means the task ended (solved, failed, game over); ``truncated`` means a budget ran out
    (turns, tokens, time) before it did. Either one ends the episode.
    """

    observation: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """True when the episode is over (terminated or truncated)."""
        return self.terminated or self.truncated


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An env's state at one moment, mid-episode included (from ``Env.snapshot``): ``Env.restore`` puts that env, or
    another of its kind, in it, and its next steps go as the original's did. Opaque to callers."""

    kind: str
    """The kind of env that took it (its ``snapshot_kind``): only an env of that kind restores it."""
    state: Any
    """What the env saved: its pickled attributes by default, a server's signed token for a remote env."""


class EnvBase:
    """What every kind of env shares, single- or multi-agent: its spec, its reward range, ``init``/``close``,
    snapshots of its state, ``async with``. The docstrings of its methods are part of the contract."""

    spec: EnvSpec | None = None
    """The registry spec this env was made from; set by ``envkit.make``."""

    reward_range: tuple[float, float] = (-math.inf, math.inf)
    """The least and the greatest reward one step can give (``envkit check`` holds the env to it)."""

    snapshot_exclude: ClassVar[frozenset[str]] = frozenset()
    """Attributes that are resources or configuration rather than episode state (a client, a lock, a judge): the
    default ``snapshot`` leaves them out, and ``restore`` keeps the restoring env's own."""

    async def init(self) -> None:
        """Acquire expensive resources (connections, containers, datasets) once, before the first reset."""

    async def close(self) -> None:
        """Release resources. Must be safe to call more than once."""

    @property
    def snapshot_kind(self) -> str:
        """The kind of env this one's snapshots restore into: its type (``module:QualName``)."""
        return kind_of(self)

    async def snapshot(self) -> Snapshot:
        """The env's state now, for :meth:`restore`. Optional: the default pickles the env's attributes (less
        ``snapshot_exclude``), which is right when its state is plain data (numbers, strings, containers,
        ``random.Random``, numpy arrays); an env holding anything else raises SnapshotError unless it lists that in
        ``snapshot_exclude`` or overrides this and :meth:`restore`."""
        return Snapshot(self.snapshot_kind, pickled_state(self))

    async def restore(self, snapshot: Snapshot) -> None:
        """Put this env in ``snapshot``'s state, taken from it or from another env of its kind: its next steps then
        go as the original's did after the snapshot. Restoring into a fresh env (never reset) is allowed."""
        check_kind(self, snapshot)
        vars(self).update(pickle.loads(snapshot.state))

    @property
    def unwrapped(self) -> Self:
        """The innermost env, below any wrappers."""
        return self

    async def __aenter__(self) -> Self:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        name = self.spec.name if self.spec else type(self).__name__
        return f"<{type(self).__name__} {name!r}>"


class Env(EnvBase, abc.ABC):
    """Base class of every environment. The docstrings of its methods (and :class:`EnvBase`'s) are the contract."""

    tools: ClassVar[list[Tool]] = []
    """Tools the model may call, as :class:`envkit.Tool` (rendered to OpenAI function schemas)."""

    @abc.abstractmethod
    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start a new episode and return ``(messages, info)``.

        ``messages`` are the opening chat messages (system prompt, question). The same ``seed`` or the same
        ``task`` must give the same episode start: GRPO compares samples of one group against each other.
        ``task`` takes precedence over ``seed``; with neither, the env picks a task at random.
        """

    @abc.abstractmethod
    async def step(self, action: Message) -> StepResult:
        """Apply one assistant message and return the env's reply as a :class:`StepResult`.

        ``action`` is an assistant message (``content`` and/or ``tool_calls``). May only be called after
        ``reset`` and before the episode is done.
        """

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        """The env's tasks for ``split`` ("train", "test", ...), or None when tasks are not enumerable."""
        return None

    def spaces(self) -> dict[str, Any]:
        """Describe observation and action spaces (for ``envkit info`` and the gymnasium bridge)."""
        return {"observation": "list of chat messages", "action": "assistant message"}

    async def demonstrate(self, messages: list[Message]) -> Message:
        """An expert's next assistant message in the current episode, ``messages`` being the chat so far (from the
        opening messages on). Optional: envs that cannot demonstrate raise NotImplementedError.

        A generator plays the demonstration as the model's turn and steps the env with it for real, so the env's
        replies (tool outputs included) in the resulting supervised data are genuine. Tool calls go in
        ``tool_calls``: the generator writes them in the model's own format.
        """
        raise NotImplementedError(f"{type(self).__name__} offers no demonstrations (it does not override "
                                  "Env.demonstrate)")


# EnvSpec lives beside Env because each names the other (Env.spec, EnvSpec.factory); envkit.registry, which makes
# and looks up specs, imports it from here and still offers it.
EnvFactory = Callable[..., Env]


@dataclass(frozen=True)
class EnvSpec:
    """Everything needed to make an env by name; round-trips through JSON (``to_json``/``from_json``)."""

    name: str
    entry_point: str
    """``"module:attr"`` of the Env class or factory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Default constructor arguments; ``make(name, **overrides)`` updates them."""
    description: str = ""
    package: str | None = None
    """The pip distribution that provides the env (None for ``register()`` calls)."""
    version: str | None = None
    source: str = ""
    """Where the registration came from, for error messages."""
    factory: EnvFactory | None = field(default=None, compare=False, repr=False)

    def load(self) -> EnvFactory:
        """Import and return the Env class (or factory) this spec points at."""
        if self.factory is not None:
            return self.factory
        try:
            obj = import_ref(self.entry_point)
        except Exception as e:
            raise EnvLoadError(
                f"Env {self.name!r} could not be loaded from {self.entry_point!r} ({self.source}): "
                f"{type(e).__name__}: {e}"
            ) from e
        return obj

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict of this spec."""
        out = asdict(self)
        out.pop("factory")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnvSpec:
        """Rebuild a spec from ``to_json()`` output."""
        return cls(**data)


class Forwarding:
    """What an env wrapped around another takes from it: its spec, its reward range, its innermost env."""

    env: Any

    @property
    def spec(self) -> EnvSpec | None:
        return self.env.spec

    @spec.setter
    def spec(self, value: EnvSpec | None) -> None:
        self.env.spec = value

    @property
    def reward_range(self) -> tuple[float, float]:
        return self.env.reward_range

    @property
    def unwrapped(self) -> Any:
        return self.env.unwrapped


class Wrapper(Forwarding, Env):
    """An env that forwards to another; subclass it to change one part of the behaviour. Its snapshot holds its
    own attributes (less ``snapshot_exclude``) and the wrapped env's snapshot."""

    snapshot_exclude = frozenset({"env"})

    def __init__(self, env: Env) -> None:
        self.env = env

    @property
    def tools(self) -> list[Tool]:  # type: ignore[override]
        return self.env.tools

    async def init(self) -> None:
        await self.env.init()

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        return await self.env.reset(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()

    def tasks(self, split: str = "train") -> Iterable[Task] | None:
        return self.env.tasks(split)

    def spaces(self) -> dict[str, Any]:
        return self.env.spaces()

    async def demonstrate(self, messages: list[Message]) -> Message:
        return await self.env.demonstrate(messages)

    @property
    def snapshot_kind(self) -> str:
        """This wrapper's type, then the wrapped env's kind in parentheses."""
        return f"{kind_of(self)}({self.env.snapshot_kind})"

    async def snapshot(self) -> Snapshot:
        inner = await self.env.snapshot()
        return Snapshot(self.snapshot_kind, (pickled_state(self), inner))

    async def restore(self, snapshot: Snapshot) -> None:
        check_kind(self, snapshot)
        own, inner = snapshot.state
        await self.env.restore(inner)
        vars(self).update(pickle.loads(own))

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes the wrapper lacks: expose the wrapped env's extras (e.g. env.max_turns).
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self.env!r}>"


class ContractChecker(Wrapper):
    """Enforces the contract around any env: call order on the way in, result shapes on the way out.

    ``init`` runs lazily before the first reset if the caller skipped it; ``step`` before ``reset`` or after the
    episode ended raises a :class:`~envkit.errors.ContractError`; malformed actions raise InvalidActionError; a
    malformed return value from the env raises InvalidStepResultError naming the env.
    """

    snapshot_exclude = frozenset({"env", "_initialized", "_closed"})

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self._initialized = False
        self._has_reset = False
        self._episode_active = False
        self._closed = False

    async def init(self) -> None:
        if not self._initialized:
            await self.env.init()
            self._initialized = True

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        if self._closed:
            raise EnvClosedError("reset() called on a closed env. Make a new one with envkit.make().")
        if not self._initialized:
            await self.init()
        out = await self.env.reset(seed=seed, task=task)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise InvalidStepResultError(
                f"{self.env!r}.reset() must return (messages, info), got {type(out).__name__}: {out!r:.120}"
            )
        _check_messages(self.env, "reset", out[0])
        self._has_reset = True
        self._episode_active = True
        return out

    async def step(self, action: Message) -> StepResult:
        if not self._episode_active:
            if self._closed:
                raise EnvClosedError("step() called on a closed env. Make a new one with envkit.make().")
            if self._has_reset:
                raise EpisodeDoneError(
                    "step() called after the episode ended (terminated or truncated). Call reset() to start a new one."
                )
            raise ResetNeededError("step() called before reset(). Call `await env.reset(...)` first.")
        validate_action(action)
        result = await self.env.step(action)
        if not isinstance(result, StepResult):
            raise InvalidStepResultError(
                f"{self.env!r}.step() must return envkit.StepResult, got {type(result).__name__}"
            )
        _check_messages(self.env, "step", result.observation)
        if isinstance(result.reward, bool) or not isinstance(result.reward, int | float):
            raise InvalidStepResultError(f"{self.env!r}.step() reward must be a number, got {result.reward!r}")
        if not math.isfinite(result.reward):
            raise InvalidStepResultError(f"{self.env!r}.step() reward must be finite, got {result.reward!r}")
        if result.terminated or result.truncated:
            self._episode_active = False
        return result

    async def demonstrate(self, messages: list[Message]) -> Message:
        if not self._episode_active:
            raise ResetNeededError("demonstrate() needs an episode in progress: call reset() first.")
        action = await self.env.demonstrate(messages)
        try:
            return validate_action(action)
        except InvalidActionError as e:
            raise InvalidStepResultError(f"{self.env!r}.demonstrate() must return an assistant message: {e}") from e

    async def snapshot(self) -> Snapshot:
        if self._closed:
            raise EnvClosedError("snapshot() called on a closed env.")
        return await super().snapshot()

    async def restore(self, snapshot: Snapshot) -> None:
        if self._closed:
            raise EnvClosedError("restore() called on a closed env. Make a new one with envkit.make().")
        await self.init()
        await super().restore(snapshot)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._episode_active = False
            await self.env.close()


def _check_messages(env: Env, method: str, messages: Any) -> None:
    if not isinstance(messages, list) or not all(is_message(m) for m in messages):
        raise InvalidStepResultError(
            f"{env!r}.{method}() must return a list of chat messages "
            f"({{'role': 'user'|'assistant'|'system'|'tool', 'content': str}}), got {messages!r:.160}"
        )


def kind_of(env: EnvBase) -> str:
    """``module:QualName`` of ``env``'s type: the kind a :class:`Snapshot` of it restores into."""
    return f"{type(env).__module__}:{type(env).__qualname__}"


def check_kind(env: EnvBase, snapshot: Snapshot) -> None:
    """Raise SnapshotError unless ``snapshot`` was taken of an env of ``env``'s ``snapshot_kind``."""
    if not isinstance(snapshot, Snapshot):
        raise SnapshotError(f"restore() takes an envkit.Snapshot, got {type(snapshot).__name__}")
    if snapshot.kind != env.snapshot_kind:
        raise SnapshotError(f"a snapshot of {snapshot.kind} cannot restore {env.snapshot_kind}")


def pickled_state(env: EnvBase) -> bytes:
    """``env``'s attributes less its ``snapshot_exclude``, pickled; SnapshotError when they are not plain data."""
    state = {k: v for k, v in vars(env).items() if k not in env.snapshot_exclude}
    try:
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise SnapshotError(f"{type(env).__name__}'s state is not plain data ({type(e).__name__}: {e}): name the "
                            "attributes that hold resources in its snapshot_exclude, or override snapshot() and "
                            "restore()") from e
