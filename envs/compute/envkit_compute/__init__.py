"""envkit-compute: number questions answered by running code in a sandbox (``envkit.make("compute")``)."""

from envkit_compute.env import DEFAULT_SYSTEM_PROMPT, ComputeEnv

__all__ = ["DEFAULT_SYSTEM_PROMPT", "ComputeEnv"]
