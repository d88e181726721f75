"""The Ray placement on a real local Ray cluster (`ray start --head`): trainer ranks, inference replicas and env
workers as actors.

- 2 trainer ranks + 2 HF replicas + 2 env workers: the same rollouts (seeded requests), and the same update on
  them, as the local one-process run;
- 2 vLLM replicas + 2 env workers, one worker and one replica killed while they serve step 1: both steps complete,
  the worker's rollouts are counted failed, the replica's requests go to the other one, both are replaced;
- after each run no actor of it, no vLLM server it started, is left;
- ``weight_sync.transport=ray``: a vLLM server's workers take pushed weights from the cluster's object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from weights import model_tensors, perturbed_weights

import envkit
from generators.engines.base import SamplingParams
from generators.engines.managed import ServerOptions
from generators.engines.transports.buckets import plan_buckets
from generators.engines.vllm import VLLMEngine
from trainer.backends.hf_export import write_hf_checkpoint

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")
TINY = ["trainer.steps=2", "trainer.eval_tasks=0", "logging.progress=false", "generator.prompts_per_step=2",
        "generator.samples_per_prompt=4", "generator.max_tokens=16", "trainer.micro_batch_tokens=2048",
        "trainer.warmup_steps=0"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A one-machine Ray cluster of 8 logical CPUs, as `ray start --head` on a node; stopped after the module."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        # Ray 2.59+ turns token auth on for clusters ray.init() starts, not (before 2.61) for `ray start` ones, so
        # clients and this cluster would disagree; a loopback test cluster needs none.
        env.setenv("RAY_AUTH_MODE", "disabled")
        # The other pytest worker's training runs share this machine's memory; Ray's monitor would count them and
        # kill this cluster's actors at 95% in use.
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        # Its workers (env workers included) import the test modules' envs, as the runs' trainer processes do.
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
        started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=8",
                                  "--include-dashboard=false", "--disable-usage-stats"], capture_output=True, text=True)
        assert started.returncode == 0, started.stdout + started.stderr
        ray.init(address=address)
        try:
            yield address
        finally:
            ray.shutdown()
            subprocess.run([RAY, "stop", "--force"], capture_output=True)


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "reward/mean" in row}


def _final_rollouts(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda t: (t["group_id"], t["sample_index"]))


def _vllm_servers() -> set[int]:
    """vLLM servers started by a Ray actor, or by a process that is gone: not those of another test's live run."""
    from generators.engines.server import OWNER_ENV

    found = set()
    for process in psutil.process_iter(["cmdline", "environ"]):
        if "vllm.entrypoints.openai.api_server" not in " ".join(process.info["cmdline"] or ()):
            continue
        owner = (process.info["environ"] or {}).get(OWNER_ENV)
        if owner is None:  # not a managed server
            continue
        try:
            mine = " ".join(psutil.Process(int(owner)).cmdline()).startswith("ray::")
        except psutil.NoSuchProcess:
            mine = True
        if mine:
            found.add(process.pid)
    return found


