"""envkit-guess-number: a higher/lower guessing game for envkit (``envkit.make("guess-number")``)."""

from envkit_guess_number.env import DEFAULT_SYSTEM_PROMPT, MIN_REWARD, GuessNumberEnv

__all__ = ["DEFAULT_SYSTEM_PROMPT", "MIN_REWARD", "GuessNumberEnv"]
