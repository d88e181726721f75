"""The ``textarena`` scheme: ``envkit.make("textarena:GuessTheNumber-v0")``, a textarena game (the ``textarena``
extra); a two-player one with ``opponent=`` in the other seat (``envkit.make("textarena:TicTacToe-v0",
opponent="policy")``: self-play; the kinds of opponent are in :mod:`envkit.integrations.opponent`), or with
``seats=True`` as a multi-agent env (:class:`TextArenaSeats`, seats ``player_0`` and ``player_1``), each seat bound to
a player by the run: both seats can then learn.

``opponent=`` is a seat binding made inside the env: the policy plays one seat, and the opponent the other, its
moves never trained on. With ``seats=True`` the same bindings are the run's (``seats.player_1`` in
``python -m trainer``): ``opponent="policy"`` is the seat bound to the trained policy too (self-play in which both
seats learn, each with its own baseline), an endpoint ``opponent=`` is ``endpoint=``, a callable is ``script=``.

The game's messages are the user turns and the reply is the move; the game's reward comes when it ends (in a
two-player game, the reward of the env's seat: ``seat=0`` or ``1``, by default the seed's parity, so a task set
plays both sides). The opponent's moves happen inside the env, between the policy's. Two joins are made right:

- textarena's games draw from Python's and numpy's global RNGs (2048 spawns a tile after every move), so games
  running side by side consume each other's draws, and one seed gives different games. Each env here keeps its own
  RNG states and swaps them in around every call into its game, under one lock: a seed gives the same game whatever
  else runs, and the caller's global RNGs are left as they were.
- textarena checks a game's turn limit before it counts the turn, so "within N turns" allows N + 1 moves. Here the
  game's state is given N - 1, so the game's own end-of-budget outcome (GuessTheNumber's partial credit) comes with
  move N; an episode that ends there without a win (reward 1) is ``truncated``. (A reply the game rejects as an
  invalid move is not a move: the game asks again, once, as its rules say.)

A seed gives the same game for a deterministic opponent; a sampled one (the policy at temperature 1) makes its own
moves each time, so a two-player game's start may differ when the opponent moves first.
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

from envkit.core import Env, StepResult, Task
from envkit.integrations import build
from envkit.integrations.opponent import Opponent, make_opponent
from envkit.messages import Message, assistant, user
from envkit.multi_agent import MultiAgentEnv, Seat, Turn

WIN = 1.0
"""The reward a single-player textarena game gives a win."""
_GLOBAL_RNGS = threading.Lock()


class TextArenaEnv(Env):
    """A textarena game: its messages as user turns, each reply a move, its reward at the end; in a two-player
    game, an opponent takes the other seat."""

    reward_range = (-1.0, 1.0)

    def __init__(self, env_id: str, *, opponent: Any = None, seat: int | None = None, **game_kwargs: Any) -> None:
        if env_id not in ENV_REGISTRY:
            raise ValueError(f"textarena has no game {env_id!r} (see textarena.envs.registration.ENV_REGISTRY)")
        if seat not in (None, 0, 1) or (seat is not None and opponent is None):
            raise ValueError(f"seat is 0 or 1 in a two-player game (with opponent=), got seat={seat!r}")
        self.env_id = env_id
        self._opponent: Opponent | None = make_opponent(opponent) if opponent is not None else None
        self._fixed_seat = seat
        self.seat = 0
        """The seat the policy plays (0 in a single-player game)."""
        self._opponent_chat: list[Message] = []
        self._ended_early = False  # the game ended in the opponent's moves before the policy's first
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
        players = 1 if self._opponent is None else 2
        self.seat = 0 if self._opponent is None else seed % 2 if self._fixed_seat is None else self._fixed_seat
        self._opponent_chat = []
        with self._own_rngs():
            try:
                self._game.reset(num_players=players, seed=seed)
            except AssertionError as e:  # textarena's states assert their number of players
                hint = ("a two-player game needs opponent= ('policy', an endpoint, or a callable)" if players == 1
                        else "it is not a two-player game: drop opponent=")
                raise ValueError(f"textarena:{self.env_id}: {e}; {hint}") from e
            state = self._game.state
            self.max_turns = state.max_turns
            if state.max_turns:
                state.max_turns -= 1  # its check runs before its count: N - 1 here ends the game at reply N
        self._ended_early = await self._opponent_moves()
        text = self._observation(self.seat)
        if self._ended_early:  # textarena tells only the player who broke a rule; the policy's reply gets the outcome
            reason = self._game.state.game_info.get(self.seat, {}).get("reason", "")
            text += f"\nThe game ended before your move: {reason}".rstrip(": ")
        return [user(text)], {"seed": seed, "seat": self.seat}

    async def step(self, action: Message) -> StepResult:
        """Play the reply as the move, then the opponent's; the game's reward for this seat when it ends."""
        done, info = self._ended_early, None  # ended early: the game answers any reply with its outcome
        if not done:
            with self._own_rngs():
                done, info = self._game.step(action.get("content") or "")
            done = done or await self._opponent_moves()
        if not done:
            return StepResult([user(self._observation(self.seat))], info=dict(info or {}))
        with self._own_rngs():
            rewards, game_info = self._game.close()
        reward = float((rewards or {}).get(self.seat, 0.0))
        ending = (game_info or {}).get(self.seat, {})
        moves = self._game.state.turn
        truncated = (self.max_turns is not None and moves >= self.max_turns and reward < WIN
                     and not ending.get("invalid_move"))  # a loss by invalid moves is the game's own end
        return StepResult([], reward=reward, terminated=not truncated, truncated=truncated,
                          info={"reason": ending.get("reason", ""), "moves": moves, "seat": self.seat})

    async def _opponent_moves(self) -> bool:
        """The opponent's moves until the env's seat is to move; whether the game ended in them."""
        while self._opponent is not None and self._game.state.current_player_id != self.seat:
            self._opponent_chat.append(user(self._observation(1 - self.seat)))
            move = await self._opponent.move(self._opponent_chat)  # outside the RNG lock: an HTTP call
            self._opponent_chat.append(assistant(move))
            with self._own_rngs():
                done, _ = self._game.step(move)
            if done:
                return True
        return False

    def _observation(self, player: int) -> str:
        """The game's messages to ``player`` since it last looked (textarena's per-player queue, which its
        ``get_observation`` takes for the player to move only; a game may end on the other player's move)."""
        state = self._game.state
        messages, state.observations[player] = state.observations[player], []
        return _text(messages)

    async def close(self) -> None:
        """Release the opponent's connection."""
        if self._opponent is not None:
            await self._opponent.aclose()

    def spaces(self) -> dict[str, Any]:
        return {"observation": f"textarena {self.env_id}: the game's messages", "action": "a move, as the game's "
                "rules say to write it", "reward": "the game's, when it ends"}


