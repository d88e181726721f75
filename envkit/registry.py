"""Environments by name: ``register``, ``make``, ``list_envs``, and discovery of pip-installed env packages.

Name grammar: ``[namespace/]name`` where each part is letters, digits, ``.``, ``_`` or ``-`` and starts with a
letter or digit (``arithmetic``, ``guess-number``, ``acme/sokoban-v2``). ``make`` also takes:

- ``package.module:EnvClass``: an env class by entry point, registered or not;
- ``SCHEME:...``, where SCHEME (the part before the first ``:``, up to a ``+``: ``mcp+stdio:...`` is the ``mcp``
  scheme's, as ``git+ssh`` is git's) names a provider in the entry-point group ``envkit.schemes``, called as
  ``provider(name, **kwargs) -> Env`` with the whole name. envkit registers its own schemes there, so this
  module imports none of the env kinds behind them:

  - ``gym:<gymnasium id>`` (e.g. ``gym:Blackjack-v1``): any installed gymnasium env through the text bridge
    (:mod:`envkit.integrations.gym_bridge`, the ``gym`` extra);
  - ``http://host:port/NAME`` or ``ws://host:port/NAME`` (and ``https``, ``wss``): env NAME served by ``envkit
    serve`` on that host, as a :class:`envkit.remote.RemoteEnv` over REST or WebSocket (``remote=RemoteConfig(...)``
    sets the token and timeouts; the other kwargs go to the server's env; the ``server`` extra);
  - ``openenv:http://host:port``: an OpenEnv environment server, through
    :class:`envkit.remote.openenv.OpenEnvEnv` (the ``server`` extra);
  - ``mcp+stdio:COMMAND LINE`` (e.g. ``mcp+stdio:python my_server.py``) and ``mcp+http://host:port/mcp`` (and
    ``mcp+https``): the tools of an MCP server, run as a stdio child process or reached over streamable HTTP, as
    an :class:`envkit.integrations.mcp_env.MCPToolEnv`; tasks and a grader come as kwargs (the ``mcp`` extra).

``make(NAME, sandbox="docker" | "local" | "auto")`` runs the env inside a sandbox of its own (a container from its
image, or an ``envkit serve`` child process), a RemoteEnv underneath; ``pool=`` lends it one from a warm pool and
``sandbox_options={...}`` tunes it. The
providers come from the entry-point group ``envkit.sandboxes`` (the ``sandboxes`` package), so envkit never imports
them.

Env packages register through the entry-point group ``envkit.envs`` in their ``pyproject.toml``::

    [project.entry-points."envkit.envs"]
    arithmetic = "envkit_arithmetic:ArithmeticEnv"

Discovery reads entry-point metadata only; a package is imported when its env is made or listed. A package that
fails to import is reported by ``broken_envs()`` (and ``envkit list``) without hiding the others.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import sys
from dataclasses import dataclass, replace
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from envkit.core import ContractChecker, Env, EnvFactory, EnvSpec
from envkit.distribution import install_hint
from envkit.errors import DuplicateEnvError, EnvLoadError, EnvNotFoundError, InvalidEnvNameError
from envkit.multi_agent import MultiAgentEnv, SeatsChecker

if TYPE_CHECKING:
    from pathlib import Path

    from envkit.rewards.rubrics import Rubric

ENTRY_POINT_GROUP = "envkit.envs"
SANDBOX_GROUP = "envkit.sandboxes"
SCHEME_GROUP = "envkit.schemes"
# envkit's own schemes and the extra each needs: a name with one of them is never read as `module:Class`, and
# gets a clear error when its provider is not installed.
_SCHEME_EXTRAS = {"http": "server", "https": "server", "ws": "server", "wss": "server", "openenv": "server",
                  "gym": "gym", "mcp": "mcp", "reasoning_gym": "reasoning-gym", "skyrl": "skyrl",
                  "textarena": "textarena", "replay": ""}
_NAME_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")

@dataclass(frozen=True)
class BrokenEnv:
    """An installed env that cannot be used, and why."""

    name: str
    source: str
    error: str


def validate_name(name: str) -> str:
    """Return ``name`` if it follows the name grammar, else raise InvalidEnvNameError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidEnvNameError(
            f"Invalid env name {name!r}: use [namespace/]name with letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. 'arithmetic', 'acme/sokoban-v2')."
        )
    return name


