"""envkit's old module paths, from before its modules moved into rooms, still import: ``from envkit.judges import
LLMJudge``, ``import_ref("envkit.rubrics:GroupRubric")`` in a config, ``python -m envkit.agent_process``.

:data:`MOVED` maps each old name to the new one; a moved package's submodules follow it (``envkit.adapters.skyrl``
is ``envkit.integrations.skyrl``). The finder that ``envkit/__init__.py`` installs gives an old name the new module
itself (``sys.modules[old] is sys.modules[new]``: one copy, its classes keep their new ``__module__``), with a
DeprecationWarning that names the new path. A leaf: it imports nothing of envkit.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

MOVED: dict[str, str] = {
    # envkit.rewards: rubrics, LLM judges and what defends them
    "envkit.rubrics": "envkit.rewards.rubrics",
    "envkit.judges": "envkit.rewards.judges",
    "envkit.grader_talk": "envkit.rewards.grader_talk",
    "envkit.judge_check": "envkit.rewards.judge_check",
    # envkit.agents: agents that run their own loop, the processes that host them, untrusted code
    "envkit.agent": "envkit.agents.agent",
    "envkit.agent_process": "envkit.agents.process",
    "envkit.agent_isolation": "envkit.agents.isolation",
    "envkit.agent_relay": "envkit.agents.relay",
    "envkit.untrusted": "envkit.agents.untrusted",
    "envkit.line_server": "envkit.agents.line_server",
    # envkit.integrations: other ecosystems' envs and trainers (the old envkit.adapters package and its modules)
    "envkit.adapters": "envkit.integrations",
    "envkit.adapters.opponent": "envkit.integrations.opponent",
    "envkit.adapters.reasoning_gym": "envkit.integrations.reasoning_gym",
    "envkit.adapters.skyrl": "envkit.integrations.skyrl",
    "envkit.adapters.textarena": "envkit.integrations.textarena",
    "envkit.adapters.verifiers": "envkit.integrations.verifiers",
    "envkit.adapters.verifiers_driver": "envkit.integrations.verifiers_driver",
    "envkit.gym_bridge": "envkit.integrations.gym_bridge",
    "envkit.gym_games": "envkit.integrations.gym_games",
    "envkit.trl": "envkit.integrations.trl",
    "envkit.mcp_env": "envkit.integrations.mcp_env",
    # envkit.cli: the command line (envkit.cli itself was the module envkit/cli.py; its names are the package's)
    "envkit.check": "envkit.cli.check",
    "envkit.scaffold": "envkit.cli.scaffold",
}
"""Old module name -> where the module is now."""

RUN_AS: dict[str, str] = {"envkit.agent_process": "envkit.agents.host"}
"""Old names whose ``python -m`` entry point moved to another module than the rest: an agent's host process."""


def new_name(name: str) -> str | None:
    """Where the module once called ``name`` is now (a moved package's submodules included); None: it did not
    move."""
    if name in MOVED:
        return MOVED[name]
    for old, new in MOVED.items():
        if name.startswith(old + "."):
            return new + name[len(old):]
    return None


class OldNames(importlib.abc.MetaPathFinder):
    """Finds the modules :data:`MOVED` names by their old names; first on ``sys.meta_path``, before the path finder,
    which would load a moved package's submodule (``envkit.adapters.skyrl``) a second time under its old name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("envkit.") else None
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new))


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module now called ``new``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        _warn(self.old, self.new)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system gave it the old name's spec; the module is the new one's

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code (:data:`RUN_AS`'s where it names one), for ``python -m OLD``: runpy runs it as
        ``__main__``."""
        target = RUN_AS.get(self.old, self.new)
        _warn(self.old, target)
        spec = importlib.util.find_spec(target)
        if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
            raise ImportError(f"no code for {target}", name=target)
        return spec.loader.get_code(target)


def _warn(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the code that imported ``old``, past this module's and importlib's frames
    (``warnings`` itself leaves the import system's ``_bootstrap`` frames out of the count)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
            if filename not in (__file__, importlib.__file__):
                break
        frame = frame.f_back
    warnings.warn(f"{old} moved to {new}: import it from there", DeprecationWarning, stacklevel=level)


FINDER = OldNames()


def install_finder() -> None:
    """Put :data:`FINDER` first on ``sys.meta_path``, once."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)
