"""How gymnasium's discrete games read as text for :class:`~envkit.integrations.gym_bridge.GymTextEnv`: the
:class:`Renderer` of a game (its rules, each observation, its action names), one per toy-text game in
:data:`RENDERERS`, and the generic fallback for any other env."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def ansi_board(env: gymnasium.Env) -> str:
    """``env``'s own text rendering without its colour codes; "" unless it was made with ``render_mode="ansi"``."""
    if env.render_mode != "ansi":
        return ""
    text = _COLOUR.sub("", env.render())
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


@dataclass(frozen=True)
class Renderer:
    """How one kind of gymnasium env reads as text: its rules, each observation, the names of its actions.

    Every part is optional, and ``Renderer()`` is the generic fallback. An observation is the ``board`` (by
    default the env's own ansi rendering, see :func:`ansi_board`) above the ``state``, the observation in words;
    with neither, ``"Observation: <obs>"``. The renderers of known games are in :data:`RENDERERS`.
    """

    names: tuple[str, ...] = ()
    """The Discrete actions' names in order; empty: their numbers."""
    rules: Callable[[gymnasium.Env], str] | None = None
    """The game's rules, the system prompt's first paragraph; None: a sentence naming the env."""
    board: Callable[[gymnasium.Env, Any], str] | None = None
    """``(env, obs)`` drawn as text; None: :func:`ansi_board`. Give one where the ansi rendering shows the state
    only in colour, which text loses."""
    state: Callable[[gymnasium.Env, Any], str] | None = None
    """``(env, obs)`` in words, below the board."""

    def describe(self, env: gymnasium.Env) -> str:
        """The system prompt: the rules of the game and how to answer."""
        if self.rules is not None:
            rules = self.rules(env)
        else:
            name = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
            rules = (f"You are playing the gymnasium environment {name}. Each turn you see an observation and "
                     "choose one action.")
        return f"{rules}\n\n{self.how_to_answer(env)}"

    def render(self, env: gymnasium.Env, obs: Any, info: dict[str, Any]) -> str:
        """One observation as text (``env`` gives access to state the observation only indexes, e.g. a map)."""
        board = self.board(env, obs) if self.board is not None else ansi_board(env)
        state = self.state(env, obs) if self.state is not None else ""
        return "\n".join(part for part in (board, state) if part) or f"Observation: {obs}"

    def action_names(self, env: gymnasium.Env) -> list[str]:
        """The names of the Discrete actions in order; the model answers with one of them."""
        return list(self.names) if self.names else [str(i) for i in range(int(env.action_space.n))]

    def how_to_answer(self, env: gymnasium.Env) -> str:
        """The answer-format paragraph that every ``describe`` ends with."""
        names = self.action_names(env)
        return (
            f"Valid actions: {action_list(names)}. Choose one action per turn and end your reply with a line "
            f"'Action: <action>', e.g. 'Action: {names[-1]}'."
        )


def _slippery(env: gymnasium.Env) -> bool:
    # The toy-text grids keep their dynamics in P; a slippery grid is one where a move has several outcomes.
    return any(len(outcomes) > 1 for moves in env.unwrapped.P.values() for outcomes in moves.values())


def _frozenlake_rules(env: gymnasium.Env) -> str:
    lake = env.unwrapped
    rules = (
        f"You are crossing a frozen lake, a grid of {lake.nrow} rows and {lake.ncol} columns. Walk from the "
        "start S to the goal G. F is safe frozen ice; H is a hole, and stepping into one ends the game. Each "
        "turn you move one cell Left, Down, Right or Up; walking into the edge leaves you where you are. "
        "Row 1 is the top row, column 1 the left column. Reaching G gives reward 1, everything else 0."
    )
    if _slippery(env):
        rules += " The ice is slippery: you do not always move the way you choose, sometimes you slide sideways."
    return rules


def _frozenlake_board(env: gymnasium.Env, obs: Any) -> str:
    # Drawn from the map, because the ansi rendering marks the player only by colour and packs the cells together.
    lake = env.unwrapped
    row, col = divmod(int(obs), lake.ncol)
    grid = [[cell.decode() for cell in line] for line in lake.desc]
    grid[row][col] = "P"
    return "\n".join(" ".join(line) for line in grid)


def _frozenlake_state(env: gymnasium.Env, obs: Any) -> str:
    lake = env.unwrapped
    row, col = divmod(int(obs), lake.ncol)
    lines = [f"You (P) are at row {row + 1}, column {col + 1}."]
    under = lake.desc[row][col].decode()
    if under in "HG":
        lines.append("You fell into a hole!" if under == "H" else "You reached the goal!")
    lines.append("Legend: P you, S start, F frozen ice, H hole, G goal.")
    return "\n".join(lines)


TAXI_STANDS = "RGYB"
"""Taxi's four stands in gymnasium's order (Red, Green, Yellow, Blue): passenger and destination indices."""


def _taxi_rules(env: gymnasium.Env) -> str:
    taxi = env.unwrapped
    rules = (
        f"You drive a taxi in a town of {taxi.max_row + 1} by {taxi.max_col + 1} cells, shown as a map: '|' is a "
        "wall you cannot drive through, ':' an open side between two cells. There are four stands, R, G, Y and B. "
        "A passenger waits at one stand and wants to go to another. Drive to the passenger, Pickup, drive to the "
        "destination and Dropoff. South is down, North up, East right, West left; driving into a wall leaves you "
        "where you are. Row 1 is the top row, column 1 the left column. Reward: -1 per turn, +20 for dropping "
        "the passenger off at the destination, which ends the game, -10 for a Pickup or Dropoff in the wrong place."
    )
    if _slippery(env):
        rules += " It is raining: the taxi sometimes slides sideways instead of moving the way you choose."
    if getattr(taxi, "fickle_passenger", False):  # gymnasium < 1.2 has no fickle passenger
        rules += " The passenger may change their mind about the destination once you have picked them up."
    return rules


