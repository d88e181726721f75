"""A multi-node Ray cluster of Docker containers on this machine (trainer/container_cluster.py):
`python -m trainer.container_cluster up`, one training run placed across its nodes from this host's driver, two kills
in its first step, and `down` leaving nothing of the cluster (and everything that is not its own).

The run: the trainer rank (and the capture gateway, in rank 0) on the head; two vLLM replicas on worker1 with the
reward model's actor; two env workers on worker2 playing a Docker-sandboxed arithmetic env (each worker a warm pool
of its own, the containers the nodes' siblings on the cluster's sandbox network) and an agent env whose agents call
the gateway on the head. A worker holding containers and a replica serving requests are killed in step 1:
the step completes, the worker's open rollouts are counted failed (and said so, with their errors), the replica's
requests go to the other one, and both are replaced on their nodes. Tiny model: what is checked is where each part
ran and what crossed the nodes, not what it learned.

The agent env's episodes are each played by two agent processes on worker2 that try what a policy-driven process
would: an isolated Command (a uid and namespaces of its own) and a DockerCommand container (staged in the shared
directory, which the host's Docker engine sees). Each calls the gateway once, and reaches no port of the head (its
Ray, the gateway's shared port), reads no Ray token and finds no other episode's key; the control, the same probe
run as root on worker2, reaches the head's Ray and reads the token.

Before the run, a container on the sandbox network tries the head's Ray port: refused
(trainer.container_cluster.fence), and reached once the fence is down (the positive control). The run is traced
(``up --traces``: Phoenix on the cluster's network): each rollout is one trace across the nodes, read back from
Phoenix and its span tree checked, and an agent rollout's trace is opened in Phoenix's UI in Chromium (its screenshot
is in the test report).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_probe
import psutil
import pytest
from tiny import env_with_tests, tiny_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.docker]

REPO = Path(__file__).resolve().parent.parent
NAME = "envkit-test-cluster"


def _cluster(*argv: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "trainer.container_cluster", *argv, "--name", NAME], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _run_servers(namespace: str, within_s: float = 30.0) -> list[int]:
    """The run's vLLM servers (on any node: this host sees the nodes' processes) still up ``within_s`` after it
    ended (a server's watchdog ends it a moment after the actor that started it died)."""
    from trainer.placement.groups import RUN_ENV

    def left() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline", "environ"])
                if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or ())
                and (p.info["environ"] or {}).get(RUN_ENV) == namespace]

    deadline = time.monotonic() + within_s  # a hang guard, not a speed check
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def _probe(client: Any, *argv: str) -> Any:
    """What tests/cluster_probe.py prints, run inside the cluster's head node."""
    return cluster_probe.run(client.containers.get(f"{NAME}-head"), *argv)


@pytest.fixture(scope="module")
def cluster(docker_client, tmp_path_factory) -> Iterator[tuple[dict[str, str], Path]]:
    """The cluster up, with what its `down` must leave: a container and a network named like its own, not labelled
    so. A module fixture: it comes up before the test takes the machine (tests/conftest.py, machine.hold), while the
    other worker still runs, and whatever the test left of it goes after the machine is free again."""
    from sandboxes.engine import BASE_IMAGE

    env = env_with_tests()
    shared = tmp_path_factory.mktemp("cluster")
    decoy = docker_client.containers.create(BASE_IMAGE, ["true"], name=f"{NAME}-worker9")
    decoy_net = docker_client.networks.create(f"{NAME}-other", driver="bridge", internal=True)
    try:
        up = _cluster("up", "--shared", str(shared), "--traces", env=env)
        assert [line.split("\t")[0] for line in up.splitlines()[:4]] == [
            f"{NAME}-head", f"{NAME}-worker1", f"{NAME}-worker2", f"{NAME}-traces"], up
        yield env, shared
    finally:
        _cluster("down", env=env)  # a second `down` finds nothing: the test's own is what is checked
        decoy.remove(force=True)
        decoy_net.remove()


