"""The RL loop, top to bottom. One training step:

    starts     = next prompts_per_step episode starts, split among the run's envs by weight (trainer/sources.py)
    trajs      = generator.generate(env, starts, n=samples_per_prompt)   rank 0, on the inference engine
    trajs      = drop failed rollouts (counted), drop zero-variance groups
    advantages = ADVANTAGES[algorithm](rewards, groups)                    one scalar per rollout
                 (PPO: GAE per token from the value head's values before the update)
    for each mini-batch (epochs × batch / mini_batch_size):
        for each micro-batch (token budget):
            logprobs = policy(tokens)                                      trainer's logprobs, with grad
            loss     = policy_loss(logprobs, old, A) · TIS + kl_coef·KL − entropy_coef·H (+ vf_coef·value_loss)
            backward(loss · share of the mini-batch)
        optimizer step
    weights v(step+1) → engine                                             broadcast from memory, or a checkpoint

``trainer.mode=async`` generates the next steps' rollouts while a step trains, at most ``trainer.max_staleness``
weight versions behind (trainer/async_rollouts.py); the step then takes its rollouts from there instead.

With N ranks (torchrun, or Ray actors: trainer/placement) rank 0 generates, every rank trains on its slice of each
mini-batch, and FSDP averages gradients; losses are scaled so the result equals the single-rank loss on the whole
mini-batch. Rank 0's placement supplies the engine (one server, or replicas behind a router) and each rollout's env
(made here, or in an env worker); the step reads the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from generators import ChatTokenizer, Generator, Trajectory
from generators.engines.base import InferenceEngine, publish_policy
from generators.models import resolve_model
from generators.report import first_errors, passed
from trainer import algorithms as algo
from trainer.async_rollouts import AsyncRollouts, LoopThread
from trainer.backends import make_backend
from trainer.backends.base import Batch, TrainBackend
from trainer.backends.hf_export import write_hf_checkpoint
from trainer.batching import micro_batches, mini_batch_order, stack_rows, to_padded
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import Config
from trainer.distributed import all_reduce_values, broadcast_from_rank0, max_over_ranks, shutdown_distributed
from trainer.metrics import RunLogger, rollout_metrics
from trainer.placement import make_placement
from trainer.sources import Mixture

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One step's training data after filtering: the trajectories and one advantage per trajectory."""

    trajectories: list[Trajectory]
    advantages: torch.Tensor  # (B,); zeros with a critic, whose advantages are per token
    counts: dict[str, int] = field(default_factory=dict)


