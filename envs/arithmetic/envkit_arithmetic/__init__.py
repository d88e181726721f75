"""envkit-arithmetic: seeded single-turn arithmetic problems for envkit (``envkit.make("arithmetic")``)."""

from envkit_arithmetic.env import DEFAULT_SYSTEM_PROMPT, LEVELS, ArithmeticEnv

__all__ = ["DEFAULT_SYSTEM_PROMPT", "LEVELS", "ArithmeticEnv"]
