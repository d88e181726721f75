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

import asyncio
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from generators import ChatTokenizer, Generator, Trajectory, read_jsonl
from generators.engines.base import InferenceEngine, publish_policy
from generators.models import resolve_model
from trainer.backends import make_backend
from trainer.backends.base import Batch, TrainBackend
from trainer.batching import micro_batches
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import Config
from trainer.distributed import (
    all_reduce_values,
    broadcast_from_rank0,
    init_distributed,
    max_over_ranks,
    shutdown_distributed,
)
from trainer.metrics import RunLogger
from trainer.placement import Placement
from trainer.rollout_source import evaluate, sync_weights
from trainer.sft_data import SFTData, load_sft_data, write_sft_data
from trainer.sources import Mixture

log = logging.getLogger(__name__)


def train_sft(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """Run the supervised stage; returns its results (held-out loss and accuracy before/after, the weights' dir)."""
    out = Path(cfg.trainer.output_dir)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    rank, _, _ = init_distributed()
    model_path = resolve_model(cfg.model.path)
    tokenizer = ChatTokenizer.from_pretrained(model_path)
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=cfg.trainer.keep_last)
    runner = asyncio.Runner()
    envs = Mixture(cfg.env, seed=cfg.trainer.seed) if rank == 0 else None
    engine = Placement(cfg).engine(model_path, out) if rank == 0 and cfg.trainer.eval_tasks > 0 else None
    logger: RunLogger | None = None
    results: dict[str, Any] = {}
    try:
        data = None
        if envs is not None:
            runner.run(envs.open(pool_size=0))
            data = runner.run(_prepare(cfg, tokenizer, envs, out, engine))
        data = broadcast_from_rank0(data)
        assert data is not None
        per_epoch = math.ceil(len(data.train) / cfg.sft.batch_size)
        total = per_epoch * cfg.sft.epochs
        backend = make_backend(cfg, model_path, sft_steps=total)
        state = checkpoints.load(checkpoints.resolve(cfg.trainer.resume), backend) if cfg.trainer.resume \
            else TrainState()
        generator = Generator(engine, tokenizer, cfg.generator) if engine is not None else None
        # every rank takes part in sending the weights (they are gathered from all of them)
        evaluating = broadcast_from_rank0(generator is not None and envs is not None
                                          and any(s.eval for s in envs.streams))
        if rank == 0:
            logger = RunLogger(out, cfg, total_steps=total, start_step=state.step, stage="sft")
            logger.console.print(f"sft: {len(data.train)} sequences to train on, {len(data.held_out)} held out, "
                                 f"{total} steps ({_counts_line(data.counts)})")
        if state.step == 0:
            loss = held_out_loss(backend, data.held_out, cfg, tokenizer.pad_id)
            results["eval_loss_before"] = loss
            if logger is not None and loss is not None:
                logger.log_eval(0, "loss", {"loss": loss}, [])
            if evaluating and evaluate_before and logger is not None:
                before = evaluate(generator, envs, runner, cfg, logger, step=0)  # type: ignore[arg-type]
                results.update({f"{k}_before": v for k, v in before.items()})

        while state.step < total:
            t0 = time.perf_counter()
            epoch, position = divmod(state.step, per_epoch)
            order = list(range(len(data.train)))
            random.Random(cfg.trainer.seed * 1_000_003 + epoch).shuffle(order)
            batch = order[position * cfg.sft.batch_size:(position + 1) * cfg.sft.batch_size]
            metrics = sft_update(backend, data.train, batch, cfg, tokenizer.pad_id)
            state.step += 1
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics["train/tokens_per_s"] = metrics["train/tokens"] / metrics["time/step_s"]
            last = state.step == total
            if state.step % cfg.trainer.save_every == 0 or last:
                checkpoints.save(backend, state)
            every = cfg.sft.eval_every
            loss = held_out_loss(backend, data.held_out, cfg, tokenizer.pad_id) \
                if last or (every and state.step % every == 0) else None
            if logger is not None:
                logger.log_step(state.step, metrics, [])
                if loss is not None:
                    logger.log_eval(state.step, "loss", {"loss": loss}, [])
            if last:
                results["eval_loss_after"] = loss

        state.policy_version = state.step
        weights = out / "weights" / f"v{state.policy_version}"
        if evaluating:
            sync_weights(backend, engine, runner, out, state.policy_version, cfg.weight_sync.mode)
        if broadcast_from_rank0(not weights.exists()):  # sent from memory, or no engine: write them (collective)
            backend.export_weights(weights)
        results["weights"] = str(weights)
        if evaluating and logger is not None:  # rank 0
            after = evaluate(generator, envs, runner, cfg, logger, step=state.step)  # type: ignore[arg-type]
            results.update({f"{k}_after": v for k, v in after.items()})
        if logger is not None:
            results.update({f"sft/{k}": v for k, v in data.counts.items()})
            results.update(logger.finish(results))
    finally:
        if engine is not None:
            runner.run(engine.stop())
        if envs is not None:
            runner.run(envs.close())
        runner.close()
        if logger is not None:
            logger.close()
        shutdown_distributed()
    return results


async def _prepare(cfg: Config, tokenizer: ChatTokenizer, envs: Mixture, out: Path,
                   engine: InferenceEngine | None) -> SFTData:
    """The run's data, while the inference server (if any) starts: a minute the demonstrations need not wait."""
    jobs = [_data(cfg, tokenizer, envs, out), *([engine.start()] if engine is not None else [])]
    data = (await asyncio.gather(*jobs))[0]
    if engine is not None:
        publish_policy(engine)
    return data


async def _data(cfg: Config, tokenizer: ChatTokenizer, envs: Mixture, out: Path) -> SFTData:
    """The run's data: read back from ``out/sft_data.jsonl`` when resuming, else loaded and written there."""
    saved = out / "sft_data.jsonl"
    if cfg.trainer.resume and saved.is_file():
        sequences = list(read_jsonl(saved))
        counts = json.loads((out / "sft_data_counts.json").read_text())
        held = counts["held_out"]
        return SFTData(sequences[:len(sequences) - held], sequences[len(sequences) - held:], counts)
    data = await load_sft_data(cfg, tokenizer, envs if cfg.sft.data == "demos" else None)
    data.counts["held_out"] = len(data.held_out)
    write_sft_data(data, out)
    return data


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