def _run_actors(namespace: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def _start(out: Path, address: str, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "trainer", "placement.backend=ray", f"placement.address={address}",
                             f"trainer.output_dir={out}", *overrides], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _kill_when_busy(process: subprocess.Popen[str], namespace: str, name: str, busy: Callable[[Any], bool]) -> None:
    """Kill the run's actor ``name`` as soon as ``busy(actor)`` says it has work (the run must still be going)."""
    import ray

    deadline = time.monotonic() + 600
    while True:
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"{name} never got work"
        try:
            actor = ray.get_actor(name, namespace=namespace)
            if busy(actor):
                break
        except (ValueError, ray.exceptions.RayError):
            pass  # not created yet, or still starting
        time.sleep(0.2)
    ray.kill(actor)


def _run_through_kills(process: subprocess.Popen[str], out: Path,
                       kills: list[tuple[str, Callable[[Any], bool]]]) -> tuple[str, dict[int, dict]]:
    """Kill each (actor name, busy) of the run as soon as it is busy, then let the run finish; its output and
    metrics. Both steps must have run, and an env worker's open rollouts were counted failed, not fatal: the run
    said so once for each step that had failures, with their errors."""
    try:
        for name, busy in kills:
            _kill_when_busy(process, f"envkit-{process.pid}", name, busy)
        output = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
    metrics = _metrics(out)
    assert sorted(metrics) == [1, 2], output[-4000:]
    failed = {step: int(m["rollout/failed"]) for step, m in metrics.items() if m["rollout/failed"]}
    assert failed, metrics
    warned = dict(re.findall(r"step (\d+): (\d+) of \d+ rollouts failed and were not trained on; first errors: \S",
                             output))
    assert {int(s): int(n) for s, n in warned.items()} == failed, output[-4000:]
    return output, metrics


def _finish(process: subprocess.Popen[str], timeout: float = 900) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"the run did not end within {timeout:.0f} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def test_two_ranks_two_replicas_and_an_env_pool_train_as_the_local_run_does(cluster, tmp_path):
    """Seeded HF replicas sample the same tokens whichever replica serves a request, so the Ray run's batches are
    the local run's, and its updates (fp32: two ranks' bf16 rounding would drift step 2's policy) match the local
    ones. The replicas sample in fp32 too: on a CPU with native bf16 they would compute in it, where the last bit in
    which the two runs' updates differ decides a rounding, and step 2 sampled other tokens. The loss is a sum of
    near-cancelling advantage-weighted ratios, so it is compared absolutely."""
    common = ["inference.engine=hf", "inference.dtype=float32", "generator.seed=7", "trainer.dtype=fp32", *TINY]
    local = tmp_path / "local"
    # One torch thread, as Ray gives a 1-CPU replica actor: the same sampling logits, bit for bit, whatever the cores.
    result = subprocess.run([sys.executable, "-m", "trainer", *common, f"trainer.output_dir={local}"], cwd=REPO,
                            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]

    before = _vllm_servers()
    on_ray = tmp_path / "ray"
    process = _start(on_ray, cluster, *common, "placement.trainer_ranks=2", "placement.inference_replicas=2",
                     "placement.env_workers=2")
    _finish(process)

    expected, got = _metrics(local), _metrics(on_ray)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step]["inference/replicas"] == 2 and got[step]["envs/workers"] == 2
        assert got[step]["rollout/failed"] == 0 and got[step]["weights/from_memory"] == 1
        assert got[step]["reward/mean"] == expected[step]["reward/mean"]
        assert got[step]["rollout/model_tokens"] == expected[step]["rollout/model_tokens"]
    # both replicas served: new rollouts go to the least-loaded one
    assert got[1]["inference/replica0/requests"] > 0 and got[1]["inference/replica1/requests"] > 0
    assert [t["response_ids"] for t in _final_rollouts(on_ray)] == [t["response_ids"] for t in _final_rollouts(local)]
    for step in (1, 2):
        mine, theirs = got[step], expected[step]
        assert math.isclose(mine["train/grad_norm"], theirs["train/grad_norm"], rel_tol=1e-3), (step, mine, theirs)
        assert math.isclose(mine["train/loss"], theirs["train/loss"], abs_tol=1e-3), (step, mine, theirs)

    assert _run_actors(f"envkit-{process.pid}") == []
    assert _vllm_servers() <= before


@pytest.mark.exclusive  # two vLLM replicas, a replacement and a trainer rank at once: the kernel OOM-killed one
def test_a_replica_and_an_env_worker_killed_mid_step_do_not_fail_the_step(cluster, tmp_path):
    import ray

    before = _vllm_servers()
    out = tmp_path / "run"
    # 8 samples per prompt, so the run updates the policy whatever the kill takes: step 2 keeps every rollout, and
    # all 4 of its groups are all-equal (no update) with p ~ (0.3^8 + 0.7^8)^4 ~ 1e-5.
    process = _start(out, cluster, "inference.engine=vllm", "inference.kv_cache_gib=1", *TINY,
                     "generator.prompts_per_step=4", "generator.samples_per_prompt=8", "generator.max_tokens=48",
                     "placement.inference_replicas=2", "placement.env_workers=2")
    namespace = f"envkit-{process.pid}"
    output, metrics = _run_through_kills(process, out, [
        (name, lambda actor, method=method: ray.get(getattr(actor, method).remote(), timeout=10) > 0)
        for name, method in (("env-worker-0", "episodes"), ("replica-0", "requests_in_flight"))])
    assert metrics[2]["envs/worker_restarts"] == 1 and metrics[2]["envs/workers"] == 2
    assert metrics[2]["inference/replicas_lost"] == 1
    assert metrics[1]["weights/from_memory"] == metrics[2]["weights/from_memory"] == 1  # through the object store
    assert "inference replica 0 died under a request" in output and "env worker env-worker-0 died" in output
    assert any(m.get("train/grad_norm", 0) > 0 for m in metrics.values())  # the run trained

    assert _run_actors(namespace) == []
    assert _vllm_servers() <= before


def test_a_trainer_rank_that_dies_ends_the_run_cleanly_and_resume_continues_it(cluster, tmp_path):
    import ray

    out = tmp_path / "run"
    common = ["inference.engine=hf", "generator.seed=7", *TINY, "trainer.save_every=1", "placement.trainer_ranks=2"]
    process = _start(out, cluster, *common)
    namespace = f"envkit-{process.pid}"
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "step-000001").is_dir():
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "no step-1 checkpoint within 600 s"
        time.sleep(0.2)
    ray.kill(ray.get_actor("trainer-rank-1", namespace=namespace))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 1, output[-4000:]
    assert "run failed: trainer rank 1 died" in output and "trainer.resume=latest" in output
    assert _run_actors(namespace) == []  # rank 0 (blocked in a collective) and its replica went with it

    resumed = _start(out, cluster, *common, "trainer.resume=latest")
    _finish(resumed)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r].count(2) == 1  # step 2 ran once: after the resume
    assert _run_actors(f"envkit-{resumed.pid}") == []


