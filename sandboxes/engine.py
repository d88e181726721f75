"""Docker engine bring-up: install Debian's ``docker.io`` if absent, start ``dockerd`` if not running, and build the
local base image every env image starts from. No image registry is needed (nothing is ever pulled).

::

    python -m sandboxes.engine up        # idempotent: install, start, base image; prints each step
    python -m sandboxes.engine status    # is an engine reachable, which base image
    python -m sandboxes.engine reap      # remove sandbox containers whose owner process died

The base image is Debian bookworm minbase with python3 (3.11, like the host), made with ``debootstrap`` and
``docker import``; it is cached by its tag, so a second ``up`` does nothing but check.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BASE_IMAGE = "envkit-base:bookworm-py311-1"
"""Tag of the base image; bump the suffix when the recipe below changes."""
BASE_PACKAGES = ("python3", "python3-venv")
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SOCKET = Path("/var/run/docker.sock")


def cache_dir() -> Path:
    """The project cache (``$ENVKIT_CACHE_DIR``, default ``~/.cache/envkit``)."""
    return Path(os.environ.get("ENVKIT_CACHE_DIR") or Path.home() / ".cache" / "envkit")


def _say(message: str) -> None:
    print(f">> {message}", file=sys.stderr, flush=True)


def docker_client(timeout_s: float = 60.0) -> Any:
    """A docker SDK client for the local engine (from ``$DOCKER_HOST`` or the default socket)."""
    import docker

    return docker.from_env(timeout=int(timeout_s))


def engine_reachable() -> bool:
    """True when a Docker engine answers a ping. One that accepts the connection but is slow to answer (busy
    removing a pool's containers, say) gets 30 s: a busy engine is not a missing one, and mistaking it for one would
    run code unisolated where ``auto`` was asked for."""
    try:
        import docker
        import requests
    except ImportError:
        return False
    for timeout in (2, 30):
        try:
            client = docker.from_env(timeout=timeout)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except requests.exceptions.ReadTimeout:
            continue
        except Exception:
            return False
    return False


def _run(argv: list[str], **kwargs: Any) -> None:
    subprocess.run(argv, check=True, **kwargs)


def ensure_docker_installed() -> None:
    """Install Debian's docker.io (dockerd, containerd, runc) when ``dockerd`` is missing; needs root and apt."""
    if shutil.which("dockerd") or engine_reachable():
        _say("docker engine binaries present")
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit("dockerd is not installed and this is not a root Debian/Ubuntu shell: install Docker Engine "
                         "(https://docs.docker.com/engine/install/), then rerun `python -m sandboxes.engine up`")
    # iptables: the sandboxes' firewall rules (sandboxes.docker) need it whatever docker.io itself pulls in.
    _apt_install("docker.io", "iptables")


def _apt_install(*packages: str) -> None:
    """``apt-get update`` then install ``packages`` (a fresh machine may have empty package lists)."""
    _say(f"installing {', '.join(packages)} with apt-get (once)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
    _run(["apt-get", "install", "-y", "-q", *packages], env=env, stdout=subprocess.DEVNULL)


def ensure_daemon_running(timeout_s: float = 60.0) -> None:
    """Start ``dockerd`` in the background when no engine answers, and wait until it does."""
    if engine_reachable():
        _say("docker engine is running")
        return
    log_path = cache_dir() / "logs" / "dockerd.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _say(f"starting dockerd (log: {log_path})")
    # No iptables: containers get no NAT to the outside (sandboxes need none) and dockerd works where the
    # kernel's netfilter is unavailable (containers, CI VMs). Its own session, so it outlives this process.
    with open(log_path, "ab") as log:
        subprocess.Popen(["dockerd", "--iptables=false"], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if SOCKET.exists() and engine_reachable():
            _say("docker engine is up")
            return
        time.sleep(0.2)
    raise SystemExit(f"dockerd did not answer within {timeout_s:g} s; see {log_path}")


def _apt_mirror() -> str:
    """The Debian mirror apt is configured with (deb822 or one-line sources), so debootstrap uses the same."""
    for path in [*sorted(Path("/etc/apt/sources.list.d").glob("*.sources")), Path("/etc/apt/sources.list")]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split()
            if path.suffix == ".sources" and words[:1] == ["URIs:"] and "security" not in line:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if "://" in w)
    return DEFAULT_MIRROR


def image_exists(client: Any, tag: str) -> bool:
    """True when the engine holds an image with this tag."""
    import docker.errors

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_base_image(client: Any | None = None, tag: str = BASE_IMAGE,
                      packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    """Build the base image ``tag`` (debootstrap minbase + ``packages``, then ``docker import``) unless it exists."""
    client = client or docker_client()
    if image_exists(client, tag):
        _say(f"base image {tag} present")
        return tag
    if shutil.which("debootstrap") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit("building the base image needs debootstrap (apt-get install debootstrap) as root")
        _apt_install("debootstrap")
    mirror = _apt_mirror()
    work = cache_dir() / "docker"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix="rootfs-") as rootfs:
        _say(f"debootstrap {SUITE} minbase + {', '.join(packages)} from {mirror} (about a minute, once)")
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, rootfs, mirror],
             stdout=subprocess.DEVNULL)
        # apt lists and caches are dead weight in an image that never runs apt.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(Path(rootfs) / junk, ignore_errors=True)
        _say(f"docker import -> {tag}")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        try:
            _run(["docker", "import", "--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin", "-", tag],
                 stdin=tar.stdout, stdout=subprocess.DEVNULL)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
    _say(f"base image {tag} built")
    return tag


def up() -> str:
    """Install, start and prepare everything sandboxes need; returns the base image tag. Idempotent."""
    ensure_docker_installed()
    ensure_daemon_running()
    return ensure_base_image()


def main(argv: list[str] | None = None) -> int:
    """``python -m sandboxes.engine up|status|reap``."""
    parser = argparse.ArgumentParser(prog="python -m sandboxes.engine",
                                     description="Docker engine bring-up for envkit sandboxes.")
    parser.add_argument("command", choices=("up", "status", "reap"),
                        help="up: install docker.io, start dockerd, build the base image (idempotent); "
                             "status: report the engine; reap: remove containers of dead owners")
    args = parser.parse_args(argv)
    if args.command == "up":
        up()
        return 0
    if not engine_reachable():
        print("no docker engine reachable (run `python -m sandboxes.engine up`)")
        return 1
    client = docker_client()
    if args.command == "status":
        version = client.version()
        print(f"docker engine {version.get('Version')} (API {version.get('ApiVersion')}); base image "
              f"{BASE_IMAGE}: {'present' if image_exists(client, BASE_IMAGE) else 'missing'}")
        return 0
    from sandboxes.docker import reap_orphans

    removed = reap_orphans(client)
    print(f"removed {len(removed)} orphaned sandbox container(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
