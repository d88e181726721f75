"""``EnvRef``: which env to make and where it runs, parsed once and then passed whole.

The trainer (``env.*`` in its config), its Ray env workers and ``envkit eval`` all hand one of these around, so an
env's name is read in one place::

    ref = envkit.EnvRef("arithmetic", {"level": 2}, sandbox="docker")
    env = ref.make()
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from envkit.core import Env
from envkit.registry import make

RESERVED_KWARGS = frozenset({"checked", "sandbox", "pool"})
"""``make``'s own arguments, which an EnvRef holds as fields (or, ``checked``, takes at ``make``)."""


class WarmPool(Protocol):
    """A warm pool of sandboxes serving one env (``sandboxes.open_pool``): what a sandboxed env borrows one from."""

    server_kwargs: dict[str, Any]
    """The env kwargs its sandboxes' servers were started with."""

    async def acquire(self) -> Any:
        """A started sandbox, lent until ``release``."""

    async def release(self, sandbox: Any) -> None:
        """Take a lent sandbox back."""


@dataclass(frozen=True)
class EnvRef:
    """An env to make and where it runs."""

    name: str
    """A registered env name (``envkit list``), ``package.module:EnvClass``, or a scheme's: ``gym:ID``,
    ``ws://host:port/NAME`` or ``http://...`` (an ``envkit serve`` server), ``openenv:http://host:port``,
    ``mcp+stdio:COMMAND`` and the others ``envkit.schemes`` providers add."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments (for a server: its session's)."""
    sandbox: str | None = None
    """Run it in a sandbox of its own: docker, local (an ``envkit serve`` child process), auto, or another
    ``envkit.sandboxes`` provider."""
    pool: WarmPool | None = field(default=None, compare=False, repr=False)
    """With ``sandbox``: the warm pool it borrows its sandbox from; none: it starts one of its own."""
    label: str | None = None
    """Its name in metrics and reports (default: ``display_name``'s short name)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an env name must be a non-empty string, got {self.name!r}")
        not_names = [k for k in self.kwargs if not (isinstance(k, str) and k.isidentifier())]
        if not_names:
            raise ValueError(f"env kwarg name {not_names[0]!r} is not a valid Python identifier")
        reserved = sorted(RESERVED_KWARGS & set(self.kwargs))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be env kwargs: an EnvRef holds them as its own fields")
        if self.pool is not None and self.sandbox is None:
            raise ValueError(f"env {self.name!r} has a warm pool but no sandbox to borrow from it")

    @property
    def display_name(self) -> str:
        """The label, else a short name: a gym id, ``openenv``, a URL's env name, an entry point's class."""
        if self.label:
            return self.label
        if self.name.startswith("gym:"):
            return self.name[4:]
        if self.name.startswith("openenv:"):
            return "openenv"
        if "://" in self.name:
            return self.name.split("://", 1)[1].rstrip("/").partition("/")[2] or "remote"
        return self.name.rpartition(":")[2]

    def with_pool(self, pool: WarmPool | None) -> EnvRef:
        """This env, borrowing its sandbox from ``pool`` (None: starting its own)."""
        return replace(self, pool=pool)

    def make(self, *, checked: bool = True) -> Env:
        """A fresh env: ``envkit.make`` with this reference's name, kwargs, sandbox and pool."""
        return make(self.name, checked=checked, sandbox=self.sandbox, pool=self.pool, **self.kwargs)

    def to_json(self) -> dict[str, Any]:
        """The reference as JSON-able values (without the pool, a live object)."""
        return {"name": self.name, "kwargs": dict(self.kwargs), "sandbox": self.sandbox, "label": self.label}
