"""Supervised fine-tuning, top to bottom: the RL loop's sibling, on the same backends, batches and checkpoints.

    data     = demonstrations, filtered trajectories or chat rows, as Trajectories (trainer/sft_data.py); some held out
    for each step (sft.epochs × ⌈train / sft.batch_size⌉; the order shuffled per epoch, seeded):
        for each micro-batch of this rank's share of the batch (a token budget, as in RL):
            logprobs = policy(tokens)                                          (B, T), at temperature 1
            loss     = −Σ logprobs · loss_mask / model tokens in the batch      only the model's own tokens
            backward(loss)
        optimizer step
    held-out loss before training, every sft.eval_every steps, and after
    with an env to evaluate on: held-out accuracy before and after, the engine serving the trained weights

The data is written to ``sft_data.jsonl`` before the first step and read back by a resumed run, so a resume trains on
exactly the same sequences in the same order. The final weights are an HF checkpoint in ``weights/vN``, where the
next stage (``stages=[sft, rl]``) or ``envkit eval --model`` finds them.
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

import torch

from generators import Trajectory, read_jsonl
from trainer.backends import make_backend
from trainer.backends.base import Batch, TrainBackend
from trainer.batching import micro_batches
from trainer.config import Config
from trainer.distributed import all_reduce_values, max_over_ranks
from trainer.placement import make_placement
from trainer.runs import MainRun, Run, open_run
from trainer.sft_data import SFTData, load_sft_data, write_sft_data


def train_sft(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """Run the supervised stage; returns its results (held-out loss and accuracy before/after, the weights' dir)."""
    # a multi-agent env's held-out play needs every seat's player: a run with seats plays it in its rl stage
    run = open_run(cfg, placement=make_placement, engine=cfg.trainer.eval_tasks > 0 and not cfg.seats)
    try:
        data = run.start(lambda main: _data(cfg, main))
        assert data is not None
        per_epoch = math.ceil(len(data.train) / cfg.sft.batch_size)
        total = per_epoch * cfg.sft.epochs
        policy = run.policy(make_backend(cfg, run.model_path, sft_steps=total))
        backend = policy.backend
        state = run.resume([policy], total_steps=total, stage="sft")
        run.logger.note(f"sft: {len(data.train)} sequences to train on, {len(data.held_out)} held out, {total} steps "
                        f"({_counts_line(data.counts)})")
        results = {"eval_loss_before": _held_out(run, backend, data, step=0)} if state.step == 0 else {}
        results.update(run.results_before(state, evaluate_before=evaluate_before))
        while state.step < total:
            t0 = time.perf_counter()
            metrics = sft_update(backend, data.train, _batch(cfg, state.step, per_epoch, len(data.train)), cfg,
                                 run.tokenizer.pad_id)
            state.step += 1
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics["train/tokens_per_s"] = metrics["train/tokens"] / metrics["time/step_s"]
            run.logger.log_step(state.step, metrics, [])
            if run.due(state, last=state.step == total):
                run.save([policy], state)
            every = cfg.sft.eval_every
            if state.step == total or (every and state.step % every == 0):
                results["eval_loss_after"] = _held_out(run, backend, data, step=state.step)
        state.policy_version = state.step
        if run.evaluating:  # the engine serves the trained weights for the evaluation after
            run.serve(policy, state.policy_version)
        # with seats, the policy these weights start (trainer/stages.py hands them on)
        trained = {"policy": cfg.sft.policy} if cfg.sft.policy else {}
        return run.finish([policy], state, {**results, **trained, **{f"sft/{k}": v for k, v in data.counts.items()}})
    finally:
        run.close()


async def _data(cfg: Config, run: MainRun) -> SFTData:
    """The run's data: read back from ``out/sft_data.jsonl`` when resuming, else loaded and written there."""
    saved = run.out / "sft_data.jsonl"
    if cfg.trainer.resume and saved.is_file():
        sequences = list(read_jsonl(saved))
        counts = json.loads((run.out / "sft_data_counts.json").read_text())
        held = counts["held_out"]
        return SFTData(sequences[:len(sequences) - held], sequences[len(sequences) - held:], counts)
    data = await load_sft_data(cfg, run.tokenizer, run.envs if cfg.sft.data == "demos" else None)
    data.counts["held_out"] = len(data.held_out)
    write_sft_data(data, run.out)
    return data


def _batch(cfg: Config, step: int, per_epoch: int, n: int) -> list[int]:
    """The sequences step ``step`` trains on: its slice of its epoch's order, shuffled by seed and epoch."""
    epoch, position = divmod(step, per_epoch)
    order = list(range(n))
    random.Random(cfg.trainer.seed * 1_000_003 + epoch).shuffle(order)
    return order[position * cfg.sft.batch_size:(position + 1) * cfg.sft.batch_size]


def _held_out(run: Run, backend: TrainBackend, data: SFTData, *, step: int) -> float | None:
    """The held-out loss at ``step``, logged."""
    loss = held_out_loss(backend, data.held_out, run.cfg, run.tokenizer.pad_id)
    if loss is not None:
        run.logger.log_eval(step, "loss", {"loss": loss}, [])
    return loss


def _counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def sft_update(backend: TrainBackend, trajectories: list[Trajectory], batch: list[int], cfg: Config, pad_id: int
               ) -> dict[str, float]:
    """One optimizer step on the sequences ``batch``: the mean negative log-likelihood of their model tokens."""
    micro = _micro(batch[backend.rank::backend.world_size], trajectories, cfg, pad_id)
    totals = all_reduce_values({"tokens": sum(float(mb["loss_mask"].sum()) for mb in micro),
                                "all_tokens": sum(float(mb["attention_mask"].sum()) for mb in micro)})
    tokens = max(totals["tokens"], 1.0)
    loss_sum = 0.0
    # Every forward/backward is a collective: a rank with fewer micro-batches repeats its first with zero weight.
    passes = max_over_ranks(len(micro))
    for k in range(passes):
        mb = micro[k] if k < len(micro) else _idle(batch, trajectories, cfg, pad_id)
        weight = 1.0 if k < len(micro) else 0.0
        logprobs = backend.forward(mb).logprobs  # (B, T)
        loss = -(logprobs * mb["loss_mask"]).sum() / tokens * weight
        backend.backward(loss * backend.world_size, last=k == passes - 1)  # FSDP averages gradients over ranks
        loss_sum += float(loss.detach())
    step = backend.step()
    return {"train/loss": all_reduce_values({"loss": loss_sum})["loss"], "train/grad_norm": step.grad_norm,
            "train/lr": step.lr, "train/tokens": totals["all_tokens"], "train/model_tokens": totals["tokens"],
            "train/sequences": float(len(batch))}


@torch.no_grad()
def held_out_loss(backend: TrainBackend, trajectories: list[Trajectory], cfg: Config, pad_id: int) -> float | None:
    """The mean negative log-likelihood of the held-out sequences' model tokens (None without held-out data)."""
    if not trajectories:
        return None
    index = list(range(len(trajectories)))
    micro = _micro(index[backend.rank::backend.world_size], trajectories, cfg, pad_id)
    nll = tokens = 0.0
    for k in range(max_over_ranks(len(micro))):
        if k < len(micro):
            nll -= float((backend.forward(micro[k]).logprobs * micro[k]["loss_mask"]).sum())
            tokens += float(micro[k]["loss_mask"].sum())
        else:
            backend.forward(_idle(index, trajectories, cfg, pad_id))
    sums = all_reduce_values({"nll": nll, "tokens": tokens})
    return sums["nll"] / max(sums["tokens"], 1.0)


def _micro(index: list[int], trajectories: list[Trajectory], cfg: Config, pad_id: int) -> list[Batch]:
    return [mb for mb, _ in micro_batches(index, trajectories, budget=cfg.trainer.micro_batch_tokens,
                                          packing=cfg.trainer.packing, pad_id=pad_id)]


def _idle(index: list[int], trajectories: list[Trajectory], cfg: Config, pad_id: int) -> Batch:
    """A pass a rank with fewer micro-batches makes so that the collectives match (its result is not used)."""
    return _micro(index[:1], trajectories, cfg, pad_id)[0]