def train(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """Run ``cfg.trainer.steps`` training steps; returns the final metrics (held-out accuracy before/after) and the
    final weights' dir. ``evaluate_before=False`` skips the evaluation of the initial policy (a later stage's, which
    the stage before it evaluated last)."""
    out = Path(cfg.trainer.output_dir)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    model_path = resolve_model(cfg.model.path)
    backend = make_backend(cfg, model_path)
    is_main = backend.rank == 0
    tokenizer = ChatTokenizer.from_pretrained(model_path)
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=cfg.trainer.keep_last)
    state = TrainState()
    if cfg.trainer.resume:
        state = checkpoints.load(checkpoints.resolve(cfg.trainer.resume), backend)

    # The generator is async; the trainer drives it from this synchronous loop. In async mode the event loop runs in
    # a thread of its own, so generation goes on while this thread trains.
    runner: asyncio.Runner | LoopThread = LoopThread() if cfg.trainer.mode == "async" else asyncio.Runner()
    placement = make_placement(cfg) if is_main else None  # rank 0 generates: here, or with Ray actors
    envs = Mixture(cfg.env, seed=cfg.trainer.seed, make_env=placement.make_env) if placement else None
    engine = placement.engine(model_path, out) if placement else None
    logger = RunLogger(out, cfg, total_steps=cfg.trainer.steps, start_step=state.step) if is_main else None
    results: dict[str, Any] = {}
    rollouts: AsyncRollouts | None = None
    try:
        if envs is not None:  # first: a wrong env or task source fails before the inference server starts
            runner.run(envs.open(pool_size=placement.sandbox_pool_size()))
            if state.data:
                envs.load_state(state.data)
        if engine is not None:
            runner.run(engine.start())
            publish_policy(engine)
        if state.policy_version:  # resumed: serve the checkpoint's policy, not the initial one
            sync_weights(backend, engine, runner, out, state.policy_version, cfg.trainer.weight_sync)
        generator = Generator(engine, tokenizer, cfg.generator) if engine is not None else None
        evaluating = (generator is not None and envs is not None and logger is not None
                      and cfg.trainer.eval_tasks > 0 and any(s.eval for s in envs.streams))
        if evaluating and evaluate_before and state.step == 0:
            before = evaluate(generator, envs, runner, cfg, logger, step=0)
            results.update({f"{k}_before": v for k, v in before.items()})

        if cfg.trainer.mode == "async" and generator is not None and envs is not None:
            rollouts = AsyncRollouts(envs, generator, prompts_per_step=cfg.generator.prompts_per_step,
                                     max_staleness=cfg.trainer.max_staleness)
            runner.run(rollouts.start(step=state.step, version=state.policy_version, pending=state.pending))

        while state.step < cfg.trainer.steps:
            t_step = time.perf_counter()
            t0 = time.perf_counter()
            stale = 0
            if rollouts is not None:
                trajs, stale = runner.run(rollouts.batch(state.step))
            elif generator is not None and envs is not None:
                trajs = runner.run(envs.rollouts(generator, cfg.generator.prompts_per_step))
                state.data = envs.state()
            else:  # ranks > 0 get rank 0's rollouts
                trajs = []
            trajs = broadcast_from_rank0(trajs)
            gen_s = time.perf_counter() - t0

            batch = prepare_batch(trajs, cfg)
            batch.counts["stale_dropped"] = stale
            t0 = time.perf_counter()
            train_metrics = update_policy(backend, batch, cfg, tokenizer.pad_id)
            train_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            state.step += 1
            state.policy_version = state.step
            from_memory = sync_weights(backend, engine, runner, out, state.policy_version, cfg.trainer.weight_sync)
            if rollouts is not None:
                runner.run(rollouts.set_version(state.policy_version))
            sync_s = time.perf_counter() - t0

            if state.step % cfg.trainer.save_every == 0 or state.step == cfg.trainer.steps:
                if rollouts is not None and envs is not None:  # a consistent cut: nothing runs on the loop meanwhile
                    state.data, state.pending = runner.run(_snapshot(envs, rollouts))
                checkpoints.save(backend, state)
            if logger is not None:
                metrics = {
                    **rollout_metrics(trajs, batch, state.policy_version - 1),
                    **train_metrics,
                    **(placement.metrics() if placement else {}),
                    "time/generate_s": gen_s, "time/train_s": train_s, "time/sync_s": sync_s,
                    "weights/from_memory": float(from_memory),
                    "time/step_s": time.perf_counter() - t_step,
                }
                logger.log_step(state.step, metrics, trajs)
                every = cfg.trainer.eval_every
                if evaluating and every and state.step % every == 0 and state.step < cfg.trainer.steps:
                    evaluate(generator, envs, runner, cfg, logger, step=state.step)

        weights = out / "weights" / f"v{state.policy_version}"
        if state.policy_version and cfg.trainer.weight_sync != "disk":  # synced from memory: put the policy on disk
            backend.export_weights(weights)
        results["weights"] = str(weights) if state.policy_version else str(model_path)
        if evaluating:
            after = evaluate(generator, envs, runner, cfg, logger, step=state.step)
            results.update({f"{k}_after": v for k, v in after.items()})
        if logger is not None:
            results.update(logger.finish(results))
    finally:
        if rollouts is not None:
            runner.run(rollouts.close())
        if engine is not None:
            runner.run(engine.stop())
        if envs is not None:
            runner.run(envs.close())
        if placement is not None:
            runner.run(placement.close())
        runner.close()
        if logger is not None:
            logger.close()
        shutdown_distributed()
    return results


# ------------------------------------------------------------------------------------------------- the update


def prepare_batch(trajs: list[Trajectory], cfg: Config) -> StepBatch:
    """Drop failed rollouts and (optionally) zero-variance groups; compute one advantage per rollout."""
    counts = Counter(failed=sum(t.failed for t in trajs))
    if counts["failed"]:
        log.warning("%d of %d rollouts failed and are not trained on; first errors: %s", counts["failed"],
                    len(trajs), first_errors([t for t in trajs if t.failed], limit=3))
    kept = [t for t in trajs if not t.failed and t.response_ids]
    if cfg.algorithm.filter_zero_variance_groups:
        by_group: dict[str, list[float]] = {}
        for t in kept:
            by_group.setdefault(t.group_id, []).append(t.reward)
        flat = {g for g, rewards in by_group.items() if max(rewards) == min(rewards)}
        counts["zero_variance_groups"] = len(flat)
        kept = [t for t in kept if t.group_id not in flat]
    group_index = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in kept))}
    rewards = torch.tensor([t.reward for t in kept], dtype=torch.float32)  # (B,)
    groups = torch.tensor([group_index[t.group_id] for t in kept], dtype=torch.long)  # (B,)
    if kept and not cfg.algorithm.critic:
        advantages = algo.ADVANTAGES[cfg.algorithm.advantage](rewards, groups)
    else:  # GAE needs the critic's values: update_policy computes it per token
        advantages = torch.zeros_like(rewards)
    counts["trained"] = len(kept)
    return StepBatch(kept, advantages, dict(counts))