def test_sandboxed_envs_run_in_env_workers_and_a_dead_worker_leaves_no_container(cluster, tmp_path, docker_client,
                                                                               arithmetic_image):
    """Each env worker borrows containers from its own warm pool. A worker killed mid-step fails only its rollouts;
    the containers its pool held are removed (the worker cannot: it was SIGKILLed), and so are the others' at the
    end."""
    import ray

    from sandboxes.docker import SANDBOX_LABEL

    def sandboxes() -> set[str]:
        return {c.id for c in docker_client.containers.list(all=True, sparse=True, filters={"label": SANDBOX_LABEL})}

    before = sandboxes()
    out = tmp_path / "run"
    process = _start(out, cluster, "inference.engine=hf", *TINY, "env.sandbox=docker",
                     "placement.env_workers=2")
    namespace = f"envkit-{process.pid}"
    def busy(worker: Any) -> bool:  # with containers in its pool
        return ray.get(worker.episodes.remote(), timeout=10) > 0 and bool(sandboxes() - before)

    _, metrics = _run_through_kills(process, out, [("env-worker-0", busy)])
    assert metrics[2]["envs/worker_restarts"] == 1
    assert _run_actors(namespace) == []
    assert sandboxes() <= before


def test_a_run_on_ray_scores_every_env_workers_rollouts_with_one_reward_model_actor(cluster, tmp_path):
    """``python -m trainer placement.backend=ray`` with the bundled reward head as half of each rollout's reward
    (``rubric_parts:graded``): the two env workers' episodes go to one named reward actor in the run's namespace,
    every step trains on the mixed reward, and the actor goes with the run."""
    import ray

    out = tmp_path / "run"
    process = _start(out, cluster, "inference.engine=hf", *TINY, "placement.env_workers=2",
                     "+env.kwargs.rubric=rubric_parts:graded")
    namespace = f"envkit-{process.pid}"
    deadline = time.monotonic() + 600
    try:
        while not (rewards := [a for a in _run_actors(namespace) if a.startswith("envkit-reward-")]):
            assert process.poll() is None, process.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no reward actor within 600 s"
            time.sleep(0.2)
        worker = ray.get_actor(rewards[0], namespace=namespace)
        while not ray.get(worker.batches.remote(), timeout=30):
            assert process.poll() is None, process.communicate()[0][-4000:]
            time.sleep(0.2)
        _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert len(rewards) == 1
    metrics = _metrics(out)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["envs/workers"] == 2 and m["rollout/failed"] == 0
        assert 0 < m["rubric/reward_model"] < 1 and m["train/grad_norm"] > 0, m
        assert m["reward/mean"] == pytest.approx(m["rubric/weighted_sum"])
    assert _run_actors(namespace) == []


def _store_objects() -> int:
    """Objects in the cluster's object store now."""
    from ray._private.internal_api import memory_summary

    return int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", memory_summary(stats_only=True)).group(1))


def _store_empties(within_s: float = 10.0) -> bool:
    """Whether the object store is empty within ``within_s``: a released object goes once its borrowers have told
    its owner (0.01-0.3 s here), a pinned one never."""
    deadline = time.monotonic() + within_s
    while _store_objects() and time.monotonic() < deadline:
        time.sleep(0.1)
    return _store_objects() == 0


