"""envkit-referential: a cooperative game of two seats (``envkit.make("referential")``)."""

from envkit_referential.env import WORDS, ReferentialGame, pick

__all__ = ["WORDS", "ReferentialGame", "pick"]
