"""Async vs sync training, and in-memory vs disk weight sync.

    weight sync  the bundled model's weights into a running vLLM server, ``--sync-rounds`` times each way:
                 disk    write the HF checkpoint (safetensors) + the server reloads it (the trainer's disk path)
                 shared  ``push_weights`` through shared memory: the trainer casts the weights into /dev/shm while
                         the server generates, the worker maps and loads them (the default for a local CPU server)
                 group   ``push_weights`` over the process group: a gloo broadcast to the server's worker (the
                         transport for a server elsewhere, and NCCL's on a GPU)
                 (gathering the weights out of FSDP comes first either way and is not counted). Syncs are
                 ``--sync-gap`` s apart, as a training step spaces them: after each call vLLM's worker busy-polls
                 its message queue for a second (``SpinCondition``, busy_loop_s=1) on its core, so back-to-back
                 syncs on a 2-core box time that polling (about 1 s for shared memory and disk alike), not the sync
    training     ``python -m trainer`` for ``--steps`` GRPO steps, trainer.mode=sync vs trainer.mode=async
                 (max_staleness 1), same seed and config: wall time of the steps and both reward curves (PNG)
    model        what the overlap gives where generation and training do not share cores (GPUs, separate nodes):
                 a sync step takes generate + train + sync, an async one max(generate, train + sync), from the
                 sync run's own phase times. On a 2-core machine the two phases compete for the same cores, so
                 the measured async gain here is a floor, not the gain on separate hardware.

    python benchmarks/async_speedup.py [--steps 8] [--sync-rounds 5] [--sync-gap 1.5] [--out runs/bench/async_speedup]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


async def weight_sync_times(model: Path, tensors: dict[str, Any], rounds: int, gap_s: float
                            ) -> dict[str, list[float]]:
    """Seconds per weight sync of ``tensors`` into one vLLM server, ``gap_s`` apart: from disk, and from memory by
    each transport, in turn."""
    from generators.engines.vllm import VLLMEngine
    from trainer.backends.hf_export import write_hf_checkpoint

    times: dict[str, list[float]] = {"disk": [], "shared": [], "group": []}
    with tempfile.TemporaryDirectory() as tmp:
        async with VLLMEngine(model, kv_cache_gib=1) as engine:
            version = 0
            for transport in ("shared", "group"):  # each set up once, as a run's first sync does
                engine.weight_transport = transport
                version += 1
                await engine.push_weights(tensors, version)
            for _ in range(rounds):
                version += 1
                await asyncio.sleep(gap_s)
                started = time.perf_counter()
                path = Path(tmp) / f"v{version}"
                write_hf_checkpoint(tensors, model, path)
                await engine.load_weights(path, version)
                times["disk"].append(time.perf_counter() - started)
                shutil.rmtree(path)
                for transport in ("shared", "group"):
                    engine.weight_transport = transport
                    version += 1
                    await asyncio.sleep(gap_s)
                    started = time.perf_counter()
                    await engine.push_weights(tensors, version)
                    times[transport].append(time.perf_counter() - started)
    return times


def train(out: Path, args: argparse.Namespace, mode: str) -> dict[str, object]:
    """One training run: its wall time, the steps' own time, and per-step metrics."""
    command = [sys.executable, "-m", "trainer", f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
               f"trainer.mode={mode}", "trainer.max_staleness=1", f"generator.prompts_per_step={args.prompts_per_step}",
               f"generator.samples_per_prompt={args.group_size}", f"generator.max_tokens={args.max_tokens}",
               "trainer.eval_tasks=0", "trainer.save_every=10000", "logging.progress=false",
               "logging.tensorboard=false", "inference.kv_cache_gib=1"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{mode} run failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    return {"wall_s": wall, "steps_s": sum(r["time/step_s"] for r in steps), "steps": steps}


def plot(runs: dict[str, dict[str, object]], path: Path) -> None:
    """Both runs' training reward per step, and against wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, run in runs.items():
        steps = run["steps"]
        assert isinstance(steps, list)
        rewards = [r["reward/mean"] for r in steps]
        elapsed = [sum(r["time/step_s"] for r in steps[: i + 1]) for i in range(len(steps))]
        by_step.plot([r["step"] for r in steps], rewards, "o-", label=mode)
        by_time.plot(elapsed, rewards, "o-", label=mode)
    by_step.set(xlabel="step", ylabel="train reward (mean)", title="reward per step")
    by_time.set(xlabel="seconds of training steps", title="reward against time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sync-rounds", type=int, default=5)
    parser.add_argument("--sync-gap", type=float, default=1.5, help="seconds between two syncs (default 1.5)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "async_speedup")
    parser.add_argument("--skip-training", action="store_true", help="measure the weight sync only")
    args = parser.parse_args()

    from safetensors.torch import load_file

    from generators.models import resolve_model

    model = Path(resolve_model(None))
    tensors = {n: t for f in sorted(model.glob("*.safetensors")) for n, t in load_file(f).items()}
    times = asyncio.run(weight_sync_times(model, tensors, args.sync_rounds, args.sync_gap))
    disk, memory = statistics.median(times["disk"]), statistics.median(times["shared"])
    print(f"weight sync of the bundled model, {args.sync_rounds} rounds each (p50):")
    for key, label in (("disk", "disk          (safetensors + reload)"),
                       ("shared", "memory/shared (/dev/shm + load)     "),
                       ("group", "memory/group  (gloo broadcast + load)")):
        print(f"  {label}  {statistics.median(times[key]):.3f} s   ({' '.join(f'{t:.3f}' for t in times[key])})")
    print(f"  shared memory is {disk / memory:.1f}x disk and {statistics.median(times['group']) / memory:.1f}x the "
          f"group; target <= 0.3 s: {'met' if memory <= 0.3 else 'missed'}")
    if args.skip_training:
        return

    shutil.rmtree(args.out, ignore_errors=True)
    runs = {mode: train(args.out / mode, args, mode) for mode in ("sync", "async")}
    sync_steps = runs["sync"]["steps"]
    assert isinstance(sync_steps, list)
    phase = {key: statistics.mean(r[f"time/{key}_s"] for r in sync_steps[1:] or sync_steps)
             for key in ("generate", "train", "sync")}
    print(f"\ntraining, {args.steps} steps of {args.prompts_per_step} prompts x {args.group_size} samples:")
    for mode, run in runs.items():
        steps = run["steps"]
        assert isinstance(steps, list)
        rewards = " ".join(f"{r['reward/mean']:.2f}" for r in steps)
        stale = sum(r.get("rollout/stale_dropped", 0) for r in steps)
        print(f"  {mode:5}  steps {run['steps_s']:7.1f} s  (process {run['wall_s']:6.1f} s)  stale dropped {stale:3d}"
              f"  reward per step: {rewards}")
    measured = float(runs["sync"]["steps_s"]) / float(runs["async"]["steps_s"])  # type: ignore[arg-type]
    serial = phase["generate"] + phase["train"] + phase["sync"]
    overlapped = max(phase["generate"], phase["train"] + phase["sync"])
    print(f"  async / sync speedup on this machine (2 phases sharing its cores): {measured:.2f}x")
    print(f"\nmodel (sync run's phases per step: generate {phase['generate']:.1f} s, train {phase['train']:.1f} s, "
          f"sync {phase['sync']:.2f} s):")
    print(f"  where generation and training have hardware of their own, an async step takes max(generate, train + "
          f"sync) = {overlapped:.1f} s against {serial:.1f} s: {serial / overlapped:.2f}x")
    png = args.out / "async_speedup.png"
    plot(runs, png)
    print(f"\nreward curves: {png}")


if __name__ == "__main__":
    main()