def _taxi_board(env: gymnasium.Env, obs: Any) -> str:
    # Drawn from the map, because the ansi rendering marks the taxi, the passenger and the destination only by colour.
    taxi = env.unwrapped
    row, col, _, _ = taxi.decode(int(obs))
    grid = [[cell.decode() for cell in line] for line in taxi.desc]
    grid[1 + row][2 * col + 1] = "T"
    return "\n".join("".join(line) for line in grid)


def _taxi_state(env: gymnasium.Env, obs: Any) -> str:
    taxi = env.unwrapped
    row, col, passenger, destination = taxi.decode(int(obs))

    def stand(i: int) -> str:
        stand_row, stand_col = taxi.locs[i]
        return f"{TAXI_STANDS[i]} (row {stand_row + 1}, column {stand_col + 1})"

    at = f"row {row + 1}, column {col + 1}"
    if (row, col) in taxi.locs:
        at += f", on stand {TAXI_STANDS[taxi.locs.index((row, col))]}"
    if passenger == len(taxi.locs):
        where = f"The passenger is in the taxi and wants to go to {stand(destination)}."
    elif passenger == destination:
        where = f"The passenger has arrived at {stand(destination)}."
    else:
        where = f"The passenger waits at {stand(passenger)} and wants to go to {stand(destination)}."
    return f"The taxi (T) is at {at}.\n{where}\nLegend: T taxi, R G Y B stands, | wall, : open side."


def _cliffwalking_rules(env: gymnasium.Env) -> str:
    rows, cols = env.unwrapped.shape
    rules = (
        f"You walk along a cliff on a grid of {rows} rows and {cols} columns. You are x; you start at the bottom "
        "left and the goal T is at the bottom right. o is safe ground; C is the cliff along the bottom row: "
        "stepping onto it costs -100 and sends you back to the start. Each turn you move one cell Up, Right, Down "
        "or Left; walking into the edge leaves you where you are. Row 1 is the top row, column 1 the left column. "
        "Every move costs -1, so take a short path; reaching T ends the game."
    )
    if _slippery(env):
        rules += " The ground is slippery: you do not always move the way you choose, sometimes you slide sideways."
    return rules


def _cliffwalking_state(env: gymnasium.Env, obs: Any) -> str:
    rows, cols = env.unwrapped.shape
    row, col = divmod(int(obs), cols)
    goal = " You reached the goal!" if (row, col) == (rows - 1, cols - 1) else ""
    return f"You (x) are at row {row + 1}, column {col + 1}.{goal}\nLegend: x you, o safe ground, C cliff, T goal."


def _blackjack_rules(env: gymnasium.Env) -> str:
    return (
        "You are playing blackjack against the dealer. Cards 2-10 count their value, J, Q and K count 10, "
        "and an ace counts 11 unless that would take your total over 21, then 1. Hit to take another card; "
        "Stick to stop. Going over 21 loses at once. After you stick, the dealer draws until reaching 17 or "
        "more, and whoever is closer to 21 wins. Reward: +1 for a win, -1 for a loss, 0 for a draw."
    )


def _blackjack_state(env: gymnasium.Env, obs: Any) -> str:
    total, dealer, usable_ace = (int(x) for x in obs)
    ace = " (an ace counts as 11)" if usable_ace else ""
    shown = {1: "an ace", 10: "a 10 or a face card"}.get(dealer, f"a {dealer}")
    return f"Your cards total {total}{ace}. The dealer shows {shown}."


_FROZENLAKE = Renderer(("Left", "Down", "Right", "Up"), _frozenlake_rules, _frozenlake_board, _frozenlake_state)
_CLIFFWALKING = Renderer(("Up", "Right", "Down", "Left"), _cliffwalking_rules, state=_cliffwalking_state)

RENDERERS: dict[str, Renderer] = {
    "FrozenLake": _FROZENLAKE,
    "FrozenLake8x8": _FROZENLAKE,
    "Taxi": Renderer(("South", "North", "East", "West", "Pickup", "Dropoff"), _taxi_rules, _taxi_board, _taxi_state),
    "CliffWalking": _CLIFFWALKING,
    "CliffWalkingSlippery": _CLIFFWALKING,
    "Blackjack": Renderer(("Stick", "Hit"), _blackjack_rules, state=_blackjack_state),
}
"""The renderer :class:`GymTextEnv` picks for a gym id without its version (action names in gymnasium's order);
other ids get ``Renderer()``. Add an entry to teach it a game, or pass ``renderer=`` or ``action_names=``."""


def renderer_for(env: gymnasium.Env) -> Renderer:
    """The registered renderer for ``env``'s gym id, else the generic ``Renderer()``."""
    key = re.sub(r"-v\d+$", "", env.spec.id) if env.spec is not None else ""
    return RENDERERS.get(key, Renderer())


def action_list(names: Sequence[str]) -> str:
    """Action names as a prompt lists them, with their numbers where the names are not the numbers."""
    listed = ", ".join(names)
    if list(names) != [str(i) for i in range(len(names))]:
        listed += f" (or their numbers 0-{len(names) - 1})"
    return listed
