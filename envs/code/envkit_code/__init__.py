"""envkit-code: write a Python function that passes hidden unit tests (``envkit.make("code", sandbox="docker")``)."""

from envkit_code.env import PROBLEMS, UNSAFE_ENV, CodeEnv, Problem

__all__ = ["PROBLEMS", "UNSAFE_ENV", "CodeEnv", "Problem"]
