"""sandboxes: environments and untrusted code in Docker containers, and a local-process fallback.

- ``sandboxes.engine``: bring up the Docker engine and the local base image (``python -m sandboxes.engine up``)
- ``sandboxes.images``: ``envkit build NAME``, an image that runs ``envkit serve NAME``
- ``sandboxes.docker``: ``DockerSandbox`` (a locked-down container, health-waited, always cleaned up), the reaper
- ``sandboxes.pool``: ``SandboxPool``, pre-started sandboxes handed over on ``acquire``
- ``sandboxes.local``: ``LocalSandbox``, the same interface as a child process (no isolation)
- ``sandboxes.env``: the ``envkit.make(NAME, sandbox="docker" | "local" | "auto")`` providers
- ``sandboxes.agent``: ``DockerCommand``, an agent process in a container that reaches only its episode's gateway

The docker SDK is imported only by the modules that talk to the engine (``pip install 'envkit-rl[docker]'``).
"""

from sandboxes.base import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxLost,
    SandboxStartError,
    SandboxStateError,
    SandboxUnavailableError,
)

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxLost",
    "SandboxStartError",
    "SandboxStateError",
    "SandboxUnavailableError",
]
