"""Other ecosystems' envs and trainers, each behind an extra that installs it. Envs by a scheme of ``envkit.make``:
``gym:ID`` (:mod:`envkit.integrations.gym_bridge`, gymnasium envs as text, read by
:mod:`envkit.integrations.gym_games`; ``as_gymnasium`` the other way), ``mcp+stdio:...`` and ``mcp+http://...``
(:mod:`envkit.integrations.mcp_env`, an MCP server's tools), ``reasoning_gym:NAME`` (reasoning-gym datasets),
``skyrl:ID`` (skyrl-gym envs), ``textarena:ID`` (textarena games; a two-player one with an opponent,
:mod:`envkit.integrations.opponent`) and ``verifiers:ENV_ID`` (verifiers environment packages, run in a venv of their
own: :mod:`envkit.integrations.verifiers`, driven by :mod:`envkit.integrations.verifiers_driver`). Trainers:
:mod:`envkit.integrations.trl` gives envkit envs to TRL's GRPOTrainer.

:func:`build` is what the scheme providers share. The names of ``__all__`` that live in a submodule are imported on
first use, so that importing this package needs no extra."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from envkit.core import Env
from envkit.errors import EnvLoadError
from envkit.registry import EnvSpec, first_doc_line

E = TypeVar("E", bound=Env)


def build(name: str, cls: Callable[..., E], kwargs: dict[str, Any]) -> E:
    """``cls(<what follows the scheme>, **kwargs)`` as ``envkit.make(name, **kwargs)`` returns it: with its spec,
    and a bad name or kwargs (the other package's complaints included) raised as EnvLoadError."""
    try:
        env = cls(name.split(":", 1)[1], **kwargs)
    except (TypeError, ValueError, OSError, AssertionError) as e:  # reasoning-gym checks a config with asserts
        raise EnvLoadError(f"{name} failed to construct with kwargs {kwargs!r}: {type(e).__name__}: {e}") from e
    env.spec = EnvSpec(name=name, entry_point=f"{cls.__module__}:{cls.__qualname__}", kwargs=kwargs,
                       description=first_doc_line(cls), source=f"{name.split(':', 1)[0]} adapter")
    return env


_LAZY = {
    "GymTextEnv": "gym_bridge", "GymnasiumEnv": "gym_bridge", "as_gymnasium": "gym_bridge", "make_gym": "gym_bridge",
    "RENDERERS": "gym_games", "Renderer": "gym_games",
    "MCPTimeouts": "mcp_env", "MCPToolEnv": "mcp_env", "make_mcp": "mcp_env",
    "Opponent": "opponent", "OpponentError": "opponent", "make_opponent": "opponent",
    "ReasoningGymEnv": "reasoning_gym", "make_reasoning_gym": "reasoning_gym",
    "SkyRLEnv": "skyrl", "make_skyrl": "skyrl",
    "TextArenaEnv": "textarena", "make_textarena": "textarena",
    "TRLEnvironment": "trl",
    "VerifiersEnv": "verifiers", "make_verifiers": "verifiers",
}
"""Name -> the submodule that has it."""

__all__ = ["build", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    """A name of a submodule's (:data:`_LAZY`), imported on first use: each needs its own extra."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