def update_policy(backend: TrainBackend, batch: StepBatch, cfg: Config, pad_id: int) -> dict[str, float]:
    """The optimizer steps of one training step; returns averaged diagnostics."""
    a = cfg.algorithm
    stats: dict[str, list[float]] = {}
    if not batch.trajectories:
        return {"train/skipped_update": 1.0}
    n = len(batch.trajectories)
    mini = max(1, round(cfg.mini_batch_size * n / cfg.generator.batch_size))  # filtering shrinks the batch
    order = mini_batch_order(batch.trajectories, share_prompt=cfg.trainer.shares_prompts)
    # Several updates per batch: the ratio needs the logprobs of the policy before the first of them. A critic's
    # values before the update give GAE its advantages and the value loss its clipping anchor.
    before = _before_update(backend, batch, cfg, pad_id) if cfg.steps_per_update > 1 or a.critic else None
    targets = _gae_targets(batch, before, cfg, pad_id) if a.critic else None
    for _epoch in range(cfg.trainer.epochs):
        for start in range(0, n, mini):
            index = order[start:start + mini]
            # This rank's slice; FSDP averages gradients over ranks, so scale each rank's share by world size.
            mine = index[backend.rank::backend.world_size]
            micro = list(_micro_batches(mine, batch, cfg, pad_id))
            totals = _global_counts([mb for mb, _ in micro])
            # Every forward/backward is a collective (FSDP all-gathers, ZeRO reduces): all ranks must run the same
            # number, so a rank with fewer micro-batches repeats its first one with zero weight.
            passes = max_over_ranks(len(micro))
            weighted: dict[str, float] = {}  # share-weighted sums: all-reduced, they are mini-batch means
            peaks: dict[str, float] = {}
            for k in range(passes):
                mb, rows = micro[k] if k < len(micro) else micro[0]
                weight = 1.0 if k < len(micro) else 0.0
                out = backend.forward(mb, entropy_grad=a.entropy_coef > 0)
                logprobs, entropy, mask = out.logprobs, out.entropy, mb["loss_mask"]  # (B, T) each
                # One update per batch: the policy that sampled is the one being trained, so old = current.
                old = logprobs.detach() if before is None else stack_rows(before["logprobs"], rows, logprobs.shape)
                adv_tok = (batch.advantages[rows][:, None].expand_as(logprobs) if targets is None
                           else stack_rows(targets["advantages"], rows, logprobs.shape))
                loss_tok, diag = algo.POLICY_LOSSES[a.policy_loss](logprobs, old, adv_tok, mask, **_clip_kwargs(cfg))
                share = _share(mask, totals, cfg) * weight
                if a.tis_cap is not None:  # correct for sampler/trainer logprob mismatch (vLLM bf16 vs ours)
                    loss_tok = loss_tok * algo.tis_weights(old, mb["rollout_logprobs"], cap=a.tis_cap)
                if a.kl_coef > 0:
                    ref = backend.logprobs(mb, reference=True)
                    kl = algo.kl_penalty(logprobs, ref, a.kl_kind)
                    loss_tok = loss_tok + a.kl_coef * kl
                    _accumulate(weighted, "train/kl", algo.masked_mean(kl.detach(), mask), share)
                if a.entropy_coef > 0:
                    loss_tok = loss_tok - a.entropy_coef * entropy
                if targets is not None:
                    value_loss = algo.value_loss(out.values, stack_rows(before["values"], rows, logprobs.shape),
                                                 stack_rows(targets["returns"], rows, logprobs.shape),
                                                 clip=a.value_clip)
                    loss_tok = loss_tok + a.vf_coef * value_loss
                    _accumulate(weighted, "train/value_loss", algo.masked_mean(value_loss.detach(), mask), share)
                loss = algo.aggregate(loss_tok, mask, a.aggregation, max_tokens=cfg.generator.max_total_tokens)
                backend.backward(loss * share * backend.world_size)
                _accumulate(weighted, "train/loss", loss.detach(), share)
                _accumulate(weighted, "train/entropy", algo.masked_mean(entropy.detach(), mask), share)
                _accumulate(weighted, "train/clip_fraction", algo.masked_mean(diag["clipped"].float(), mask), share)
                mismatch = algo.logprob_mismatch_stats(old.detach(), mb["rollout_logprobs"], mask)
                _accumulate(weighted, "mismatch/mean_abs_diff", mismatch["mean_abs_diff"], share)
                for key in ("max_abs_diff", "max_ratio"):
                    peaks[f"mismatch/{key}"] = max(peaks.get(f"mismatch/{key}", 0.0), mismatch[key])
            for key, value in {**all_reduce_values(weighted), **all_reduce_values(peaks, max)}.items():
                _add(stats, key, value)
            step = backend.step()
            _add(stats, "train/grad_norm", step.grad_norm)
            _add(stats, "train/lr", step.lr)
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    for key in ("mismatch/max_ratio", "mismatch/max_abs_diff"):
        out[key] = max(stats[key])
    return out


