"""Run inside a container cluster's head node by tests/test_cluster.py (which cannot join the cluster itself: its
process has already loaded Ray without the cluster's token authentication).

    python tests/cluster_probe.py kill NAMESPACE NETWORK   # kill env-worker-0 once it holds sandboxes, then replica-0
                                                          # once it serves; prints the sandboxes seen on NETWORK
    python tests/cluster_probe.py actors NAMESPACE         # prints the named actors left in NAMESPACE
    python tests/cluster_probe.py groups NAMESPACE         # prints the placement groups not removed (any run's)
    python tests/cluster_probe.py kill-node NAMESPACE NODE # docker kill NODE once env-worker-0 has episodes open
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from sandboxes.docker import SANDBOX_LABEL, connect


def run(head: Any, *argv: str) -> Any:
    """What this script prints when run with ``argv`` inside ``head`` (a docker-py container): its stdout's JSON.
    Only stdout: what Ray prints (a raylet's warning of a disk filling up, say) is not the answer."""
    done = head.exec_run([sys.executable, str(Path(__file__).resolve()), *argv], demux=True)
    stdout, stderr = (part.decode(errors="replace") if part else "" for part in done.output)
    if done.exit_code:
        raise RuntimeError(f"cluster_probe {' '.join(argv)} exited {done.exit_code}: {(stdout + stderr)[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def kill(network: str) -> list[str]:
    """Kill the run's env-worker-0 and replica-0 as each gets work; the sandbox containers seen meanwhile."""
    client = connect()
    seen: set[str] = set()

    def kill_when(name: str, busy: Callable[[Any], bool]) -> None:
        deadline = time.monotonic() + 600  # a hang guard, not a speed check
        while time.monotonic() < deadline:
            seen.update(c.name for c in client.containers.list(ignore_removed=True, filters={
                "label": SANDBOX_LABEL, "network": network}))
            try:
                actor = ray.get_actor(name)
                if busy(actor):
                    ray.kill(actor)
                    return
            except (ValueError, ray.exceptions.RayError):
                pass  # not created yet, or still starting
            time.sleep(0.2)
        raise SystemExit(f"{name} never got work")

    kill_when("env-worker-0", lambda worker: ray.get(worker.episodes.remote(), timeout=10) > 0 and bool(seen))
    kill_when("replica-0", lambda replica: ray.get(replica.requests_in_flight.remote(), timeout=10) > 0)
    return sorted(seen)


if __name__ == "__main__":
    command, namespace = sys.argv[1:3]
    ray.init(address="auto", namespace=namespace, logging_level="ERROR", log_to_driver=False)
    if command == "kill":
        print(json.dumps(kill(sys.argv[3])))
    elif command == "kill-node":
        deadline = time.monotonic() + 600  # a hang guard, not a speed check
        while time.monotonic() < deadline:
            try:
                if ray.get(ray.get_actor("env-worker-0").episodes.remote(), timeout=10) > 0:
                    connect().containers.get(sys.argv[3]).kill()
                    print(json.dumps(time.time()))
                    break
            except (ValueError, ray.exceptions.RayError):
                pass  # not created yet, or still starting
            time.sleep(0.05)
        else:
            raise SystemExit("env-worker-0 never had episodes open")
    elif command == "actors":
        print(json.dumps(sorted(ray.util.list_named_actors())))
    else:
        print(json.dumps(sorted(g["name"] or g["placement_group_id"] for g in ray.util.placement_group_table().values()
                                if g["state"] != "REMOVED")))
