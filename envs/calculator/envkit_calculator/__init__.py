"""envkit-calculator: arithmetic word problems with a calculator tool for envkit (``envkit.make("calculator")``)."""

from envkit_calculator.env import DEFAULT_SYSTEM_PROMPT, CalculatorEnv, evaluate

__all__ = ["DEFAULT_SYSTEM_PROMPT", "CalculatorEnv", "evaluate"]
