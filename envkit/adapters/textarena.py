"""The ``textarena`` scheme: ``envkit.make("textarena:GuessTheNumber-v0")``, a single-player textarena game (the
``textarena`` extra).

The game's messages are the user turns and the reply is the move; the game's reward comes when it ends. Two joins
are made right:

- textarena's games draw from Python's and numpy's global RNGs (2048 spawns a tile after every move), so games
  running side by side consume each other's draws, and one seed gives different games. Each env here keeps its own
  RNG states and swaps them in around every call into its game, under one lock: a seed gives the same game whatever
  else runs, and the caller's global RNGs are left as they were.
- textarena checks a game's turn limit before it counts the turn, so "within N turns" allows N + 1 moves. Here the
  game's state is given N - 1, so the game's own end-of-budget outcome (GuessTheNumber's partial credit) comes with
  move N; an episode that ends there without a win (reward 1) is ``truncated``. (A reply the game rejects as an
  invalid move is not a move: the game asks again, once, as its rules say.)

Two-player games (against a fixed opponent, or self-play) are not supported yet.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import textarena
from textarena.core import ObservationType
from textarena.envs.registration import ENV_REGISTRY

from envkit.adapters import build
from envkit.core import Env, StepResult, Task
from envkit.messages import Message, user

WIN = 1.0
"""The reward a single-player textarena game gives a win."""
_GLOBAL_RNGS = threading.Lock()


class TextArenaEnv(Env):
    """A single-player textarena game: its messages as user turns, each reply a move, its reward at the end."""

    reward_range = (-1.0, 1.0)

    def __init__(self, env_id: str, **game_kwargs: Any) -> None:
        if env_id not in ENV_REGISTRY:
            raise ValueError(f"textarena has no game {env_id!r} (see textarena.envs.registration.ENV_REGISTRY)")
        self.env_id = env_id
        raw = f"{env_id}-raw"  # the game without textarena's LLM wrappers: this env writes the messages itself
        self._game = textarena.make(raw if raw in ENV_REGISTRY else env_id, **game_kwargs)
        self._rngs = (random.Random().getstate(), np.random.RandomState().get_state())
        self.max_turns: int | None = None

    @contextmanager
    def _own_rngs(self) -> Iterator[None]:
        """Run a call into the game on this env's RNG states (no await inside: the swap and the call are atomic)."""
        with _GLOBAL_RNGS:
            outer = random.getstate(), np.random.get_state()
            random.setstate(self._rngs[0])
            np.random.set_state(self._rngs[1])
            try:
                yield
            finally:
                self._rngs = random.getstate(), np.random.get_state()
                random.setstate(outer[0])
                np.random.set_state(outer[1])

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Start the game from ``task["seed"]``, else ``seed``, else a random seed."""
        if task is not None:
            if not isinstance(task.get("seed"), int):
                raise ValueError(f"a textarena task looks like {{'seed': 3}}, got {task!r:.120}")
            seed = task["seed"]
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        self._rngs = (random.Random(seed).getstate(), np.random.RandomState(seed % 2**32).get_state())
        with self._own_rngs():
            try:
                self._game.reset(num_players=1, seed=seed)
            except AssertionError as e:  # textarena's states assert their number of players
                raise ValueError(f"textarena:{self.env_id}: {e}; envkit plays single-player textarena games only, "
                                 "for now") from e
            state = self._game.state
            self.max_turns = state.max_turns
            if state.max_turns:
                state.max_turns -= 1  # its check runs before its count: N - 1 here ends the game at reply N
            _, observation = self._game.get_observation()
        return [user(_text(observation))], {"seed": seed}

    async def step(self, action: Message) -> StepResult:
        """Play the reply as the move; the game's reward when it ends."""
        with self._own_rngs():
            done, info = self._game.step(action.get("content") or "")
            if done:
                rewards, game_info = self._game.close()
            else:
                _, observation = self._game.get_observation()
        if not done:
            return StepResult([user(_text(observation))], info=dict(info or {}))
        reward = float((rewards or {}).get(0, 0.0))
        ending = (game_info or {}).get(0, {})
        moves = self._game.state.turn
        truncated = (self.max_turns is not None and moves >= self.max_turns and reward < WIN
                     and not ending.get("invalid_move"))  # a loss by invalid moves is the game's own end
        return StepResult([], reward=reward, terminated=not truncated, truncated=truncated,
                          info={"reason": ending.get("reason", ""), "moves": moves})

    def spaces(self) -> dict[str, Any]:
        return {"observation": f"textarena {self.env_id}: the game's messages", "action": "a move, as the game's "
                "rules say to write it", "reward": "the game's, when it ends"}


def _text(observation: list[tuple[int, str, ObservationType]]) -> str:
    """The game's new messages as one user turn (the player's own moves, echoed back, are left out)."""
    return "\n".join(message for _, message, kind in observation if kind != ObservationType.PLAYER_ACTION).strip()


def make_textarena(name: str, **kwargs: Any) -> TextArenaEnv:
    """The ``textarena`` scheme of ``envkit.make``: ``textarena:<game id>``."""
    return build(name, TextArenaEnv, kwargs)
