"""envkit-frozenlake: gymnasium's FrozenLake as a multi-turn text game for LLMs (``envkit.make("frozenlake")``)."""

from __future__ import annotations

from typing import Literal

from envkit.integrations.gym_bridge import GymTextEnv

__all__ = ["FrozenLakeEnv"]


class FrozenLakeEnv(GymTextEnv):
    """Walk across a frozen lake to the goal without falling into a hole (gymnasium FrozenLake-v1 as text).

    Each turn the model sees the map as rows of letters with its position marked P, and answers Left, Down, Right
    or Up. Reaching the goal gives reward 1, a hole or the step limit (100 moves) ends the episode with 0.

    Args:
        map_name: ``"4x4"`` (16 cells) or ``"8x8"`` (64 cells), gymnasium's fixed maps.
        is_slippery: False by default, unlike gymnasium. On slippery ice a move often slides sideways, so even
            a perfect plan fails part of the time and the reward is mostly luck; on firm ice a correct plan
            always scores 1, a clean signal for a training demo. Pass True for gymnasium's original game.
        invalid_penalty: the reward for a reply without a valid action (the lake stays as it was).
        max_invalid: this many invalid replies in a row end the episode (truncated); None for no limit.
    """

    def __init__(
        self,
        *,
        map_name: Literal["4x4", "8x8"] = "4x4",
        is_slippery: bool = False,
        invalid_penalty: float = -0.1,
        max_invalid: int | None = 3,
    ) -> None:
        super().__init__(
            "FrozenLake-v1",
            gym_kwargs={"map_name": map_name, "is_slippery": is_slippery},
            invalid_penalty=invalid_penalty,
            max_invalid=max_invalid,
        )
