"""LoRA vs full fine-tuning: memory and training throughput of the same GRPO updates on the same batch.

Each configuration trains in a process of its own (FSDP2, one rank, the trainer's default dtype): it builds the
backend as ``python -m trainer`` does, runs one warm-up update, then ``--updates`` timed ones on one fixed batch of
``--rollouts`` synthetic rollouts (a prompt of 40-80 tokens, a response of 16-48; rewards differ within each group of
8, so every update has a gradient). No inference engine runs, so the memory is the trainer's own:

    built RSS     the process's resident memory once the backend is built (imports, model, reference)
    peak RSS      the process's peak resident memory (``ru_maxrss``), everything included: activations too
    model state   torch's accounting: fp32 parameters (+ a KL reference model), gradients and AdamW state, in bytes
    tokens/s      prompt + response tokens of the batch per second of ``update_policy`` (forward, backward, step)

``--kl-coef`` > 0 adds the KL term: full fine-tuning then keeps a second (frozen) model as the reference, LoRA
switches its adapters off instead.

    python benchmarks/lora_vs_full.py [--rank 16] [--updates 3] [--rounds 2] [--kl-coef 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Runs in the child process: build the backend, train, report (JSON on stdout)."""
    import torch
    from synthetic import grpo_rollouts  # a sibling module in benchmarks/

    from generators.models import bundled_model_dir
    from trainer.backends import make_backend
    from trainer.config import AlgorithmConfig, Config, LoraConfig, ModelConfig, RolloutConfig, TrainerConfig
    from trainer.distributed import shutdown_distributed
    from trainer.loop import prepare_batch, update_policy

    group = 8
    cfg = Config(
        model=ModelConfig(lora=LoraConfig(r=args.rank)),
        generator=RolloutConfig(prompts_per_step=args.rollouts // group, samples_per_prompt=group),
        algorithm=AlgorithmConfig(kl_coef=args.kl_coef),
        trainer=TrainerConfig(lr=1e-3 if args.rank else 1e-5, warmup_steps=0),
    )
    torch.manual_seed(0)
    backend = make_backend(cfg, str(bundled_model_dir()))
    built_rss = _rss_mb()
    trajs = grpo_rollouts(args.rollouts, group)
    batch = prepare_batch(trajs, cfg)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    update_policy(backend, batch, cfg, pad_id=2)  # warm-up: allocations, Adam state
    started = time.perf_counter()
    for _ in range(args.updates):
        update_policy(backend, batch, cfg, pad_id=2)
    seconds = (time.perf_counter() - started) / args.updates

    def size(tensor: torch.Tensor) -> int:
        local = getattr(tensor, "to_local", None)  # FSDP's DTensors: this rank's shard is what it holds
        tensor = local() if local else tensor
        return tensor.numel() * tensor.element_size()

    # fp32 master parameters (FSDP registers its gathered compute-dtype copies in their place between a forward and
    # the next reshard, so count elements, not the registered tensors' bytes); gradients are fp32 like them.
    models = [backend.model] + ([backend.reference] if backend.reference is not None else [])
    params = sum(p.numel() * 4 for model in models for p in model.parameters())
    trainable = [p for p in backend.model.parameters() if p.requires_grad]
    grads = sum(p.numel() * 4 for p in trainable)
    optimizer = sum(size(v) for state in backend.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    shutdown_distributed()
    return {"tokens_per_s": tokens / seconds, "update_s": seconds, "built_rss_mb": built_rss,
            "peak_rss_mb": _peak_rss_mb(),
            "params_mb": params / 2**20, "grads_mb": grads / 2**20, "optimizer_mb": optimizer / 2**20,
            "model_state_mb": (params + grads + optimizer) / 2**20,
            "trainable": sum(p.numel() for p in trainable), "tokens": tokens}


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(args: argparse.Namespace, rank: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--rank", str(rank), "--updates", str(args.updates),
               "--rollouts", str(args.rollouts), "--kl-coef", str(args.kl_coef)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"rank {rank} run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all linear layers)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="full and LoRA runs, interleaved")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return

    runs: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    for _ in range(args.rounds):
        runs["full"].append(run(args, 0))
        runs["lora"].append(run(args, args.rank))
    med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    full, lora = med["full"], med["lora"]
    print(f"GRPO updates on {int(full['tokens'])} tokens ({args.rollouts} rollouts), FSDP2 on one rank, "
          f"{args.rounds} rounds (medians), kl_coef={args.kl_coef:g}:")
    print(f"{'':14}{'full':>12}{f'LoRA r={args.rank}':>14}{'LoRA / full':>14}")
    rows = [("trainable", "trainable", "{:,.0f}"), ("params MB", "params_mb", "{:.0f}"),
            ("grads MB", "grads_mb", "{:.0f}"), ("Adam MB", "optimizer_mb", "{:.0f}"),
            ("model state MB", "model_state_mb", "{:.0f}"), ("built RSS MB", "built_rss_mb", "{:.0f}"),
            ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
            ("update s", "update_s", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.0f}")]
    for label, key, fmt in rows:
        print(f"{label:14}{fmt.format(full[key]):>12}{fmt.format(lora[key]):>14}{lora[key] / full[key]:>13.3f}x")
    for name, rs in runs.items():
        print(f"tokens/s per round, {name}: {' '.join(format(r['tokens_per_s'], '.0f') for r in rs)}")


if __name__ == "__main__":
    main()