def _before_update(backend: TrainBackend, batch: StepBatch, cfg: Config, pad_id: int
                   ) -> dict[str, dict[int, torch.Tensor]]:
    """Each rollout's per-token ``logprobs`` (and, with a critic, ``values``) before this step's updates."""
    out: dict[str, dict[int, torch.Tensor]] = {"logprobs": {}, "values": {}}
    for mb, rows in _micro_batches(list(range(len(batch.trajectories))), batch, cfg, pad_id):
        with torch.no_grad():
            result = backend.forward(mb)  # (B, T) each
        for row, i in enumerate(rows):
            out["logprobs"][i] = result.logprobs[row]
            if result.values is not None:
                out["values"][i] = result.values[row]
    return out


def _micro_batches(index: list[int], batch: StepBatch, cfg: Config, pad_id: int
                   ) -> Iterator[tuple[Batch, list[int]]]:
    return micro_batches(index, batch.trajectories, budget=cfg.trainer.micro_batch_tokens,
                         packing=cfg.trainer.packing, pad_id=pad_id,
                         share_prompt=cfg.trainer.shares_prompts)


def _gae_targets(batch: StepBatch, before: dict[str, dict[int, torch.Tensor]], cfg: Config, pad_id: int
                 ) -> dict[str, dict[int, torch.Tensor]]:
    """Per-token ``advantages`` (GAE, whitened over the batch's model tokens) and ``returns`` for each rollout,
    from the critic's values before the update; each turn's reward sits on that turn's last model token."""
    trajs = batch.trajectories
    mask = to_padded(trajs, pad_id)["loss_mask"]  # (B, T)
    index = list(range(len(trajs)))
    values = stack_rows(before["values"], index, mask.shape)  # (B, T)
    rewards = torch.zeros_like(mask)  # (B, T)
    for row, traj in enumerate(trajs):
        for position, reward in turn_rewards(traj):  # response positions; the padded rows start with the prompt
            rewards[row, len(traj.prompt_ids) + position] += reward
    a = cfg.algorithm
    advantages, returns = algo.gae_advantages(rewards, values, mask, gamma=a.gamma, lam=a.lam)
    advantages = algo.whiten(advantages, mask)
    return {"advantages": dict(enumerate(advantages)), "returns": dict(enumerate(returns))}


def turn_rewards(traj: Trajectory) -> list[tuple[int, float]]:
    """(response position, reward) pairs: each model turn's ``step_rewards`` entry on its last model token.

    A rollout whose model turns and step rewards do not pair up one to one (a turn cut to no tokens) gets its
    total reward on its last model token, as outcome-only algorithms see it."""
    mask = traj.loss_mask
    ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
    if not ends:
        return []
    if len(ends) == len(traj.step_rewards):
        return list(zip(ends, traj.step_rewards, strict=True))
    return [(ends[-1], traj.reward)]


def _global_counts(batches: list[Batch]) -> dict[str, float]:
    """Masked tokens and non-empty sequences in the whole mini-batch, over all ranks."""
    counts = all_reduce_values({"tokens": sum(float(mb["loss_mask"].sum()) for mb in batches),
                                "sequences": sum(float(mb["loss_mask"].any(-1).sum()) for mb in batches)})
    return {key: max(value, 1.0) for key, value in counts.items()}


def _share(mask: torch.Tensor, totals: dict[str, float], cfg: Config) -> float:
    """The weight that makes a micro-batch's mean loss add up to the mini-batch's mean loss."""
    if cfg.algorithm.aggregation == "token-mean":
        return float(mask.sum()) / totals["tokens"]
    return float(mask.any(-1).sum()) / totals["sequences"]