def _text(observation: list[tuple[int, str, ObservationType]]) -> str:
    """The game's new messages as one user turn (the player's own moves, echoed back, are left out)."""
    return "\n".join(message for _, message, kind in observation if kind != ObservationType.PLAYER_ACTION).strip()


class TextArenaSeats(MultiAgentEnv):
    """A two-player textarena game as a multi-agent env: seat ``player_N`` is textarena's player N, shown the game's
    messages to that player, its reply that player's move; each seat's reward is the game's, when it ends."""

    seats = ("player_0", "player_1")
    reward_range = (-1.0, 1.0)

    def __init__(self, env_id: str, **game_kwargs: Any) -> None:
        self._arena = TextArenaEnv(env_id, **game_kwargs)  # its game, its RNG states and its message queues
        self.env_id = env_id

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> Turn:
        """Start the game from ``task["seed"]``, else ``seed``, else a random seed; player 0 moves first."""
        arena = self._arena
        seed = task.get("seed") if task is not None else seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        arena._rngs = (random.Random(seed).getstate(), np.random.RandomState(seed % 2**32).get_state())
        with arena._own_rngs():
            try:
                arena._game.reset(num_players=2, seed=seed)
            except AssertionError as e:
                raise ValueError(f"textarena:{self.env_id} is not a two-player game: {e}") from e
        return self._turn(info={"seed": seed})

    async def step(self, actions: dict[Seat, Message]) -> Turn:
        """Play the seat's reply as its player's move; the game's rewards once it ends."""
        (_, action), = actions.items()
        arena = self._arena
        with arena._own_rngs():
            done, info = arena._game.step(action.get("content") or "")
        if not done:
            return self._turn(info=dict(info or {}))
        with arena._own_rngs():
            rewards, game_info = arena._game.close()
        ending = {f"reason_{p}": str(i.get("reason", "")) for p, i in (game_info or {}).items()}
        told = {seat: [user(ending.get(f"reason_{p}") or "The game is over.")] for p, seat in enumerate(self.seats)}
        return Turn(told, to_act=(), rewards={self.seats[p]: float(r) for p, r in (rewards or {}).items()},
                    terminated=True, info={**ending, "moves": arena._game.state.turn})

    def _turn(self, info: dict[str, Any]) -> Turn:
        player = self._arena._game.state.current_player_id
        return Turn({self.seats[player]: [user(self._arena._observation(player))]}, to_act=(self.seats[player],),
                    info=info)


def make_textarena(name: str, *, seats: bool = False, **kwargs: Any) -> TextArenaEnv | TextArenaSeats:
    """The ``textarena`` scheme of ``envkit.make``: ``textarena:<game id>``; with ``seats=True`` a two-player game
    as a multi-agent env."""
    return build(name, TextArenaSeats if seats else TextArenaEnv, kwargs)
