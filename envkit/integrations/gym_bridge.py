"""The gymnasium bridge, both ways: discrete gymnasium envs as LLM text games, envkit envs as gymnasium envs.

gymnasium → envkit, a multi-turn text game whose actions are words::

    env = envkit.make("gym:FrozenLake-v1")           # or GymTextEnv("FrozenLake-v1"), GymTextEnv(gym_env)
    messages, info = await env.reset(seed=0)         # the rules, then the map as text
    result = await env.step(envkit.assistant("I'll go down. Action: Down"))

envkit → gymnasium, a synchronous ``gymnasium.Env`` with Text spaces::

    env = as_gymnasium(envkit.make("frozenlake"))    # or as_gymnasium("frozenlake")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("Action: Down")

gymnasium is the optional ``envkit-rl[gym]`` extra, so this module is the only one that imports it (and
:mod:`envkit.integrations.gym_games`, how its games read as text, which it imports).
"""

from __future__ import annotations

import copy
import difflib
import importlib
import math
import re
import string
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import gymnasium
from gymnasium.envs.registration import EnvSpec as GymSpec
from gymnasium.envs.registration import load_env_creator
from gymnasium.spaces import Discrete, Text

from envkit.core import ContractChecker, Env, StepResult, Task
from envkit.errors import EnvNotFoundError
from envkit.integrations.gym_games import Renderer, action_list, renderer_for
from envkit.messages import Message, system, user
from envkit.registry import EnvSpec, first_doc_line, make
from envkit.sync import SyncEnv

# ---------------------------------------------------------------------------------------------- gymnasium → envkit


# "Action: X" runs to the end of the line or to the next "Action:", whichever comes first.
_MARKER = re.compile(
    r"<action>(.*?)</action>|\baction\s*[:=]((?:(?!\baction\s*[:=])[^\n])*)", re.IGNORECASE | re.DOTALL
)
# A number counts as an action only when it stands alone: "2", "**2**", "2." but not "-2" or "2 steps".
_LONE_NUMBER = re.compile(r"[^\w-]*(\d+)[^\w-]*")


def parse_action(text: str | None, names: Sequence[str]) -> int:
    """The index in ``names`` of the action that ``text`` chooses; raises ValueError saying what is wrong.

    The rule: names match case-insensitively as whole words. If the reply has a marker, ``<action>X</action>``
    or ``Action: X`` (up to the end of the line or the next marker), the last marker decides: the first action
    name inside it, else its content if that is a lone action number. Without a marker, the last action name
    mentioned anywhere wins ("not Left but Right" is Right), else the whole reply if it is a lone action number.
    """
    if not text or not text.strip():
        raise ValueError("your reply is empty")
    # Longest names first, so that a name containing another one wins at the same position.
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    words = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
    markers = list(_MARKER.finditer(text))
    if markers:
        marker = markers[-1]
        content = marker.group(1) if marker.group(1) is not None else marker.group(2)
        found = words.search(content)
        where, problem = content, f"{marker.group().strip()!r} names no valid action"
    else:
        mentions = list(words.finditer(text))
        found = mentions[-1] if mentions else None
        where, problem = text, "no action found in your reply"
    if found is not None:
        return [n.lower() for n in names].index(found.group().lower())
    number = _LONE_NUMBER.fullmatch(where)
    if number is None:
        raise ValueError(problem)
    if int(number.group(1)) >= len(names):
        raise ValueError(f"there is no action number {number.group(1)}")
    return int(number.group(1))


def _make_gym_env(gym_id: str, **gym_kwargs: Any) -> gymnasium.Env:
    """``gymnasium.make(gym_id, **gym_kwargs)``, with ``render_mode="ansi"`` where the env renders as text and
    neither ``gym_kwargs`` nor the id's registration picks a render mode; an unknown id raises EnvNotFoundError."""
    module, _, env_id = gym_id.rpartition(":")
    if module:  # gymnasium's "module:Env-v0", whose import registers the env
        importlib.import_module(module)
    try:
        spec = gymnasium.spec(env_id)
    except gymnasium.error.Error as e:
        # E.g. Taxi-v3 on gymnasium >= 1.2, which has Taxi-v4 only: the message names the version it has.
        raise EnvNotFoundError(
            gym_id, difflib.get_close_matches(env_id, list(gymnasium.registry), n=3),
            fix=f"gymnasium {gymnasium.__version__} says: {e}",
        ) from e
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    renders_text = "ansi" in getattr(creator, "metadata", {}).get("render_modes", [])
    if renders_text and "render_mode" not in {**spec.kwargs, **gym_kwargs}:
        gym_kwargs = {**gym_kwargs, "render_mode": "ansi"}
    return gymnasium.make(gym_id, **gym_kwargs)


def _check_names(names: Sequence[str], env: gymnasium.Env) -> None:
    """ValueError unless ``names`` are distinct non-empty strings (ignoring case), one per action of ``env``."""
    space = env.action_space
    if len(names) != space.n:
        raise ValueError(
            f"{len(names)} action names ({', '.join(map(str, names))}) for {env.spec.id if env.spec else env}'s "
            f"{space}: give exactly one name per action, in order"
        )
    if not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"action names must be non-empty strings, got {list(names)!r}")
    if len({n.lower() for n in names}) != len(names):
        raise ValueError(f"action names must differ ignoring case (the model's answer is read so), got {list(names)!r}")


