"""Training updates on a fixed synthetic batch, for backend parity tests; run directly or under torchrun.

    python tests/dist_update.py --backend fsdp --out result.json
    torchrun --nproc_per_node 2 tests/dist_update.py --backend fsdp --out result.json
    python tests/dist_update.py --algorithm ppo --updates 3 --export DIR --out result.json
    python tests/dist_update.py --lora 8 --kl-coef 0.1 --out result.json

Writes (rank 0) the last update's metrics, every update's ``history`` and the policy's logprob sum on the batch
before and after the updates (and the reference's after, with KL), so runs with different world sizes or backends
can be compared number for number; with LoRA also which parameters require grad and which have optimizer state.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tiny import tiny_model_dir

from generators.models import resolve_model
from generators.trajectory import Trajectory
from trainer.backends import make_backend
from trainer.batching import to_padded
from trainer.config import AlgorithmConfig, Config, LoraConfig, ModelConfig, RolloutConfig, TrainerConfig
from trainer.distributed import shutdown_distributed
from trainer.loop import prepare_batch, update_policy


def synthetic_trajectories(n_groups: int = 4, group_size: int = 4, seed: int = 0) -> list[Trajectory]:
    """Rollouts with varied lengths, env tokens inside responses, and rewards that differ within groups."""
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(12, 30))]
        for k in range(group_size):
            model_a = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 20))]
            env = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 8))]
            model_b = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 12))]
            mask = [1] * len(model_a) + [0] * len(env) + [1] * len(model_b)
            trajs.append(Trajectory(
                prompt_ids=prompt, response_ids=model_a + env + model_b, loss_mask=mask,
                rollout_logprobs=[-rng.uniform(0.5, 3.0) if m else 0.0 for m in mask],
                reward=float((g + k) % 2), group_id=f"g{g}", sample_index=k,
            ))
    return trajs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["fsdp", "deepspeed"], default="fsdp")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--no-share-prompt", action="store_true", help="read each group's prompt in every row")
    parser.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--updates", type=int, default=1)
    # the tiny model's logprobs move under 3e-4 about as far as the bundled model's under 1e-5
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--export", type=Path, help="export the weights for serving into this dir afterwards")
    parser.add_argument("--model", default="tiny",
                        help="a checkpoint dir, 'bundled', or 'tiny' (tests/tiny.py: what parity compares does not "
                             "need the bundled model's 30 layers)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    cfg = Config(
        model=ModelConfig(lora=LoraConfig(r=args.lora)),
        generator=RolloutConfig(prompts_per_step=4, samples_per_prompt=4),
        algorithm=AlgorithmConfig(advantage="grpo" if args.algorithm == "grpo" else "gae", tis_cap=2.0,
                                  kl_coef=args.kl_coef),
        trainer=TrainerConfig(backend=args.backend, zero_stage=args.zero_stage, dtype=args.dtype, lr=args.lr,
                              warmup_steps=0, packing=args.packing, micro_batch_tokens=args.micro_batch_tokens,
                              share_prompt=not args.no_share_prompt),
    )
    torch.manual_seed(0)
    backend = make_backend(cfg, str(tiny_model_dir()) if args.model == "tiny" else resolve_model(args.model))
    trajs = synthetic_trajectories()
    # with LoRA: the wrapped model's parameters (FSDP's sharded ones, which its optimizer holds; DeepSpeed's module's)
    params = dict(backend.engine.module.named_parameters() if args.backend == "deepspeed"
                  else backend.model.named_parameters()) if args.lora else {}
    batch = prepare_batch(trajs, cfg)
    padded = to_padded(trajs, pad_id=2)
    result: dict = {}
    if args.kl_coef > 0:  # first, while FSDP holds the sharded parameters: LoRA's reference pass starts there
        reference = backend.logprobs(padded, reference=True)
        result["reference_logprob_sum_before"] = float((reference * padded["loss_mask"]).sum())
    before = float((backend.logprobs(padded) * padded["loss_mask"]).sum())
    history = [update_policy(backend, batch, cfg, pad_id=2) for _ in range(args.updates)]
    logprobs = backend.logprobs(padded)
    result |= {**history[-1], "history": history, "logprob_sum_before": before,
               "logprob_sum_after": float((logprobs * padded["loss_mask"]).sum()), "world_size": backend.world_size}
    if args.kl_coef > 0:
        reference = backend.logprobs(padded, reference=True)
        result["reference_logprob_sum_after"] = float((reference * padded["loss_mask"]).sum())
    if args.lora:
        names = {id(param): name for name, param in params.items()}
        result["requires_grad"] = sorted(name for name, param in params.items() if param.requires_grad)
        result["parameters"] = len(params)
        trainable = [p for p in params.values() if p.requires_grad]
        result["trainable_numel"] = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)  # ZeRO-3: partitioned
        if args.backend == "deepspeed":  # ZeRO's Adam state is flat partitions, not per parameter: count it
            state = backend.optimizer.optimizer.state.values()
            result["adam_numel"] = sum(s["exp_avg"].numel() for s in state) * backend.world_size
        else:
            result["optimizer_state"] = sorted(names[id(param)] for param in backend.optimizer.state)
    if args.export:
        backend.export_weights(args.export)
    if backend.rank == 0:
        args.out.write_text(json.dumps(result))
    shutdown_distributed()


if __name__ == "__main__":
    main()
