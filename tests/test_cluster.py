"""A multi-node Ray cluster of Docker containers on this machine (trainer/cluster.py): `python -m trainer.cluster up`,
two training steps placed across its nodes from this host's driver, and `down` leaving nothing of it (and everything
that is not its own).

The run: the trainer rank (and the capture gateway, in rank 0) on the head; the vLLM replica on worker1 with the
reward model's actor; two env workers on worker2 holding a Docker-sandboxed arithmetic env (its containers siblings
on the cluster's sandbox network) and an agent env whose openai-SDK agent calls the gateway on the head. Tiny model:
what is checked is where each part ran and that every rollout crossed the nodes it had to, not what it learned.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import env_with_tests, tiny_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.docker]

REPO = Path(__file__).resolve().parent.parent
NAME = "envkit-test-cluster"


def _cluster(*argv: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "trainer.cluster", *argv, "--name", NAME], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.hold_machine
def test_two_steps_on_three_container_nodes_place_each_role_where_it_was_pinned(docker_client, tmp_path):
    from sandboxes.docker import SANDBOX_LABEL
    from sandboxes.engine import BASE_IMAGE
    from trainer.cluster import CLUSTER_LABEL

    env = env_with_tests()
    # what `down` must leave: a container and a network named like the cluster's, not labelled its own
    decoy = docker_client.containers.create(BASE_IMAGE, ["true"], name=f"{NAME}-worker9")
    decoy_net = docker_client.networks.create(f"{NAME}-other", driver="bridge", internal=True)
    try:
        up = _cluster("up", "--shared", str(tmp_path), env=env)
        assert [line.split("\t")[0] for line in up.splitlines()[:3]] == [f"{NAME}-head", f"{NAME}-worker1",
                                                                          f"{NAME}-worker2"], up
        driver = dict(line.removeprefix("export ").split("=", 1) for line in _cluster("env", env=env).splitlines())
        out = tmp_path / "run"
        mixture = ('env.mixture=[{name: arithmetic, sandbox: docker, kwargs: {rubric: "rubric_parts:on_worker1"}},'
                   ' {name: "agent_envs:sums"}]')
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer", "placement.backend=ray", f"placement.address={driver['ENVKIT_CLUSTER']}",
             f"trainer.output_dir={out}", f"model.path={tiny_model_dir()}", "inference.engine=vllm",
             "inference.kv_cache_gib=1", "trainer.steps=2", "trainer.save_every=1", "trainer.eval_tasks=0",
             "logging.progress=false", "generator.prompts_per_step=2", "generator.samples_per_prompt=4",
             "generator.max_tokens=16", "trainer.micro_batch_tokens=2048", "trainer.warmup_steps=0",
             "placement.env_workers=2", mixture, "generator.gateway_host=0.0.0.0",
             "+placement.trainer_resources.head=1", "+placement.replica_resources.worker1=1",
             "+placement.env_worker_resources.worker2=1"],
            cwd=REPO, env={**env, **driver}, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sandboxes: set[str] = set()  # seen on the cluster's sandbox network while the run goes
        deadline = time.monotonic() + 900  # a hang guard, not a speed check
        while process.poll() is None and time.monotonic() < deadline:
            sandboxes |= {c.name for c in docker_client.containers.list(ignore_removed=True, filters={
                "label": SANDBOX_LABEL, "network": f"{NAME}-sandboxes"})}
            time.sleep(0.5)
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
        assert process.returncode == 0, output[-4000:]

        summary = json.loads((out / "summary.json").read_text())
        hosts = {name: where.split()[0] for name, where in summary["nodes"].items()}
        reward = [name for name in hosts if name.startswith("envkit-reward-")]
        assert hosts == {"trainer-rank-0": "head", "replica-0": "worker1", "env-worker-0": "worker2",
                         "env-worker-1": "worker2", reward[0]: "worker1"}, summary["nodes"]
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        for m in metrics:
            assert m["rollout/failed"] == 0 and m["env/arithmetic/stop/done"] == 4 and m["env/sums/stop/done"] == 4
            assert 0 < m["rubric/reward_model"] < 1  # scored by the actor on worker1
            assert m["weights/from_memory"] == 1  # the new weights crossed to worker1 through the object store
        assert sandboxes, "no sandbox container on the cluster's sandbox network"
        agents = [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]
        agents = [t for t in agents if t["env_name"] == "sums"]
        # each episode's two calls were captured by the gateway on the head, from an agent on worker2
        assert agents and all(t["num_turns"] == 2 and sum(t["loss_mask"]) > 0 for t in agents), agents[:1]
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) >= ["step-000001", "step-000002"]
    finally:
        removed = _cluster("down", env=env)
        left = docker_client.containers.list(all=True, ignore_removed=True,
                                             filters={"label": f"{CLUSTER_LABEL}={NAME}"})
        networks = [n.name for n in docker_client.networks.list(filters={"label": f"{CLUSTER_LABEL}={NAME}"})]
        still = f"{NAME}-worker9" in {c.name for c in docker_client.containers.list(all=True, ignore_removed=True)}
        decoy_kept = bool(docker_client.networks.list(names=[f"{NAME}-other"]))
        decoy.remove(force=True)
        decoy_net.remove()
    assert f"removed {NAME}-head" in removed and f"removed network {NAME}-sandboxes" in removed, removed
    assert left == [] and networks == [] and still and decoy_kept
    assert not sandboxes & {c.name for c in docker_client.containers.list(all=True, ignore_removed=True)}
