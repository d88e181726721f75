"""The Ray placement on a real local Ray cluster (`ray start --head`, tests/conftest.py): trainer ranks, inference
replicas and env workers as actors, in two runs of `python -m trainer placement.backend=ray` on the tiny model
(tests/tiny.py: what is checked is where things run and what survives a kill, not what the model knows).

- 2 trainer ranks + 2 seeded HF replicas + 2 env workers train as the local one-process run does, step for step;
  trainer rank 1 killed after step 2 ends the run cleanly, and `trainer.resume=latest` trains the rest of it as the
  local run did;
- ``weight_sync.transport=ray``: a vLLM server's workers take pushed weights from the cluster's object store.

Env workers playing agent envs and sharing a reward model on the session's vLLM server: tests/test_ray_env_workers.py.
Kills of a replica and of a sandboxed env worker, on a multi-node cluster of containers: tests/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trainer import _metrics
from tiny import env_with_tests, on_tiny_model, tiny_model_dir
from weights import model_tensors, perturbed_weights

import envkit
from generators.engines.base import SamplingParams
from generators.engines.managed import ServerOptions
from generators.engines.transports.buckets import plan_buckets
from generators.engines.vllm import VLLMEngine
from generators.engines.weight_sync import WeightSyncConfig
from trainer.backends.hf_export import write_hf_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

REPO = Path(__file__).resolve().parent.parent
TINY = ["trainer.eval_tasks=0", "logging.progress=false", "generator.prompts_per_step=2",
        "generator.samples_per_prompt=4", "generator.max_tokens=16", "trainer.micro_batch_tokens=2048",
        "trainer.warmup_steps=0", "trainer.lr=1e-3"]


def _run_actors(namespace: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def _start(out: Path, address: str, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "trainer", "placement.backend=ray", f"placement.address={address}",
                             f"trainer.output_dir={out}", *overrides], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env_with_tests())


def _finish(process: subprocess.Popen[str], timeout: float = 900) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"the run did not end within {timeout:.0f} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def test_ranks_replicas_and_env_workers_train_as_the_local_run_does_through_a_rank_kill_and_a_resume(cluster,
                                                                                                     tmp_path):
    """Seeded HF replicas sample the same tokens whichever replica serves a request, so the Ray run's batches are
    the local run's, and its updates (fp32: two ranks' bf16 rounding would drift a later step's policy) match the
    local ones, before the kill and after the resume alike. The replicas sample in fp32 too: on a CPU with native
    bf16 they would compute in it, where the last bit in which the two runs' updates differ decides a rounding. The
    loss is a sum of near-cancelling advantage-weighted ratios, so it is compared absolutely."""
    import ray

    common = [*on_tiny_model(), "+env.kwargs.rubric=tiny:graded", "inference.dtype=float32", "trainer.dtype=fp32",
              "trainer.steps=4", "trainer.save_every=1", *TINY]
    local = tmp_path / "local"
    # One torch thread, as Ray gives a 1-CPU replica actor: the same sampling logits, bit for bit, whatever the cores.
    result = subprocess.run([sys.executable, "-m", "trainer", *common, f"trainer.output_dir={local}"], cwd=REPO,
                            capture_output=True, text=True, timeout=900,
                            env={**env_with_tests(), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]

    out = tmp_path / "ray"
    placed = [*common, "placement.trainer_ranks=2", "placement.inference_replicas=2", "placement.env_workers=2"]
    process = _start(out, cluster, *placed)
    namespace = f"envkit-{process.pid}"
    deadline = time.monotonic() + 600  # a hang guard, not a speed check
    while not (out / "checkpoints" / "step-000002").is_dir():
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "no step-2 checkpoint within 600 s"
        time.sleep(0.2)
    ray.kill(ray.get_actor("trainer-rank-1", namespace=namespace))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 1, output[-4000:]
    assert "run failed: trainer rank 1 died" in output and "trainer.resume=latest" in output
    assert _run_actors(namespace) == []  # rank 0 (blocked in a collective) and its replicas went with it
    killed_at = max(_metrics(out))
    assert 2 <= killed_at < 4, killed_at

    resumed = _start(out, cluster, *placed, "trainer.resume=latest")
    _finish(resumed)
    expected, got = _metrics(local), _metrics(out)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in sorted(got):
        mine, theirs = got[step], expected[step]
        assert mine["inference/replicas"] == 2 and mine["envs/workers"] == 2, mine
        assert mine["rollout/failed"] == 0 and mine["weights/from_memory"] == 1
        assert mine["reward/mean"] == theirs["reward/mean"], (step, mine, theirs)
        assert mine["rollout/model_tokens"] == theirs["rollout/model_tokens"], step
        assert mine["train/grad_norm"] > 0 and math.isclose(mine["train/grad_norm"], theirs["train/grad_norm"],
                                                            rel_tol=1e-3), (step, mine, theirs)
        assert math.isclose(mine["train/loss"], theirs["train/loss"], abs_tol=1e-3), (step, mine, theirs)
    # both replicas served: new rollouts go to the least-loaded one
    assert got[1]["inference/replica0/requests"] > 0 and got[1]["inference/replica1/requests"] > 0
    assert _run_actors(f"envkit-{resumed.pid}") == []


async def test_ray_ranks_train_against_a_server_given_by_url(cluster, tiny_vllm, tiny_url, tmp_path):
    """``placement.backend=ray`` with ``inference.url``: the trainer is a Ray rank actor, and rank 0 attaches to the
    server at the URL (here the session's tiny vLLM server) as a local run does, starting no replica of its own:
    its rollouts come from that server and each step's weights reach it."""
    out = tmp_path / "attached"
    overrides = [f"model.path={tiny_model_dir()}", f"inference.url={tiny_url}", "+env.kwargs.rubric=tiny:graded",
                 "trainer.steps=2", *TINY]
    output = await asyncio.to_thread(lambda: _finish(_start(out, cluster, *overrides)))
    steps = _metrics(out)
    assert all(steps[s]["train/grad_norm"] > 0 and steps[s]["rollout/failed"] == 0 for s in (1, 2)), steps
    assert "inference/replicas" not in steps[2]  # no replica of its own
    assert await tiny_vllm.server_weight_version() == "2", output[-2000:]  # the server serves what step 2 trained


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


async def test_weights_through_the_object_store_serve_what_a_reload_from_disk_serves(cluster, chat_tokenizer,
                                                                                     tmp_path):
    """The ray transport: the server's workers join the cluster and take pushed weights from its object store,
    through a board actor holding the object's ref. The next greedy request gets the tokens and logprobs a reload of
    the same weights from disk gets. Once the workers have loaded, the store holds nothing (a ref pickled out of band
    would have pinned every sync's copy there); the board ends with the engine."""
    import ray

    namespace = ray.get_runtime_context().namespace  # the engine's, so its board's
    model = tiny_model_dir()  # the bundled model's tokenizer; what it generates needs no knowledge
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = chat_tokenizer.prompt_ids([envkit.user("Name a color.")])
    perturbed, original_weights = perturbed_weights(model), model_tensors(model)
    write_hf_checkpoint(perturbed, model, tmp_path / "perturbed")
    engine = VLLMEngine(model, ServerOptions(served_model_name="policy", log_path=tmp_path / "vllm.log"),
                        kv_cache_gib=1, weight_sync=WeightSyncConfig(transport="ray"))
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