def _accumulate(weighted: dict[str, float], key: str, value: float | torch.Tensor, share: float) -> None:
    weighted[key] = weighted.get(key, 0.0) + float(value) * share


def _clip_kwargs(cfg: Config) -> dict[str, Any]:
    a = cfg.algorithm
    kwargs: dict[str, Any] = {"clip_low": a.clip_low, "clip_high": a.clip_high}
    if a.policy_loss == "ppo":
        kwargs["dual_clip"] = a.dual_clip
    return kwargs


def _add(stats: dict[str, list[float]], key: str, value: float | torch.Tensor) -> None:
    stats.setdefault(key, []).append(float(value))


# ------------------------------------------------------------------------------------------------- plumbing


def sync_weights(backend: TrainBackend, engine: InferenceEngine | None, runner: asyncio.Runner | LoopThread,
                 out: Path, version: int, how: str) -> bool:
    """Have the engine serve the policy as ``version``: sent from memory (``how`` memory, or auto where the engine
    can take it), else as an HF checkpoint it reloads (only the newest is kept); whether it went from memory. Every
    rank gathers the weights; rank 0, which holds the engine, sends them."""
    weights = backend.served_weights()
    if engine is None:
        return False
    if how != "disk" and engine.supports_weight_push:
        try:
            runner.run(engine.push_weights(weights, version))
            return True
        except Exception as e:
            if how == "memory":
                raise
            log.warning("sending weights v%d from memory failed (%s: %s); loading them from disk instead", version,
                        type(e).__name__, e)
    path = out / "weights" / f"v{version}"
    write_hf_checkpoint(weights, Path(backend.config.model_path), path)
    runner.run(engine.load_weights(path, version))
    for old in (out / "weights").glob("v*"):
        if old != path and old.name[1:].isdigit():
            shutil.rmtree(old, ignore_errors=True)
    return False


async def _snapshot(envs: Mixture, rollouts: AsyncRollouts) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """The data positions and the drawn-but-untrained groups, taken in one go on the event loop."""
    return envs.state(), rollouts.pending()


def evaluate(generator: Generator, envs: Mixture, runner: asyncio.Runner | LoopThread, cfg: Config,
             logger: RunLogger, *, step: int) -> dict[str, float]:
    """Held-out accuracy (fraction of rollouts with reward >= 1) and mean reward, over every env and per env of a
    mixture: sampled at the eval temperature with ``eval_samples`` per task, and greedy (one per task) when
    ``eval_greedy``. Where an env has tools, also the share of episodes that called one (``tool_call_rate``)."""
    settings = {"accuracy": (cfg.trainer.eval_temperature, cfg.trainer.eval_samples)}
    if cfg.trainer.eval_greedy:
        settings["greedy_accuracy"] = (0.0, 1)
    # Both sets of rollouts at once, each with its share of the concurrency: one after the other, the engine would
    # idle while the first set's slowest rollouts finish.
    total = sum(samples for _, samples in settings.values())
    generators = [Generator(generator.engine, generator.tokenizer, cfg.generator.generator_config(
        temperature=temperature, samples_per_prompt=samples, seed=None,
        concurrency=max(1, cfg.generator.concurrency * samples // total)))
        for temperature, samples in settings.values()]

    async def rollouts() -> list[list[Trajectory]]:
        return await asyncio.gather(*(envs.eval_rollouts(g, cfg.trainer.eval_tasks) for g in generators))

    results: dict[str, float] = {}
    for name, trajs in zip(settings, runner.run(rollouts()), strict=True):
        groups = {"": trajs} if len(envs.streams) == 1 else {"": trajs, **{
            f"{label}/": [t for t in trajs if t.env_name == label] for label in envs.labels}}
        reward_name = "reward" if name == "accuracy" else "greedy_reward"
        values: dict[str, float] = {}
        tool_envs = {s.label for s in envs.streams if s.tools}
        for prefix, group in groups.items():
            n = max(len(group), 1)
            values[prefix + name] = sum(passed(t) for t in group) / n
            values[prefix + reward_name] = sum(t.reward for t in group if not t.failed) / n
            if any(t.env_name in tool_envs or t.tool_log for t in group):
                rate = "tool_call_rate" if name == "accuracy" else "greedy_tool_call_rate"
                values[prefix + rate] = sum(t.tool_calls > 0 for t in group if not t.failed) / n
        logger.log_eval(step, name, values, trajs)
        results.update(values)
    return results
