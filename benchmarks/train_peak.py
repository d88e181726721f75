"""Training FLOP/s of a GRPO update against this machine's matmul peak, measured in the same run.

The peak is the best FLOP/s of ``torch.matmul`` in the trainer's compute dtype (``trainer.dtype=auto``: bf16 where
the hardware computes it, else fp32) over the matmul shapes of the model's own layers (the micro-batch's tokens by
the hidden, attention and MLP widths, and the vocabulary head) and a square one, on the threads the trainer uses.

The update is the trainer's own (``trainer.loop.update_policy``: forward, loss, backward, clip, AdamW) on one fixed
batch of synthetic GRPO rollouts (``--rollouts`` in groups of 8, prompts of 40-80 tokens, responses of 16-48), FSDP2
on one rank, the default config. Its FLOPs are the model's: for every token the model reads (a group's shared prompt
once), 2 x the decoder's matmul parameters and 4 x context x hidden per layer for attention; for every predicted
token 2 x vocabulary x hidden for the head; backward twice the forward. Padding and masked-out attention are not
counted, so this is model FLOP utilization (MFU), the work the update needs per second of its wall time.

    python benchmarks/train_peak.py [--rollouts 32] [--updates 4] [--profile]

``--profile`` also prints where an update's time goes: its phases (forward, backward, optimizer step, the rest)
and torch's profiler table of the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from synthetic import grpo_rollouts  # a sibling module in benchmarks/

from generators.models import bundled_model_dir
from trainer.backends import make_backend, train_dtype
from trainer.backends.base import TrainBackend
from trainer.batching import micro_batches
from trainer.config import Config, RolloutConfig, TrainerConfig
from trainer.loop import StepBatch, prepare_batch, update_policy


def matmul_peak(dtype: torch.dtype, shapes: list[tuple[int, int, int]], repeats: int = 5) -> tuple[float, str]:
    """The best FLOP/s of an (m, k) @ (k, n) matmul over ``shapes``, and the shape that gave it."""
    best, where = 0.0, ""
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b  # warm-up: the kernel's first call picks and packs
        reps = max(1, int(2e10 // (2 * m * k * n)))  # about 20 GFLOP a timing
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(reps):
                a @ b
            rate = 2 * m * k * n * reps / (time.perf_counter() - started)
            if rate > best:
                best, where = rate, f"{m}x{k} @ {k}x{n}"
    return best, where


def update_flops(backend: TrainBackend, batch: StepBatch, cfg: Config) -> tuple[float, int]:
    """The model FLOPs of one update of ``batch`` (forward and backward) and the tokens the model reads."""
    c = backend.model.config
    hidden, layers = c.hidden_size, c.num_hidden_layers
    kv = hidden * c.num_key_value_heads // c.num_attention_heads
    per_token = 2 * layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * c.intermediate_size)
    forward, read = 0.0, 0
    for mb, _ in micro_batches(list(range(len(batch.trajectories))), batch.trajectories, pad_id=2,
                                  budget=cfg.trainer.micro_batch_tokens, packing=cfg.trainer.packing,
                                  share_prompt=cfg.trainer.shares_prompts):
        if "part_bounds" in mb:  # parts that share a prompt: read once, then each rollout's own tokens after it
            tokens = mb["packed_input_ids"].shape[1]
            context = 0
            for begin, end in mb["part_bounds"].tolist():
                segments = mb["segments"][0, begin:end]
                shared = int((segments == 0).sum())
                lengths = [shared + int((segments == r).sum()) for r in range(1, int(segments.max()) + 1)]
                # causal attention: a token at position p attends to p + 1 positions, the shared ones counted once
                context += sum(n * (n + 1) // 2 for n in lengths) - (len(lengths) - 1) * shared * (shared + 1) // 2
        else:
            tokens = int(mb["attention_mask"].sum())
            context = sum(n * (n + 1) // 2 for n in mb["attention_mask"].sum(-1).tolist())
        predicted = int(mb["loss_mask"][:, 1:].sum())
        forward += per_token * tokens + 4 * layers * hidden * context + 2 * c.vocab_size * hidden * predicted
        read += tokens
    return 3 * forward, read


def timed_phases(backend: TrainBackend) -> dict[str, list[float]]:
    """Wrap the backend's forward, backward and step so each call's seconds are recorded under its name."""
    seconds: dict[str, list[float]] = defaultdict(list)

    def wrap(name: str, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[name].append(time.perf_counter() - started)
        return timed

    for name in ("forward", "backward", "step"):
        setattr(backend, name, wrap(name, getattr(backend, name)))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per update, in groups of 8")
    parser.add_argument("--updates", type=int, default=4, help="timed updates, after one warm-up")
    parser.add_argument("--profile", action="store_true", help="print phases and torch's op table too")
    parser.add_argument("--attention", default="auto", help="trainer.attention")
    args = parser.parse_args()

    group = 8
    cfg = Config(generator=RolloutConfig(prompts_per_step=args.rollouts // group, samples_per_prompt=group),
                 trainer=TrainerConfig(lr=1e-6, warmup_steps=0, attention=args.attention))
    torch.manual_seed(0)
    backend = make_backend(cfg, str(bundled_model_dir()))
    dtype = torch.bfloat16 if train_dtype(cfg.trainer.dtype) == "bf16" else torch.float32
    batch = prepare_batch(grpo_rollouts(args.rollouts, group), cfg)
    flops, read = update_flops(backend, batch, cfg)

    c = backend.model.config
    tokens = min(cfg.trainer.micro_batch_tokens, read)
    shapes = [(tokens, c.hidden_size, c.hidden_size), (tokens, c.hidden_size, c.intermediate_size),
              (tokens, c.intermediate_size, c.hidden_size), (512, c.hidden_size, c.vocab_size), (2048, 2048, 2048)]
    peak, peak_shape = matmul_peak(dtype, shapes)

    phases = timed_phases(backend)
    for _ in range(2):  # warm-up: allocations (the heap grows to its peak), Adam state
        update_policy(backend, batch, cfg, pad_id=2)
    phases.clear()
    walls = []
    for _ in range(args.updates):
        started = time.perf_counter()
        update_policy(backend, batch, cfg, pad_id=2)
        walls.append(time.perf_counter() - started)
    peak_after, _ = matmul_peak(dtype, shapes[-1:] + shapes[1:2])  # the machine may have slowed meanwhile
    wall = statistics.median(walls)

    print(f"{len(batch.trajectories)} rollouts, {read} tokens read a update, {flops / 1e9:.1f} GFLOP a update; "
          f"{dtype}, {torch.get_num_threads()} threads, {torch.__version__}")
    print(f"matmul peak        {peak / 1e9:8.1f} GFLOP/s  ({peak_shape}; {peak_after / 1e9:.1f} after the updates)")
    print(f"update             {wall:8.3f} s         (each: {' '.join(f'{w:.3f}' for w in walls)})")
    print(f"training           {flops / wall / 1e9:8.1f} GFLOP/s  {read / wall:8.0f} tokens/s")
    print(f"MFU                {flops / wall / peak:8.1%}  of the peak")
    if args.profile:
        total = sum(walls)
        accounted = 0.0
        for name in ("forward", "backward", "step"):
            spent = sum(phases[name])
            accounted += spent
            print(f"  {name:9} {spent / args.updates:7.3f} s an update ({spent / total:5.1%})")
        print(f"  {'the rest':9} {(total - accounted) / args.updates:7.3f} s an update "
              f"({(total - accounted) / total:5.1%}): loss, batching, metrics")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            update_policy(backend, batch, cfg, pad_id=2)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))


if __name__ == "__main__":
    main()