@pytest.mark.hold_machine
def test_a_run_across_three_container_nodes_places_each_role_and_survives_two_kills(cluster, docker_client, machine,
                                                                                   record_property):
    from sandboxes.docker import OWNER_LABEL, SANDBOX_LABEL
    from trainer.container_cluster import CLIENT_PORT, CLUSTER_LABEL, GCS_PORT, TOKEN_IN_NODE

    env, tmp_path = cluster
    _check_fence(docker_client)
    driver = dict(line.removeprefix("export ").split("=", 1) for line in _cluster("env", env=env).splitlines())
    out = tmp_path / "run"
    head = _ip(docker_client, "head", NAME)
    ray_ports, scouted = [f"{head}:{GCS_PORT}", f"{head}:{CLIENT_PORT}"], tmp_path / "scouted.jsonl"
    _check_agents_could_reach(docker_client, ray_ports, TOKEN_IN_NODE)
    mixture = ('env.mixture=[{name: arithmetic, sandbox: docker, kwargs: {rubric: "rubric_parts:on_worker1"}},'
               f' {{name: "agent_envs:scout_sums", kwargs: {{report: "{scouted}", token: "{TOKEN_IN_NODE}",'
               f' addresses: {json.dumps(ray_ports)}}}}}]')
    # the machine alone while the run goes (before and after it, the other worker runs its tests)
    with machine.hold():
        log = (tmp_path / "driver.log").open("w")  # a pipe nobody reads while the test polls would fill up
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer", "placement.backend=ray", f"placement.address={driver['ENVKIT_CLUSTER']}",
             f"trainer.output_dir={out}", f"model.path={tiny_model_dir()}", "inference.engine=vllm",
             "inference.kv_cache_gib=1", "trainer.steps=2", "trainer.save_every=1", "trainer.eval_tasks=0",
             "logging.progress=false", "generator.prompts_per_step=2", "generator.samples_per_prompt=4",
             "generator.max_tokens=16", "trainer.micro_batch_tokens=2048", "trainer.warmup_steps=0",
             "placement.inference_replicas=2", "placement.env_workers=2", mixture, "generator.gateway_host=0.0.0.0",
             "+placement.trainer_resources.head=1", "+placement.replica_resources.worker1=1",
             "+placement.env_worker_resources.worker2=1", f"logging.traces={driver['ENVKIT_CLUSTER_TRACES']}",
             "logging.rollouts=true"],
            cwd=REPO, env={**env, **driver}, text=True, stdout=log, stderr=subprocess.STDOUT)
        namespace = f"envkit-{process.pid}"
        try:
            sandboxes = set(_probe(docker_client, "kill", namespace, f"{NAME}-sandboxes"))  # seen while the run went
            assert _run_servers(namespace, within_s=0), "the run's live servers are not found: the check is blind"
            process.wait(timeout=900)  # a hang guard, not a speed check
        finally:
            if process.poll() is None:
                process.kill()
    output = (tmp_path / "driver.log").read_text()
    assert process.returncode == 0, output[-4000:]
    run_actors = _probe(docker_client, "actors", namespace)
    after_run = {c.name for c in docker_client.containers.list(all=True, ignore_removed=True)}

    summary = json.loads((out / "summary.json").read_text())
    hosts = {name: where.split()[0] for name, where in summary["nodes"].items()}
    assert {(re.sub(r"-\d+$|-[0-9a-f]{16}$", "", name), host) for name, host in hosts.items()} == {
        ("trainer-rank", "head"), ("replica", "worker1"), ("env-worker", "worker2"), ("envkit-reward", "worker1")
    }, summary["nodes"]
    assert {"replica-1", "replica-2", "env-worker-1", "env-worker-2"} <= set(hosts)  # the replacements

    metrics = {m["step"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [1, 2], output[-4000:]
    failed = {step: int(m["rollout/failed"]) for step, m in metrics.items() if m["rollout/failed"]}
    assert failed, metrics
    warned = dict(re.findall(r"step (\d+): (\d+) of \d+ rollouts failed and were not trained on; first errors: "
                             r"\S", output))
    assert {int(s): int(n) for s, n in warned.items()} == failed, output[-4000:]
    # logging.rollouts: each step's rollouts, the ones it could not train on too
    written = {step: list(map(json.loads, (out / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()))
               for step in metrics}
    assert {step: sum(t["stop_reason"] in ("error", "timeout") for t in rows) for step, rows in written.items()
            if step in failed} == failed
    assert [len(rows) for rows in written.values()] == [2 * 4, 2 * 4]  # prompts × samples, whatever became of them
    assert "inference replica 0 died under a request" in output
    assert re.search(r"env worker env-worker-0 on worker2 \(\d+\.\d+\.\d+\.\d+\) died", output), output[-4000:]
    assert metrics[2]["envs/worker_restarts"] == 1 and metrics[2]["envs/workers"] == 2
    assert metrics[2]["inference/replicas_lost"] == 1
    # a rollout's limit: generator.timeout_s in the first step, then 1.8 × the slowest step so far (at least 50 s)
    assert metrics[1]["rollout/deadline_s"] == 120
    assert metrics[2]["rollout/deadline_s"] == min(120, max(50, 1.8 * metrics[1]["time/step_s"]))
    for m in metrics.values():
        assert m["weights/from_memory"] == 1  # the new weights crossed to worker1 through the object store
    scored = [m for m in metrics.values() if m["env/arithmetic/trained"]]
    assert scored and all(0 < m["rubric/reward_model"] < 1 for m in scored)  # by the actor on worker1
    assert any(m.get("train/grad_norm", 0) > 0 for m in metrics.values())  # the run trained
    assert sandboxes, "no sandbox container on the cluster's sandbox network"
    trajs = [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]
    agents = [t for t in trajs if t["env_name"] == "scout_sums" and not t["error"]]
    # each episode's two calls were captured by the gateway on the head, from agents on worker2
    assert agents and all(t["num_turns"] == 2 and sum(t["loss_mask"]) > 0 for t in agents), agents[:1]
    _check_agents_reached_nothing([json.loads(line) for line in scouted.read_text().splitlines()])
    agent_containers = [c.name for c in docker_client.containers.list(all=True, ignore_removed=True, filters={
        "label": f"{SANDBOX_LABEL}=agent"}) if c.labels.get(OWNER_LABEL, "").startswith(("head:", "worker"))]
    assert {"step-000001", "step-000002"} <= {p.name for p in (out / "checkpoints").iterdir()}
    assert run_actors == [] and _run_servers(namespace) == []
    # the dead worker's containers too: its pool could not drain them, the run's end removed them
    assert not sandboxes & after_run, sorted(sandboxes & after_run)
    assert agent_containers == []
    screenshot = _check_traces(driver["ENVKIT_CLUSTER_TRACES"].removesuffix("/v1/traces"), namespace)
    record_property("kept", f"the agent rollout's trace in Phoenix, in Chromium: {screenshot}")

    removed = _cluster("down", env=env)
    left = docker_client.containers.list(all=True, ignore_removed=True, filters={"label": f"{CLUSTER_LABEL}={NAME}"})
    networks = [n.name for n in docker_client.networks.list(filters={"label": f"{CLUSTER_LABEL}={NAME}"})]
    names = {c.name for c in docker_client.containers.list(all=True, ignore_removed=True)}
    assert f"removed {NAME}-head" in removed and f"removed network {NAME}-sandboxes" in removed, removed
    assert left == [] and networks == [] and f"{NAME}-worker9" in names
    assert docker_client.networks.list(names=[f"{NAME}-other"])


def _ip(client: Any, role: str, network: str) -> str:
    """Node ``role``'s address on ``network``."""
    return client.containers.get(f"{NAME}-{role}").attrs["NetworkSettings"]["Networks"][network]["IPAddress"]


def _check_agents_could_reach(client: Any, addresses: list[str], token: str) -> None:
    """The positive control of the agents' isolation: on worker2, unisolated (as root, on the node's network), the
    scout's own probe reaches the head's Ray ports (``addresses``) and reads the Ray token."""
    scout = str(Path(__file__).with_name("docker_agent.py"))
    worker = client.containers.get(f"{NAME}-worker2")
    reached = json.loads(worker.exec_run(["python3", scout, "probe", *addresses], demux=True).output[0])
    assert [reached[address] for address in addresses] == ["ok"] * len(addresses), reached
    assert worker.exec_run(["cat", token]).exit_code == 0


def _check_agents_reached_nothing(scouted: list[dict[str, Any]]) -> None:
    """The agents on worker2, each episode's isolated Command (a uid of its own, in its own network and PID
    namespaces) and its DockerCommand container (nobody, no network), reached no port (not the head's Ray, not the
    gateway's shared port) and no name, read no Ray token and found no other episode's key, though agents of other
    episodes ran beside them."""
    assert scouted
    for seen in scouted:
        assert 20000 <= seen["command"]["uid"] < 21000 and seen["docker"]["uid"] == 65534, seen
        for agent in seen.values():
            assert not [where for where, got in agent["reached"].items() if got == "ok"], agent
            assert agent["read"] != "ok" and agent["found_keys"] == [], agent


def _reaches(client: Any, ip: str, port: int) -> bool:
    """Whether a container on the cluster's sandbox network (where an env worker's sandboxes run what the policy
    wrote) can open a TCP connection to ``ip:port``."""
    import docker.errors

    from sandboxes.engine import BASE_IMAGE

    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=1)"
    try:
        client.containers.run(BASE_IMAGE, ["python3", "-c", probe], network=f"{NAME}-sandboxes", remove=True)
    except docker.errors.ContainerError:
        return False
    return True


def _check_fence(client: Any) -> None:
    """A sandbox reaches no node: not the head's Ray (GCS, Ray Client), whose token is all that stands between it
    and the cluster. The positive control: the same probe reaches the head with its fence taken down."""
    from trainer.container_cluster import GCS_PORT, fence

    head = client.containers.get(f"{NAME}-head")
    ip = _ip(client, "head", f"{NAME}-sandboxes")
    subnet = client.networks.get(f"{NAME}-sandboxes").attrs["IPAM"]["Config"][0]["Subnet"]
    assert not _reaches(client, ip, GCS_PORT)
    rule = ["INPUT", "-s", subnet, "-p", "tcp", "--syn", "-j", "DROP"]
    subprocess.run(["nsenter", "-t", str(head.attrs["State"]["Pid"]), "-n", "iptables", "-D", *rule], check=True)
    try:
        assert _reaches(client, ip, GCS_PORT), "the probe cannot reach an unfenced head: the check is blind"
    finally:
        fence(client, NAME)
    assert not _reaches(client, ip, GCS_PORT)


def _flat(attributes: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Phoenix's attributes, nested at each dot, as the flat ``rl.*`` names the spans were given."""
    flat: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _spans(phoenix: str, project: str) -> list[dict[str, Any]]:
    """Every span Phoenix holds for the run's project (its name: the run's)."""
    import httpx

    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = httpx.get(f"{phoenix}/v1/projects/{project}/spans",
                         params={"limit": 1000, **({"cursor": cursor} if cursor else {})}, timeout=60)
        assert page.status_code == 200, page.text[:500]
        body = page.json()
        spans += [{**span, "attributes": _flat(span["attributes"])} for span in body["data"]]
        if not (cursor := body.get("next_cursor")):
            return spans


def _check_traces(phoenix: str, project: str) -> Path:
    """One trace per rollout across the nodes, as Phoenix received it from every process of the run: an agent
    rollout's tree (the generator and the gateway on the head, its agent's env worker on worker2, the replica that
    sampled each call on worker1), a sandboxed one's (its reward on worker1's actor); the steps' update and weight
    sync. Then the agent rollout's trace in Phoenix's UI, in Chromium: the screenshot's path is in the report."""
    time.sleep(2)  # each process exports every 0.5 s; the run's last batches
    spans = _spans(phoenix, project)
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        children.setdefault(span["parent_id"], []).append(span)

    def kids(span: dict[str, Any], name: str) -> list[dict[str, Any]]:
        return [c for c in children.get(span["context"]["span_id"], []) if c["name"] == name]

    def one(found: list[dict[str, Any]], where: str) -> dict[str, Any]:
        assert len(found) == 1, (where, [c["name"] for c in found])
        return found[0]

    def node(span: dict[str, Any]) -> str:
        return span["attributes"]["rl.node"]

    rollouts = [s for s in spans if s["name"] == "rollout" and s["parent_id"] is None]
    assert {s["attributes"]["rl.run"] for s in spans} == {project}
    # every rollout, the failed too: 2 prompts × 4 samples a step (the spans of a killed process's last 0.5 s may
    # be lost with it, never a rollout's root: the generator's)
    assert Counter(r["attributes"]["rl.step"] for r in rollouts) == {1: 8, 2: 8}
    agents = [r for r in rollouts if r["attributes"]["rl.env"] == "scout_sums" and r["attributes"].get("rl.stop_reason")
              == "done"]
    assert agents, [r["attributes"] for r in rollouts[:3]]
    root = agents[0]
    a = root["attributes"]
    assert node(root) == "head" and a["rl.step"] in (1, 2) and a["rl.tokens"] > 0 and "rl.reward" in a, a
    assert a["rl.weight_version"] == a["rl.step"] - 1 and a["rl.task_id"] and a["rl.turns"] == 2
    assert {node(s) for s in kids(one(kids(root, "env.reset"), "env.reset"), "EnvWorker.reset")} == {"worker2"}
    run = one(kids(root, "agent.run"), "agent.run")
    assert node(one(kids(run, "EnvWorker.run_agent"), "run_agent")) == "worker2"
    calls = kids(run, "gateway /v1/chat/completions")  # made by the agent on worker2, served on the head
    assert len(calls) == 2 and {node(c) for c in calls} == {"head"}, children[run["context"]["span_id"]]
    for call in calls:
        sampled = one(kids(one(kids(call, "generate"), "generate"), "EngineActor.generate"), "replica")
        assert node(sampled) == "worker1" and sampled["context"]["trace_id"] == root["context"]["trace_id"]
    assert node(one(kids(one(kids(root, "agent.score"), "agent.score"), "EnvWorker.score"), "score")) == "worker2"

    sandboxed = [r for r in rollouts if r["attributes"]["rl.env"] == "arithmetic"
                 and r["attributes"].get("rl.stop_reason") == "done"]
    step = one(kids(sandboxed[0], "env.step"), "env.step")
    scored = one(kids(one(kids(step, "EnvWorker.step"), "EnvWorker.step"), "RewardWorker.score_messages"), "reward")
    assert node(scored) == "worker1"
    for name in ("update", "weight_sync"):
        assert sorted(s["attributes"]["rl.step"] for s in spans if s["name"] == name and node(s) == "head") == [1, 2]

    return _screenshot(phoenix, project, root["context"]["trace_id"])


def _screenshot(phoenix: str, project: str, trace_id: str) -> Path:
    """The agent rollout's trace as Phoenix's UI shows it, in Chromium; saved into the test report."""
    import httpx
    from playwright.sync_api import sync_playwright
    from test_docs_site import CHROMIUM, SCREENS

    assert CHROMIUM, "chromium is not installed: `make test` installs it (apt-get install chromium)"
    projects = httpx.get(f"{phoenix}/v1/projects", timeout=30).json()["data"]
    project_id = next(p["id"] for p in projects if p["name"] == project)
    path = SCREENS.parent / "trace-agent-rollout.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{phoenix}/projects/{project_id}/traces/{trace_id}")
        page.get_by_text("EngineActor.generate").first.wait_for(timeout=60_000)
        page.screenshot(path=str(path))
        browser.close()
    return path