class GymTextEnv(Env):
    """A gymnasium env with a Discrete action space as a multi-turn text game for an LLM.

    The system prompt is the renderer's rules, each observation a user message with the state as text, and the
    model's reply is read with :func:`parse_action`. A reply without a valid action gets feedback listing the
    valid actions and reward ``invalid_penalty``, and leaves the gym env untouched; ``max_invalid`` of them in a
    row truncate the episode. Rewards, termination and truncation (its TimeLimit) are the gym env's own.

    ``gym_env`` is a gym id, made with ``gymnasium.make(gym_env, **gym_kwargs)`` and ``render_mode="ansi"`` where
    the env renders as text and ``gym_kwargs`` picks no render mode; or a ``gymnasium.Env``, which this env then
    owns and closes. ``renderer`` defaults to :func:`renderer_for` the env; ``action_names`` (one per action, in
    order) replaces its names, so that any env can be played by name. ``system_prompt`` replaces the renderer's
    ``describe()`` text. ``reset(seed=s)`` seeds the gym env; a task is ``{"seed": s}``.
    """

    def __init__(
        self,
        gym_env: str | gymnasium.Env,
        *,
        gym_kwargs: dict[str, Any] | None = None,
        renderer: Renderer | None = None,
        action_names: Sequence[str] | None = None,
        invalid_penalty: float = -0.1,
        max_invalid: int | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if not isinstance(gym_env, str) and gym_kwargs:
            raise ValueError("gym_kwargs only apply when GymTextEnv makes the gym env from an id.")
        if max_invalid is not None and max_invalid < 1:
            raise ValueError(f"max_invalid must be >= 1 or None, got {max_invalid}")
        self.gym_env = _make_gym_env(gym_env, **(gym_kwargs or {})) if isinstance(gym_env, str) else gym_env
        try:
            if not isinstance(self.gym_env.action_space, Discrete):
                raise TypeError(
                    f"GymTextEnv needs a Discrete action space, {self.gym_env} has {self.gym_env.action_space}"
                )
            self.renderer = renderer if renderer is not None else renderer_for(self.gym_env)
            if action_names is not None:
                self.renderer = replace(self.renderer, names=tuple(action_names))
            self.action_names = self.renderer.action_names(self.gym_env)
            _check_names(self.action_names, self.gym_env)
        except (TypeError, ValueError):
            if isinstance(gym_env, str):
                self.gym_env.close()
            raise
        self.invalid_penalty = invalid_penalty
        self.max_invalid = max_invalid
        # gymnasium dropped Env.reward_range in 1.0; envs that still set it (FrozenLake) say what steps give
        low, high = getattr(self.gym_env.unwrapped, "reward_range", (-math.inf, math.inf))
        self.reward_range = (min(float(low), invalid_penalty), float(high))
        self.system_prompt = system_prompt if system_prompt is not None else self.renderer.describe(self.gym_env)
        self._invalid_streak = 0
        self._closed = False

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        if task is not None:
            if not isinstance(task.get("seed"), int):
                raise ValueError(f"A GymTextEnv task looks like {{'seed': 3}}, got {task!r}")
            seed = task["seed"]
        obs, info = self.gym_env.reset(seed=seed)
        self._invalid_streak = 0
        return [system(self.system_prompt), user(self.renderer.render(self.gym_env, obs, info))], dict(info)

    async def step(self, action: Message) -> StepResult:
        try:
            index = parse_action(action.get("content"), self.action_names)
        except ValueError as e:
            return self._invalid(str(e))
        self._invalid_streak = 0
        obs, reward, terminated, truncated, info = self.gym_env.step(int(self.gym_env.action_space.start) + index)
        # Each step's reward is said, since some only show there (Taxi's wrong Pickup, CliffWalking's fall).
        over = "The episode is over. " if terminated or truncated else ""
        text = f"{self.renderer.render(self.gym_env, obs, info)}\n\n{over}Reward: {float(reward):g}."
        return StepResult(
            [user(text)],
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info={**info, "action": self.action_names[index], "invalid": False},
        )

    def _invalid(self, problem: str) -> StepResult:
        self._invalid_streak += 1
        over = self.max_invalid is not None and self._invalid_streak >= self.max_invalid
        text = (
            f"Invalid reply: {problem}. Valid actions: {action_list(self.action_names)}. "
            "End your reply with a line 'Action: <action>'."
        )
        if over:
            text += f"\n\n{self._invalid_streak} invalid replies in a row: the episode is over."
        return StepResult(
            [user(text)],
            reward=self.invalid_penalty,
            truncated=over,
            info={"action": None, "invalid": True, "error": problem},
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.gym_env.close()

    def spaces(self) -> dict[str, Any]:
        return {
            "observation": f"text rendering of {self.gym_env.observation_space}",
            "action": f"text naming one of {action_list(self.action_names)} ({self.gym_env.action_space})",
        }


def make_gym(name: str, **kwargs: Any) -> GymTextEnv:
    """The ``gym`` scheme of ``envkit.make``: ``gym:<gymnasium id>`` through :class:`GymTextEnv` (``kwargs`` are
    its arguments)."""
    gym_kwargs = {"gym_env": name.removeprefix("gym:"), **kwargs}
    env = GymTextEnv(**gym_kwargs)
    env.spec = EnvSpec(name=name, entry_point="envkit.integrations.gym_bridge:GymTextEnv", kwargs=gym_kwargs,
                       description=first_doc_line(GymTextEnv), source="gymnasium bridge")
    return env


# ---------------------------------------------------------------------------------------------- envkit → gymnasium

REPLACEMENT_CHAR = "\ufffd"
"""What an observation character outside :data:`TEXT_CHARSET` becomes (U+FFFD, the Unicode replacement char)."""

TEXT_CHARSET: frozenset[str] = frozenset(
    string.printable  # ASCII letters, digits, punctuation and whitespace (space, \t, \n, \r, \x0b, \x0c)
    + "".join(map(chr, range(0xA0, 0x100)))  # Latin-1: accented letters, × ÷ ° ± £ and no-break space
    + "–—‘’“”•…€™←↑→↓≠≤≥≈√∞"  # the typography and math that models write most beyond Latin-1
    + REPLACEMENT_CHAR
)
"""The characters of both Text spaces. Wide enough that English and Western-European text, code and arithmetic
pass unchanged; small enough that the space prints readably and ``action_space.sample()`` is plain text. The
full text always travels losslessly in ``info["messages"]``."""


class GymnasiumEnv(gymnasium.Env[str, str]):
    """An envkit env as a synchronous gymnasium env whose observations and actions are text.

    ``reset`` returns the text of the opening messages, ``step(text)`` sends ``text`` as the assistant's message
    and returns the text of the env's reply: the messages' contents joined by blank lines, with the messages
    themselves, complete, in ``info["messages"]``. So that every observation lies in ``observation_space``, it
    keeps the first ``max_length`` characters and each character outside :data:`TEXT_CHARSET` becomes
    :data:`REPLACEMENT_CHAR`. ``step`` takes any string; ``max_action_length`` only bounds ``action_space``.

    ``env`` is an envkit env, or a name for ``envkit.make(env, **env_kwargs)``. ``reset(options={"task": t})``
    picks a task. An env made by name gets a gymnasium ``spec``, so ``gymnasium.make(env.spec)`` remakes it.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        env: Env | str,
        *,
        env_kwargs: dict[str, Any] | None = None,
        max_length: int = 8192,
        max_action_length: int = 1024,
    ) -> None:
        if not isinstance(env, str) and env_kwargs:
            raise ValueError("env_kwargs only apply when GymnasiumEnv makes the env from a name.")
        if isinstance(env, str):
            env = make(env, **(env_kwargs or {}))
        elif not isinstance(env, ContractChecker):
            env = ContractChecker(env)  # for its lazy init() and its validation, which make() would have added
        self.env = env
        self._sync = SyncEnv(env)
        self.observation_space = Text(max_length, min_length=0, charset=TEXT_CHARSET)
        self.action_space = Text(max_action_length, charset=TEXT_CHARSET)
        if env.spec is not None:
            self.spec = GymSpec(
                id=env.spec.name,
                entry_point="envkit.integrations.gym_bridge:GymnasiumEnv",
                kwargs={
                    "env": env.spec.name,
                    "env_kwargs": dict(env.spec.kwargs),
                    "max_length": max_length,
                    "max_action_length": max_action_length,
                },
            )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: ``(observation text, info)``."""
        super().reset(seed=seed)
        if seed is None:
            # As in gymnasium, unseeded resets after a seeded one continue a reproducible sequence of episodes.
            seed = int(self.np_random.integers(2**31))
        messages, info = self._sync.reset(seed=seed, task=(options or {}).get("task"))
        return self._observe(messages, info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Send ``action`` as the assistant's message: ``(observation text, reward, terminated, truncated, info)``."""
        result = self._sync.step(action)
        obs, info = self._observe(result.observation, result.info)
        return obs, float(result.reward), bool(result.terminated), bool(result.truncated), info

    def close(self) -> None:
        """Close the envkit env and the event loop behind it; safe to call twice."""
        self._sync.close()

    def _observe(self, messages: list[Message], info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        text = "\n\n".join(m["content"] for m in messages if m.get("content"))[: self.observation_space.max_length]
        charset = self.observation_space.character_set
        # A deep copy, because callers keep every info (replay buffers) while the env may reuse its objects.
        return "".join(c if c in charset else REPLACEMENT_CHAR for c in text), copy.deepcopy(
            {**info, "messages": messages}
        )


def as_gymnasium(env: Env | str, **options: Any) -> GymnasiumEnv:
    """``env`` (an envkit env or name) as a synchronous gymnasium env; ``options`` go to :class:`GymnasiumEnv`."""
    return GymnasiumEnv(env, **options)