class Registry:
    """A name → EnvSpec table fed by ``register()`` calls and the ``envkit.envs`` entry points."""

    def __init__(self, *, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._specs: dict[str, EnvSpec] = {}
        self._broken: dict[str, BrokenEnv] = {}
        self._discovered = False

    def register(
        self,
        name: str,
        entry_point: str | EnvFactory,
        *,
        description: str | None = None,
        **kwargs: Any,
    ) -> EnvSpec:
        """Register an env under ``name``; ``kwargs`` become its default constructor arguments."""
        validate_name(name)
        self._discover()
        factory = None if isinstance(entry_point, str) else entry_point
        target = entry_point if isinstance(entry_point, str) else f"{factory.__module__}:{factory.__qualname__}"
        if ":" not in target:
            raise EnvLoadError(f"entry_point must look like 'package.module:ClassName', got {target!r}")
        spec = EnvSpec(
            name=name,
            entry_point=target,
            kwargs=kwargs,
            description=description if description is not None else first_doc_line(factory),
            source=f"register() at {_caller_location()}",
            factory=factory,
        )
        existing = self._specs.get(name)
        if existing is not None:
            if existing.entry_point == spec.entry_point and existing.kwargs == spec.kwargs:
                return existing  # the same registration running twice (e.g. a module re-import)
            raise DuplicateEnvError(
                f"Env name {name!r} is registered twice: by {existing.source} ({existing.entry_point}) "
                f"and by {spec.source} ({spec.entry_point}). Rename one of them."
            )
        self._specs[name] = spec
        return spec

    def spec(self, name: str) -> EnvSpec:
        """The spec registered under ``name``; raises EnvNotFoundError with suggestions."""
        self._discover()
        if name in self._specs:
            return self._specs[name]
        if name in self._broken:
            raise EnvLoadError(f"Env {name!r} is installed but broken ({self._broken[name].source}): "
                               f"{self._broken[name].error}")
        validate_name(name)
        raise EnvNotFoundError(name, self._suggest(name))

    def make(self, name: str, /, *, checked: bool = True, sandbox: str | None = None, pool: Any = None,
             rubric: Rubric | str | None = None, record: str | Path | None = None,
             **kwargs: Any) -> Env | MultiAgentEnv:
        """Construct the env registered as ``name`` with its default kwargs updated by ``kwargs``.

        The result is wrapped in :class:`ContractChecker` (a multi-agent env's in
        :class:`~envkit.multi_agent.SeatsChecker`) unless ``checked=False``. ``sandbox="docker"`` (or another
        ``envkit.sandboxes`` provider) runs the env in a sandbox of its own instead of in this process, borrowed from
        the warm ``pool`` if one is given (``sandboxes.open_pool``); a name with a scheme (``ws://...``, ``gym:...``)
        is made by that scheme's ``envkit.schemes`` provider. ``rubric`` (:mod:`envkit.rewards.rubrics`: a Rubric or
        ``"module:attr"``) scores each episode as it ends. ``record`` appends every reset and step to that JSONL
        file (:mod:`envkit.recording`).
        """
        if sandbox is not None:
            env: Env = _sandbox_provider(sandbox)(name, pool=pool, **kwargs)
        elif pool is not None:
            raise TypeError(f"make({name!r}, pool=...) needs sandbox=: a warm pool lends sandboxes")
        elif (scheme := _scheme(name)) is not None:
            env = _scheme_provider(scheme)(name, **kwargs)
        else:
            spec = self.spec(name) if ":" not in name else EnvSpec(
                name=name, entry_point=name, source="entry point string given to make()")
            factory = spec.load()
            merged = {**spec.kwargs, **kwargs}
            try:
                env = factory(**merged)
            except Exception as e:
                raise EnvLoadError(
                    f"Env {name!r} ({spec.entry_point}) failed to construct with kwargs {merged!r}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if not isinstance(env, Env | MultiAgentEnv):
                raise EnvLoadError(f"Env {name!r}: {spec.entry_point} returned {type(env).__name__}, not an Env "
                                   "or a MultiAgentEnv")
            env.spec = replace(spec, kwargs=merged, description=spec.description or first_doc_line(factory))
        if isinstance(env, MultiAgentEnv):
            if rubric is not None or record is not None:
                raise TypeError(f"make({name!r}): a multi-agent env takes no rubric= or record= (its rewards are "
                                "per seat)")
            return SeatsChecker(env) if checked else env
        if rubric is not None:
            from envkit.rewards.rubrics import with_rubric

            env = with_rubric(env, rubric)
        if record is not None:
            from envkit.recording import Recorder

            env = Recorder(env, record)
        return ContractChecker(env) if checked else env

    def list(self) -> list[EnvSpec]:
        """Every usable env, sorted by name; imports each package once to fill in descriptions."""
        self._discover()
        for name, spec in list(self._specs.items()):
            if spec.factory is None and spec.package is not None:
                try:
                    factory = spec.load()
                except EnvLoadError as e:
                    cause = e.__cause__ or e
                    del self._specs[name]
                    self._broken[name] = BrokenEnv(name, spec.source, f"{type(cause).__name__}: {cause}")
                    continue
                self._specs[name] = replace(spec, factory=factory, description=first_doc_line(factory))
        return sorted(self._specs.values(), key=lambda s: s.name)

    def broken(self) -> list[BrokenEnv]:
        """Installed envs that failed to load or whose names clash, with the reason."""
        self.list()
        return sorted(self._broken.values(), key=lambda b: b.name)

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        seen: dict[tuple[str, str, str], None] = {}
        for ep in entry_points(group=self.group):
            dist = ep.dist
            package, version = (dist.name, dist.version) if dist is not None else (None, None)
            key = (ep.name, ep.value, package or "")
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen[key] = None
            source = f"package {package} {version}" if package else f"entry point {ep.value}"
            self._add_discovered(
                EnvSpec(name=ep.name, entry_point=ep.value, package=package, version=version, source=source)
            )

    def _add_discovered(self, spec: EnvSpec) -> None:
        if not _NAME_RE.match(spec.name):
            self._broken[spec.name] = BrokenEnv(spec.name, spec.source, f"invalid env name {spec.name!r}")
            return
        other = self._specs.pop(spec.name, None) or self._broken.get(spec.name)
        if other is not None:
            self._broken[spec.name] = BrokenEnv(
                spec.name, f"{other.source}; {spec.source}",
                f"DuplicateEnvError: name {spec.name!r} is claimed by {other.source} and by {spec.source}",
            )
            return
        self._specs[spec.name] = spec

    def _suggest(self, name: str) -> list[str]:
        names = list(self._specs)
        lowered = {n.lower(): n for n in names}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)
        return [lowered[c] for c in close]


def _sandbox_provider(kind: str) -> EnvFactory:
    """The ``envkit.sandboxes`` entry point called ``kind``: ``provider(name, **kwargs) -> Env``."""
    return _provider(SANDBOX_GROUP, kind, "sandbox", "the docker, local and auto sandboxes come with envkit's "
                                                     f"sandboxes package: {install_hint('docker')}")


def _scheme(name: str) -> str | None:
    """The scheme of ``name`` (the part before its first ``:``, up to a ``+``) when one is installed or envkit's own,
    else None (a registered name, or a ``module:Class``)."""
    head, colon, _ = name.partition(":")
    scheme = head.partition("+")[0]
    if colon and (scheme in _SCHEME_EXTRAS or scheme in _entry_points(SCHEME_GROUP)):
        return scheme
    return None


def _scheme_provider(scheme: str) -> EnvFactory:
    """The ``envkit.schemes`` entry point called ``scheme``: ``provider(name, **kwargs) -> Env``."""
    extra = _SCHEME_EXTRAS.get(scheme)
    install = (f"the {scheme!r} scheme comes with envkit's {extra} extra: {install_hint(extra)}" if extra
               else f"reinstall the package that provides the {scheme!r} scheme (entry-point group {SCHEME_GROUP})")
    return _provider(SCHEME_GROUP, scheme, "scheme", install)


def _provider(group: str, name: str, what: str, install: str) -> EnvFactory:
    """Load the entry point ``name`` of ``group``; EnvLoadError, saying ``install``, when it is missing or broken."""
    found = _entry_points(group)
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise EnvLoadError(f"unknown {what} {name!r} (known: {known}); {install}")
    try:
        return found[name].load()
    except Exception as e:
        raise EnvLoadError(f"{what} {name!r} ({found[name].value}) failed to load: {type(e).__name__}: {e}; "
                           f"{install}") from e


@functools.cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    # Read once per process: scanning the installed metadata costs milliseconds, and it does not change under us.
    return {ep.name: ep for ep in entry_points(group=group)}


def _caller_location() -> str:
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def first_doc_line(obj: object) -> str:
    """The first line of ``obj``'s docstring ('' without one): an env's description."""
    doc = inspect.getdoc(obj) if obj is not None else None
    return doc.strip().splitlines()[0] if doc else ""


registry = Registry()
"""The process-wide registry behind ``envkit.register/make/list_envs``."""


def register(name: str, entry_point: str | EnvFactory, *, description: str | None = None, **kwargs: Any) -> EnvSpec:
    """Register an env class (or ``"module:Class"`` string) under ``name`` in the default registry."""
    return registry.register(name, entry_point, description=description, **kwargs)


def make(name: str, /, *, checked: bool = True, sandbox: str | None = None, pool: Any = None,
         rubric: Rubric | str | None = None, record: str | Path | None = None, **kwargs: Any) -> Env | MultiAgentEnv:
    """Make the env called ``name`` (an :class:`Env` or a :class:`~envkit.multi_agent.MultiAgentEnv`); ``kwargs``
    override its registered defaults (see :meth:`Registry.make`)."""
    return registry.make(name, checked=checked, sandbox=sandbox, pool=pool, rubric=rubric, record=record, **kwargs)


def spec(name: str) -> EnvSpec:
    """The EnvSpec registered under ``name``."""
    return registry.spec(name)


def list_envs() -> list[EnvSpec]:
    """Every usable registered env, sorted by name."""
    return registry.list()


def broken_envs() -> list[BrokenEnv]:
    """Installed envs that cannot be loaded, with the reason."""
    return registry.broken()