async def test_weights_through_the_object_store_serve_what_a_reload_from_disk_serves(cluster, bundled_model,
                                                                                     chat_tokenizer, tmp_path):
    """The ray transport: the server's workers join the cluster and take pushed weights from its object store,
    through a board actor holding the object's ref. The next greedy request gets the tokens and logprobs a reload of
    the same weights from disk gets. Once the workers have loaded, the store holds nothing (a ref pickled out of band
    would have pinned every sync's copy there); the board ends with the engine."""
    import ray

    namespace = ray.get_runtime_context().namespace  # the engine's, so its board's
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = chat_tokenizer.prompt_ids([envkit.user("Name a color.")])
    perturbed, original_weights = perturbed_weights(bundled_model), model_tensors(bundled_model)
    write_hf_checkpoint(perturbed, bundled_model, tmp_path / "perturbed")
    engine = VLLMEngine(bundled_model, ServerOptions(served_model_name="policy", log_path=tmp_path / "vllm.log"),
                        kv_cache_gib=1, weight_transport="ray")
    await engine.start()
    try:
        original = await engine.generate(prompt, greedy)
        await engine.load_weights(tmp_path / "perturbed", version=1)
        from_disk = await engine.generate(prompt, greedy)
        assert from_disk.token_ids != original.token_ids
        await engine.push_weights(perturbed, version=2)
        from_store = await engine.generate(prompt, greedy)
        assert from_store.weight_version == 2 and await engine.server_weight_version() == "2"
        assert (from_store.token_ids, from_store.logprobs) == (from_disk.token_ids, from_disk.logprobs)
        transport = engine._transports["ray"]
        assert _store_empties() and _run_actors(namespace) == [transport._board_name]

        # a staged sync's copy is in the store until the workers load it
        transport.stage(original_weights, plan_buckets(original_weights, cast=engine._wire_dtype), 99)
        assert _store_objects() == 1
        await engine.push_weights(original_weights, version=3)
        restored = await engine.generate(prompt, greedy)
        assert (restored.token_ids, restored.logprobs) == (original.token_ids, original.logprobs)
        assert _store_empties()
    finally:
        await engine.stop()
    assert _run_actors(namespace) == []


async def test_agent_envs_play_their_episodes_in_env_workers(cluster, vllm_engine, chat_tokenizer):
    """On env workers an agent env's agent runs, and is graded, in the worker (each episode's reward is the pid that
    played and graded it), and reaches the policy through the generator's gateway: its calls are captured."""
    from envkit.ref import EnvRef
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    pool = EnvWorkerPool(2, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(max_tokens=8, samples_per_prompt=2))
        trajs = await generator.generate(lambda: WorkerEnv(pool, EnvRef("agent_envs:where")),
                                         tasks=[{"id": "q", "question": "What is 2 + 3?"}] * 2)
        assert [t.stop_reason for t in trajs] == ["done"] * 4, [t.error for t in trajs]
        pids = {int(t.reward) for t in trajs}
        assert os.getpid() not in pids
        assert all(psutil.Process(pid).cmdline()[0].startswith("ray::EnvWorker") for pid in pids)
    finally:
        await pool.close()
    assert all(t.num_turns == 1 and sum(t.loss_mask) > 0 for t in trajs)


async def test_env_workers_share_one_reward_model_actor_and_see_the_runs_judge(cluster, vllm_engine, chat_tokenizer,
                                                                               monkeypatch):
    """A RewardModel in the rubric of envs on two env workers is one Ray actor: every episode's row goes to it, in
    batches the workers share. The judge the driver published reaches the envs in the workers."""
    import ray
    from rubric_parts import JUDGE_SEEN, REWARD_MODEL

    from envkit.judges import JUDGE_URL_VAR
    from envkit.ref import EnvRef
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    monkeypatch.setenv(JUDGE_URL_VAR, JUDGE_SEEN)
    pool = EnvWorkerPool(2, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(max_tokens=8, samples_per_prompt=4))
        ref = EnvRef("arithmetic", kwargs={"rubric": "rubric_parts:reward_model"})
        trajs = await generator.generate(lambda: WorkerEnv(pool, ref), tasks=[
            {"id": "a", "question": "What is 2 + 3?", "answer": 5}, {"id": "b", "question": "What is 4 + 4?",
                                                                     "answer": 8}])
        assert [t.stop_reason for t in trajs] == ["done"] * 8, [t.error for t in trajs]
        assert all(0 < t.scores["reward_model"] < 1 and t.scores["published"] == 1.0 for t in trajs)
        batches = await ray.get_actor(REWARD_MODEL.actor_name).batches.remote()
        assert sum(batches) == 8 and len(batches) < 8, batches  # every episode, in shared forward passes
    finally:
        await pool.close()


async def test_an_agent_process_in_an_env_worker_dies_with_its_cancelled_rollout(cluster, vllm_engine, chat_tokenizer,
                                                                                tmp_path):
    """A Command agent that hangs, in an env worker: the rollout times out, and the cancellation reaches the worker,
    which kills the agent's process group (the agent and the child it started)."""
    from envkit.ref import EnvRef
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    pids_file = tmp_path / "pids"
    pool = EnvWorkerPool(1, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(timeout_s=10))
        [t] = await generator.generate(lambda: WorkerEnv(pool, EnvRef("agent_envs:hang")),
                                       tasks=[{"id": "h", "question": "hang", "pids": str(pids_file)}])
        assert t.stop_reason == "timeout", t.error
        processes = []
        for pid in map(int, pids_file.read_text().split()):
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(pid))
        # the cancellation crosses to the worker asynchronously: give it a moment
        _, alive = await asyncio.to_thread(psutil.wait_procs, processes, timeout=30)
        assert alive == []
    finally:
        await pool.close()
