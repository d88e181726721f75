"""The Ray placement's cost: the same GRPO steps local vs on Ray, and rollout throughput with 1 vs 2 replicas.

    local      python -m trainer (one process: rank 0, its vLLM server, envs in its event loop)
    ray        the same config with placement.backend=ray: a trainer-rank actor, an inference-replica actor owning
               the vLLM server, env workers; every generate, env call and weight sync crosses an actor boundary
    replicas   placement.inference_replicas=1 vs 2: generated tokens per second of generation time

Each run is its own ``python -m trainer`` with the same seed; times are the mean ``time/step_s`` over the steps after
the first (which pays warm-up). Target: Ray's step time within 10% of local's. On a 2-core machine two replicas
share the same cores, so the replica ratio shows the routing's cost more than a scale-out gain.

    python benchmarks/ray_overhead.py [--steps 4] [--prompts-per-step 4] [--group-size 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(out: Path, args: argparse.Namespace, *overrides: str) -> dict[str, float]:
    """One training run; its mean step time and generation throughput (steps after the first)."""
    command = [sys.executable, "-m", "trainer", f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
               f"generator.prompts_per_step={args.prompts_per_step}", f"generator.samples_per_prompt={args.group_size}",
               f"generator.max_tokens={args.max_tokens}", "trainer.eval_tasks=0", "trainer.warmup_steps=0",
               "trainer.save_every=10000", "logging.progress=false", "logging.tensorboard=false",
               "inference.kv_cache_gib=1", *overrides]
    t0 = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed: {' '.join(overrides)}\n{result.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r and r["step"] > 1]
    return {"wall_s": wall, "step_s": statistics.mean(r["time/step_s"] for r in steps),
            "generate_s": statistics.mean(r["time/generate_s"] for r in steps),
            "tokens_per_s": sum(r["rollout/model_tokens"] for r in steps) / sum(r["time/generate_s"] for r in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    runs = {"local": (), "ray, 1 replica": ("placement.backend=ray",),
            "ray, 2 replicas": ("placement.backend=ray", "placement.inference_replicas=2", "placement.env_workers=2")}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(runs.items()):
            results[name] = run(Path(tmp) / str(i), args, *overrides)
            r = results[name]
            print(f"{name:16s} step {r['step_s']:6.2f} s  generate {r['generate_s']:6.2f} s  "
                  f"{r['tokens_per_s']:7.1f} tokens/s  (run {r['wall_s']:.0f} s with start-up)", flush=True)
    local, one, two = results["local"], results["ray, 1 replica"], results["ray, 2 replicas"]
    print(f"\nRay overhead per step: {one['step_s'] / local['step_s']:.3f}x local "
          f"({(one['step_s'] / local['step_s'] - 1) * 100:+.1f}%; target <= +10%)")
    print(f"rollout throughput, 2 replicas vs 1: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
