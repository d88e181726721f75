"""envkit-duel: a competitive game of two seats (``envkit.make("duel")``)."""

from envkit_duel.env import NumberDuel

__all__ = ["NumberDuel"]
