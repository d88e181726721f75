"""Env images: ``envkit build NAME`` makes an image whose command is ``envkit serve NAME`` on port 8000.

The wheels of envkit, the env's package and every dependency are built on the host (the versions installed here)
and installed offline in the image: containers never reach a package index. The image is tagged with a hash of
its inputs (base image, the sources of the local projects, the pinned dependency versions, this recipe), so a
build whose inputs did not change returns the existing image at once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import Distribution, PackageNotFoundError, distributions, packages_distributions
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import envkit
from envkit.distribution import DISTRIBUTION
from sandboxes.base import EXEC_UID, SERVER_PORT, host_lock, serve_command
from sandboxes.engine import BASE_IMAGE, cache_dir, docker_client, ensure_base_image, image_exists

RECIPE_VERSION = "1"
ENV_LABEL = "org.envkit.env"
# Files that make up a local project's wheel; folders that never do (tests, caches, other projects).
_SOURCE_SUFFIXES = {".py", ".toml", ".yaml", ".yml", ".cfg", ".md", ".txt", ".json", ".typed", ".tmpl"}
_SKIP_DIRS = {".git", "__pycache__", "build", "dist", "tests", "benchmarks", "docs", "site", "examples", "scripts",
              "runs", "outputs", "node_modules"}

DOCKERFILE = """\
FROM {base}
COPY wheels /tmp/wheels
RUN python3 -m venv /opt/envkit \\
 && /opt/envkit/bin/pip install --no-index --no-cache-dir --disable-pip-version-check -q \\
    --find-links /tmp/wheels -r /tmp/wheels/requirements.txt \\
 && rm -rf /tmp/wheels \\
 && chmod -R go-rwx /opt/envkit \\
 && install -d -o 0 -g {exec_uid} -m 0770 /work
ENV PATH=/opt/envkit/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE {port}
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \\
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=1)"]
CMD {command}
"""


@dataclass(frozen=True)
class EnvImage:
    """An env image: its tag, the env it serves, and the package that provides it."""

    tag: str
    env: str
    package: str
    package_version: str
    built: bool
    """False when an image with the same inputs already existed."""


@dataclass(frozen=True)
class _Source:
    """One distribution to put in the image: a local project directory, or ``name==version`` from an index."""

    name: str
    version: str
    project_dir: Path | None


def _installed(name: str) -> Distribution:
    """The installed distribution ``name``: the one pip recorded where it came from, over a stray ``*.egg-info``
    that shadows it only because the current directory is on ``sys.path`` (a build run in a project's root)."""
    found = list(distributions(name=name))
    if not found:
        raise PackageNotFoundError(name)
    return next((d for d in found if d.read_text("direct_url.json")), found[0])


def _local_project(dist: Distribution) -> Path | None:
    """The source directory of a distribution installed from a local path (editable or not), if any."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    url = json.loads(text).get("url", "")
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path))
    return path if (path / "pyproject.toml").exists() or (path / "setup.py").exists() else None


def _closure(roots: list[tuple[str, set[str]]]) -> dict[str, _Source]:
    """Every installed distribution the roots need (with their extras), by canonical name."""
    # Imported here: `envkit` loads this module for its CLI everywhere, images included, where only builds need it.
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, _Source] = {}
    todo = list(roots)
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = _installed(name)
        except PackageNotFoundError as e:
            raise RuntimeError(f"{name} is required in the image but not installed here: pip install {name}") from e
        cname = canonicalize_name(dist.metadata["Name"])
        found.setdefault(cname, _Source(dist.metadata["Name"], dist.version, _local_project(dist)))
        for text in dist.requires or []:
            req = Requirement(text)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(w) for w in wanted):
                todo.append((req.name, set(req.extras)))
    return found


def _project_files(root: Path) -> list[Path]:
    """The files of a local project that can end up in its wheel, in a stable order. Skipped, hidden and egg-info
    directories and nested projects (e.g. envs/arithmetic in the envkit repo: a distribution of its own) are never
    entered: a project's runs/ and virtualenv can hold millions of files."""
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
                   and not (here / d / "pyproject.toml").exists()]
        files += [here / name for name in names if Path(name).suffix in _SOURCE_SUFFIXES and (here / name).is_file()
                  and not (here == root and name.startswith("."))]
    return sorted(files)


