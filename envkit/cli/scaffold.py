"""``envkit new NAME``: write a new env package to start from, rendered from the templates in ``envkit/cli/templates``.

    NAME/
      pyproject.toml          the ``envkit.envs`` entry point; depends on envkit's distribution, at least this version
      README.md               how to install, test, list, serve, build, eval and train it
      MODULE/__init__.py
      MODULE/env.py           the env class of the chosen kind, its tasks, and docstrings on what to change
      tests/test_MODULE.py    tests of reset, step, rewards and tasks, which pass as generated

NAME is the env name, the distribution name and the directory; MODULE is NAME with ``-`` as ``_``. The templates
are ``string.Template`` files (``$name``, ``$module``, ``$class_name``, ...), shipped as package data.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import shutil
import string
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, entry_points, packages_distributions
from importlib.resources import files
from pathlib import Path

from envkit.errors import ScaffoldError
from envkit.registry import ENTRY_POINT_GROUP

KINDS: dict[str, str] = {
    "single": "A single-turn envkit environment: one question, one graded answer.",
    "multi": "A multi-turn envkit environment with a reward for each turn.",
    "tool": "A tool-using envkit environment: the model calls tools, then answers.",
}
"""Each kind of env ``envkit new`` writes, and the description its package starts with."""

_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
# A package called `tests` would be the package's own test folder.
_RESERVED = {"tests"}


@dataclass(frozen=True)
class PackageNames:
    """The names a new env package goes by."""

    name: str
    """The env name (``envkit.make(name)``), the distribution name and the directory name."""
    module: str
    """The import package: ``name`` with ``-`` as ``_``."""
    class_name: str
    """The env class: ``name`` in CamelCase, ending in ``Env``."""


def package_names(name: str) -> PackageNames:
    """The names of a new package called ``name``; ScaffoldError when it is malformed or already taken here."""
    if not _NAME_RE.match(name):
        raise ScaffoldError(f"invalid package name {name!r}: use lowercase letters and digits, words joined by one "
                            "'-' or '_', starting with a letter (e.g. 'sokoban', 'word-ladder')")
    module = name.replace("-", "_")
    if keyword.iskeyword(module) or module in _RESERVED:
        raise ScaffoldError(f"{name!r} cannot be a Python package name: pick another name")
    found = importlib.util.find_spec(module)
    if found is not None and found.origin is not None:  # a folder of that name on sys.path is no module (origin None)
        raise ScaffoldError(f"a module {module!r} is already importable here ({found.origin}): a package of that name "
                            "would shadow it or be shadowed by it, so pick another name")
    try:
        taken = distribution(name)
    except PackageNotFoundError:
        pass
    else:
        raise ScaffoldError(f"a distribution {taken.metadata['Name']} {taken.version} is installed here: installing "
                            "your package would replace it, so pick another name")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            source = f"package {ep.dist.name}" if ep.dist is not None else ep.value
            raise ScaffoldError(f"an env named {name!r} is already installed ({source}): pick another name")
    camel = "".join(part.capitalize() for part in re.split(r"[-_]", name))
    return PackageNames(name, module, camel if camel.endswith("Env") and camel != "Env" else camel + "Env")


def envkit_distribution() -> tuple[str, str]:
    """The name and version of the installed distribution that provides the ``envkit`` package.

    The name is read, not assumed: ``envkit`` on PyPI is an unrelated project, so envkit's distribution is
    published under another name.
    """
    names = sorted(set(packages_distributions().get("envkit", [])))
    if not names:
        where = Path(sys.modules["envkit"].__file__ or "envkit").parent
        raise ScaffoldError(f"envkit (imported from {where}) comes from no installed distribution, so the new package "
                            "cannot name its dependency: pip install envkit's project (e.g. pip install -e REPO) first")
    if len(names) > 1:
        raise ScaffoldError(f"several installed distributions provide the envkit package ({', '.join(names)}): "
                            "uninstall the stale ones first")
    dist = distribution(names[0])
    return dist.metadata["Name"], dist.version


def render(names: PackageNames, kind: str, envkit_dist: tuple[str, str]) -> dict[str, str]:
    """The new package's files (path relative to its directory -> text) for ``kind``, depending on
    ``envkit_dist`` (name, version) at that version or later."""
    if kind not in KINDS:
        raise ScaffoldError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    dist, version = envkit_dist
    # A local version label (+g1234) is not allowed in a >= specifier; the release it marks is the floor.
    values = {"name": names.name, "module": names.module, "class_name": names.class_name, "kind": kind,
              "description": KINDS[kind], "envkit_dist": dist, "envkit_requirement": f"{dist}>={version.split('+')[0]}"}
    templates = files("envkit.cli") / "templates"
    sources = {
        "pyproject.toml": "pyproject.toml.tmpl",
        "README.md": "README.md.tmpl",
        f"{names.module}/__init__.py": "__init__.py.tmpl",
        f"{names.module}/env.py": f"{kind}/env.py.tmpl",
        f"tests/test_{names.module}.py": f"{kind}/test.py.tmpl",
    }
    return {path: string.Template(templates.joinpath(source).read_text()).substitute(values)
            for path, source in sources.items()}


def new_env(name: str, *, kind: str = "single", parent: Path | str = ".") -> Path:
    """Write the env package ``name`` of ``kind`` into ``parent/name`` and return that directory.

    Refuses (ScaffoldError) a bad or taken name, and a target that exists and is not an empty directory: it never
    overwrites a file. A write that fails halfway removes what it wrote.
    """
    names = package_names(name)
    target = Path(parent) / name
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise ScaffoldError(f"{target} already exists: envkit new never overwrites; pick another name or --dir")
    rendered = render(names, kind, envkit_distribution())
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        for path, text in rendered.items():
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            (target / path).write_text(text)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # it was empty or absent: all it holds is ours
        if not created:
            target.mkdir()
        raise
    return target
