"""GRPO steps: this trainer vs TRL's GRPOTrainer, same model, prompts, group size, max tokens and steps, one run.

Both train the bundled SmolLM2-135M-Instruct on the same arithmetic prompts in the same order, GRPO with
group-normalized advantages, no KL, one optimizer step per generation round, constant LR. Ours generates with
vLLM (the default path) and trains with FSDP2; TRL generates with HF ``generate`` (its default path) and trains
with its Trainer. Both compute in the precision our ``auto`` picks for this machine: bf16 (TRL: bf16 autocast) on a
GPU or a CPU with native bfloat16, fp32 elsewhere. Zero-variance-group filtering is off on our side so both
train on every rollout. Per step it prints wall time, generated tokens/s and training tokens/s, then the medians'
ratios over the steps after ``--warmup`` (first steps pay one-time costs: our trainer's heap grows to its peak over
its first two updates, a step faulting its memory in, and both start their engines). Target: ours >= 3x faster
per step.

    python benchmarks/grpo_vs_trl.py [--steps 6] [--warmup 2] [--prompts-per-step 4] [--group-size 8]

Needs ``trl==1.16.0`` in the venv (``make install`` installs it, the trl extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from trl_peer import run_trl_grpo  # a sibling module in benchmarks/

import envkit
from generators.models import bundled_model_dir
from trainer.backends import train_dtype
from trainer.config import AlgorithmConfig, Config, EnvConfig, LoggingConfig, RolloutConfig, TrainerConfig
from trainer.loop import train
from trainer.sources import EnvStream


def step_prompts(steps: int, per_step: int, seed: int) -> tuple[list[list[dict]], list[int]]:
    """The chat prompts and answers our trainer uses for its first ``steps`` steps, in order."""
    stream = EnvStream(EnvConfig(name="arithmetic", kwargs={"level": 1}), "arithmetic")
    asyncio.run(stream.open(pool_size=1))
    env = envkit.SyncEnv(stream.make())
    prompts, answers = [], []
    for _ in range(steps):
        for task, _seed in stream.next_starts(per_step, seed):
            assert task is not None
            prompts.append([dict(m) for m in env.reset(task=task)[0]])
            answers.append(int(task["answer"]))
    env.close()
    return prompts, answers


def run_ours(args: argparse.Namespace, out: Path) -> list[dict]:
    cfg = Config(
        env=EnvConfig(name="arithmetic", kwargs={"level": 1}),
        algorithm=AlgorithmConfig(advantage="grpo", filter_zero_variance_groups=False, tis_cap=None),
        generator=RolloutConfig(prompts_per_step=args.prompts_per_step, samples_per_prompt=args.group_size,
                                max_tokens=args.max_tokens, max_turns=1, temperature=1.0),
        trainer=TrainerConfig(steps=args.steps, lr=args.lr, warmup_steps=0, eval_tasks=0, output_dir=str(out),
                              save_every=10_000, seed=args.seed),
        logging=LoggingConfig(tensorboard=False, progress=False),
    )
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"wall_s": r["time/step_s"], "generate_s": r["time/generate_s"], "gen_tokens": r["rollout/model_tokens"],
             "train_tokens": r["train/tokens"], "reward": r["reward/mean"],
             "detail": f"train {r['time/train_s']:5.2f} s, weight sync {r['time/sync_s']:4.2f} s"}
            for r in rows if "time/step_s" in r]


def run_trl(args: argparse.Namespace) -> list[dict]:
    prompts, answers = step_prompts(args.steps, args.prompts_per_step, args.seed)
    r = run_trl_grpo(str(bundled_model_dir()), prompts, answers, num_generations=args.group_size,
                     prompts_per_step=args.prompts_per_step, max_completion_length=args.max_tokens,
                     steps=args.steps, learning_rate=args.lr, temperature=1.0, seed=args.seed,
                     bf16=train_dtype("auto") == "bf16")
    return [{"wall_s": w, "generate_s": g, "gen_tokens": c, "train_tokens": t, "reward": m}
            for w, g, c, t, m in zip(r["step_wall_s"], r["generate_s"], r["completion_tokens"], r["train_tokens"],
                                     r["reward_mean"], strict=True)]


def summarize(name: str, steps: list[dict], warmup: int) -> dict[str, float]:
    """Medians over the steps after the first ``warmup``."""
    warm = steps[warmup:] or steps
    for i, s in enumerate(steps, 1):
        print(f"  {name} step {i}: {s['wall_s']:6.2f} s  (generate {s['generate_s']:5.2f} s)  "
              f"{s['gen_tokens']:5d} gen tok  {s['train_tokens']:6d} train tok  reward {s['reward']:.3f}"
              + (f"  ({s['detail']})" if "detail" in s else ""))
    return {
        "step_s": statistics.median(s["wall_s"] for s in warm),
        "gen_tok_s": statistics.median(s["gen_tokens"] / s["generate_s"] for s in warm),
        "train_tok_s": statistics.median(s["train_tokens"] / (s["wall_s"] - s["generate_s"]) for s in warm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        print("envkit trainer (vLLM generation, FSDP2 training):")
        ours = summarize("envkit", run_ours(args, Path(tmp) / "ours"), args.warmup)
    print("TRL GRPOTrainer (HF generate, Trainer):")
    trl = summarize("trl", run_trl(args), args.warmup)
    print(f"\n{'':<22} {'envkit':>10} {'TRL':>10} {'envkit/TRL':>11}")
    print(f"{'step time (s)':<22} {ours['step_s']:10.2f} {trl['step_s']:10.2f} {trl['step_s'] / ours['step_s']:10.1f}x "
          "faster")
    print(f"{'generation tok/s':<22} {ours['gen_tok_s']:10.1f} {trl['gen_tok_s']:10.1f} "
          f"{ours['gen_tok_s'] / trl['gen_tok_s']:10.1f}x")
    print(f"{'training tok/s':<22} {ours['train_tok_s']:10.1f} {trl['train_tok_s']:10.1f} "
          f"{ours['train_tok_s'] / trl['train_tok_s']:10.1f}x")


if __name__ == "__main__":
    main()
