"""Other env ecosystems as envkit envs, each behind a scheme of ``envkit.make`` and an extra that installs it:
``reasoning_gym:NAME`` (reasoning-gym datasets), ``skyrl:ID`` (skyrl-gym envs), ``textarena:ID`` (textarena
games; a two-player one with an opponent, :mod:`envkit.adapters.opponent`) and ``verifiers:ENV_ID`` (verifiers
environment packages, run in a venv of their own: :mod:`envkit.adapters.verifiers`)."""

from __future__ import annotations

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