def image_name(env: str) -> str:
    """The repository part of an env's image tag (``envkit-env-NAME``, lowercase, ``/`` -> ``-``)."""
    return "envkit-env-" + re.sub(r"[^a-z0-9_.-]+", "-", env.lower())


def provider(env: str) -> tuple[str, str]:
    """The distribution (name, version) that provides ``env``: a registered env's package, or for a
    ``module:Class`` path the distribution that installed the module."""
    if ":" in env:
        top = env.split(":", 1)[0].split(".", 1)[0]
        names = packages_distributions().get(top)
        if not names:
            raise RuntimeError(f"{env}: module {top!r} is not from an installed distribution, so no image can hold "
                               "it: pip install its project first")
        dist = _installed(names[0])
        return dist.metadata["Name"], dist.version
    spec = envkit.spec(env)
    if spec.package is None or spec.version is None:
        raise RuntimeError(f"env {env!r} is registered in code, not by an installed package: an image can only "
                           "hold envs from pip-installable packages")
    return spec.package, spec.version


def plan(env: str, base: str = BASE_IMAGE) -> tuple[str, dict[str, _Source], str]:
    """The tag an up-to-date image of ``env`` has, the distributions it holds, and the requirements it installs."""
    package, _ = provider(env)
    sources = _closure([(DISTRIBUTION, {"server"}), (package, set())])
    digest = hashlib.sha256(f"{RECIPE_VERSION}\n{base}\n{env}\n{DOCKERFILE}".encode())
    requirements = []
    for cname in sorted(sources):
        source = sources[cname]
        requirements.append(f"{source.name}=={source.version}")
        digest.update(f"{cname}=={source.version}\n".encode())
        if source.project_dir is not None:
            for path in _project_files(source.project_dir):
                digest.update(f"{path.relative_to(source.project_dir)}\n".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"{image_name(env)}:{digest.hexdigest()[:12]}", sources, "\n".join(requirements) + "\n"


def _pip(what: str, *argv: str) -> None:
    """Run pip quietly; its (and setuptools') chatter is shown only when it fails, under ``what`` it was doing."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (pip exit {done.returncode}):\n{done.stderr[-3000:]}")


def _build_wheels(sources: dict[str, _Source], wheels: Path, requirements: str) -> None:
    """Wheels for every source into ``wheels``: local projects from a copy of their sources, the rest from the
    project's wheel cache (filled from the index the first time)."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps", "-w", str(wheels)]
    cache = cache_dir() / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    remote = [f"{s.name}=={s.version}" for s in sources.values() if s.project_dir is None]
    if remote:
        # pip copies wheels it finds in the cache and fetches the rest; new ones are kept for the next build.
        _pip(f"fetching {', '.join(remote)} (installed here from a package index: their metadata records no local "
             f"source) from the wheel cache {cache} or the index", *pip, "--find-links", str(cache), *remote)
        for wheel in wheels.glob("*.whl"):
            if not (cache / wheel.name).exists():
                shutil.copy2(wheel, cache)
    for source in sources.values():
        if source.project_dir is None:
            continue
        # Build from a copy holding only the hashed files: the wheel is exactly what the tag describes, and
        # setuptools' build/ and egg-info stay out of the source tree.
        with tempfile.TemporaryDirectory(prefix="envkit-src-") as tmp:
            for path in _project_files(source.project_dir):
                target = Path(tmp) / path.relative_to(source.project_dir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
            _pip(f"building {source.name}'s wheel from its project {source.project_dir}", *pip,
                 "--no-build-isolation", tmp)
    (wheels / "requirements.txt").write_text(requirements)


def build(env: str, *, force: bool = False, client: Any = None, quiet: bool = False) -> EnvImage:
    """Build (or find) the image serving ``env``; rebuilds only when its inputs changed, or with ``force``."""
    client = client or docker_client(timeout_s=600)
    # Two processes that need one image (two runs starting, two test workers) build it once: the second finds it.
    with host_lock(f"image-{env}"):
        return _build(env, force=force, client=client, quiet=quiet)


def _build(env: str, *, force: bool, client: Any, quiet: bool) -> EnvImage:
    base = BASE_IMAGE if image_exists(client, BASE_IMAGE) else ensure_base_image(client)
    tag, sources, requirements = plan(env, base)
    package, version = provider(env)
    result = EnvImage(tag, env, package, version, built=False)
    if image_exists(client, tag) and not force:
        return result

    def say(message: str) -> None:
        if not quiet:
            print(f">> {message}", file=sys.stderr, flush=True)

    say(f"building {tag}: envkit serve {env} ({package} {version}, {len(sources)} distributions)")
    with tempfile.TemporaryDirectory(prefix="envkit-image-") as ctx:
        wheels = Path(ctx) / "wheels"
        wheels.mkdir()
        say("building wheels on the host")
        _build_wheels(sources, wheels, requirements)
        dockerfile = DOCKERFILE.format(base=base, port=SERVER_PORT, exec_uid=EXEC_UID,
                                       command=json.dumps(serve_command(env)))
        (Path(ctx) / "Dockerfile").write_text(dockerfile)
        labels = {"org.envkit.version": envkit.__version__, ENV_LABEL: env, "org.envkit.package": package,
                  "org.envkit.package-version": version}
        say("docker build")
        for chunk in client.api.build(path=ctx, tag=tag, labels=labels, rm=True, forcerm=True, decode=True):
            if "error" in chunk:
                raise RuntimeError(f"docker build of {tag} failed: {chunk['error']}")
            line = chunk.get("stream", "").rstrip()
            if line and not quiet and line.startswith("Step "):
                say(line)
    client.images.get(tag).tag(image_name(env), "latest")
    _remove_superseded(client, env, tag)
    say(f"built {tag}")
    return EnvImage(tag, env, package, version, built=True)


def _remove_superseded(client: Any, env: str, keep: str) -> None:
    """Drop older builds of this env's image; one still used by a container stays."""
    import docker.errors

    for image in client.images.list(name=image_name(env)):
        if keep not in image.tags:
            for old in image.tags:
                with contextlib.suppress(docker.errors.APIError):
                    client.images.remove(old, noprune=False)


def _cmd_build(args: argparse.Namespace, console: Any) -> int:
    image = build(args.name, force=args.force, quiet=args.quiet)
    console.print(f"{image.tag}  ({'built' if image.built else 'up to date'}; envkit serve {image.env} on port "
                  f"{SERVER_PORT}, {image.package} {image.package_version})", highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``envkit build`` (an ``envkit.commands`` plugin)."""
    p = sub.add_parser(
        "build", help="build a Docker image that serves an installed environment (for sandbox='docker')",
        description="Build a Docker image whose command is `envkit serve NAME` on port "
                    f"{SERVER_PORT}: wheels of envkit, the env's package and their dependencies are built on this "
                    "host and installed offline. The tag is a hash of the inputs; an unchanged env is not rebuilt. "
                    "Brings up the Docker engine and the base image first if needed "
                    "(`python -m sandboxes.engine up`).",
        epilog="examples:\n  envkit build arithmetic\n  envkit build code --force\n"
               "  docker run --rm -p 127.0.0.1:8000:8000 envkit-env-arithmetic:latest",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="env name as shown by `envkit list` (must come from an installed package)")
    p.add_argument("--force", action="store_true", help="rebuild even when an image with the same inputs exists")
    p.add_argument("--quiet", action="store_true", help="print only the resulting tag")
    p.set_defaults(func=_cmd_build)
