"""The RL loop, top to bottom. One training step:

    starts     = next prompts_per_step episode starts, split among the run's envs by weight (trainer/sources.py)
    trajs      = generator.generate(env, starts, n=samples_per_prompt)   rank 0, on the inference engine
                 (with seats: every seat's player at once, trainer/seated_run.py)
    for each of the run's policies (one; with seats, one per policy a seat names):
        trajs      = the ones it played (its seats'); drop failed rollouts (counted), drop zero-variance groups
        advantages = ADVANTAGES[algorithm](rewards, groups)                one scalar per rollout
                     (PPO: GAE per token from the value head's values before the update)
        for each mini-batch (epochs × batch / mini_batch_size):
            for each micro-batch (token budget):
                logprobs = policy(tokens)                                  trainer's logprobs, with grad
                loss     = policy_loss(logprobs, old, A) · TIS + kl_coef·KL − entropy_coef·H (+ vf_coef·value_loss)
                backward(loss · share of the mini-batch)
            optimizer step
    weights v(step+1) → each policy's engine                               from memory, or a checkpoint

What the update follows per token is the stage's :class:`~trainer.objective.Objective`, picked once: the env's
reward (RL), or a teacher's signal mixed in (``stages=[distill]``: trainer/distill.py).

The rollouts come from a source picked once (trainer/rollout_source.py): rank 0's generates them each step
(``trainer.mode=sync``), or while the step before trains, at most ``trainer.max_staleness`` weight versions behind
(``async``); ranks above 0 receive rank 0's. The step reads the same in every mode and on every rank.

With N ranks (torchrun, or Ray actors: trainer/placement) every rank trains on its slice of each mini-batch, and FSDP
averages gradients; losses are scaled so the result equals the single-rank loss on the whole mini-batch. Rank 0's
placement supplies the engine (one server, or replicas behind a router) and each rollout's env (made here, or in an
env worker).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

import trainer.algorithms as algo
from envkit import tracing
from generators import Trajectory
from trainer.async_rollouts import LoopThread
from trainer.backends import make_backend
from trainer.backends.base import Batch, TrainBackend
from trainer.batching import StepBatch, micro_batches, mini_batch_order, stack_rows, to_padded
from trainer.config import Config
from trainer.distributed import all_reduce_values, broadcast_from_rank0, max_over_ranks
from trainer.objective import Objective
from trainer.placement import make_placement
from trainer.policy import Policy
from trainer.rollout_source import PolicyStep, rollout_source
from trainer.runs import Run, open_run
from trainer.seated_run import main_run
from trainer.sources import flat_groups

__all__ = ["StepBatch", "prepare_batch", "train", "update_policy"]

REWARD = Objective()
"""RL's objective: the env's reward alone."""


def train(cfg: Config, *, evaluate_before: bool = True,
          objective: Callable[[Run], Objective] = lambda run: REWARD) -> dict[str, Any]:
    """Run ``cfg.trainer.steps`` training steps; returns the final metrics (held-out accuracy before/after) and the
    final weights' dir. ``evaluate_before=False`` skips the evaluation of the initial policy (a later stage's, which
    the stage before it evaluated last). ``objective(run)`` is what the update follows (RL's by default); it is made
    before anything starts, so a wrong teacher fails first."""
    run = open_run(cfg, placement=make_placement, main=main_run(cfg),
                   runner=LoopThread if cfg.trainer.mode == "async" else asyncio.Runner)
    source = rollout_source(run)
    try:
        goal = objective(run)
        policies = run.policies(lambda weights: make_backend(cfg, weights))
        run.start()
        state = run.resume(policies, total_steps=cfg.trainer.steps, stage=goal.stage)
        results = run.results_before(state, evaluate_before=evaluate_before)
        source.start(state)
        while state.step < cfg.trainer.steps:
            t_step = t0 = time.perf_counter()
            trajs, stale = source.next(state)
            trajs = broadcast_from_rank0(trajs)  # ranks > 0 get rank 0's rollouts
            t1 = time.perf_counter()
            with tracing.span("update", root=True, step=state.step + 1, rollouts=len(trajs)):
                steps = [_update(policy, policy.plays(trajs), stale, cfg, run, goal) for policy in policies]
            t2 = time.perf_counter()
            state.step = state.policy_version = state.step + 1
            with tracing.span("weight_sync", root=True, step=state.step, weight_version=state.policy_version):
                from_memory = source.serve(policies, state.policy_version)
            t3 = time.perf_counter()
            # The step's metrics before its checkpoint: a run killed between the two resumes from the checkpoint
            # before and logs the step again (the last row of a step counts); the other way round, a run killed
            # there would resume past a step whose metrics were never written.
            scoring_s = sum(v for step in steps for k, v in step.metrics.items() if k.startswith("time/"))
            source.record_step(state, trajs, steps, {
                "rollout/stale_dropped": stale, "time/generate_s": t1 - t0, "time/train_s": t2 - t1 - scoring_s,
                "time/sync_s": t3 - t2, "weights/from_memory": float(from_memory),
                "time/step_s": time.perf_counter() - t_step})
            if run.due(state, last=state.step == cfg.trainer.steps):
                source.snapshot(state)
                run.save(policies, state)
            run.evaluate_every(state, total_steps=cfg.trainer.steps)
        return run.finish(policies, state, results)
    finally:
        source.close()
        run.close()


def _update(policy: Policy, trajs: list[Trajectory], stale: int, cfg: Config, run: Run,
            goal: Objective) -> PolicyStep:
    """``policy``'s part of a step: its batch of ``trajs``, scored by ``goal`` and trained on."""
    batch = prepare_batch(trajs, cfg, keep_flat=goal.keeps_flat_groups)
    batch.counts["stale_dropped"] = stale
    scored = goal.score(batch)  # its metrics: a teacher's time among them
    trained = update_policy(policy.backend, batch, cfg, run.tokenizer.pad_id, goal)
    return PolicyStep(policy.name, trajs, batch, {**trained, **scored})


# ------------------------------------------------------------------------------------------------- the update


def prepare_batch(trajs: list[Trajectory], cfg: Config, *, keep_flat: bool = False) -> StepBatch:
    """Drop failed rollouts and (optionally) zero-variance groups, which are counted but kept with ``keep_flat``
    (distillation: the teacher grades them); compute one advantage per rollout."""
    counts = Counter(failed=sum(t.failed for t in trajs))
    kept = [t for t in trajs if not t.failed and t.response_ids]
    if cfg.algorithm.filter_zero_variance_groups:
        flat = flat_groups(kept)
        counts["zero_variance_groups"] = len(flat)
        # every rollout passed (solved) or none did: which side of a curriculum's band a step's waste is on
        counts["zero_variance_groups_passed"] = len({t.group_id for t in kept if t.group_id in flat
                                                     and t.reward >= cfg.curriculum.pass_threshold})
        kept = [t for t in kept if keep_flat or t.group_id not in flat]
    group_index = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in kept))}
    rewards = torch.tensor([t.reward for t in kept], dtype=torch.float32)  # (B,)
    groups = torch.tensor([group_index[t.group_id] for t in kept], dtype=torch.long)  # (B,)
    if kept and not cfg.algorithm.critic:
        advantages = algo.ADVANTAGES[cfg.algorithm.advantage](rewards, groups)
    else:  # GAE needs the critic's values: update_policy computes it per token
        advantages = torch.zeros_like(rewards)
    counts["trained"] = len(kept)
    # an agent's episode may hold several token sequences (generators/gateway/): each trains with its advantage
    rows = [(sequence, i) for i, t in enumerate(kept) for sequence in t.sequences()]
    return StepBatch([sequence for sequence, _ in rows], advantages[[i for _, i in rows]], dict(counts))


def update_policy(backend: TrainBackend, batch: StepBatch, cfg: Config, pad_id: int,
                  objective: Objective = REWARD) -> dict[str, float]:
    """The optimizer steps of one training step, following ``objective`` (RL's by default); returns averaged
    diagnostics."""
    if not batch.trajectories:
        return {"train/skipped_update": 1.0}
    n = len(batch.trajectories)
    mini = max(1, round(cfg.mini_batch_size * n / cfg.generator.batch_size))  # filtering shrinks the batch
    order = mini_batch_order(batch.trajectories, share_prompt=cfg.trainer.shares_prompts)
    update = _Update(backend, batch, cfg, pad_id, objective)
    stats: dict[str, list[float]] = {}
    for _epoch in range(cfg.trainer.epochs):
        for start in range(0, n, mini):
            for key, value in update.mini_batch(order[start:start + mini]).items():
                _add(stats, key, value)
            step = backend.step()
            _add(stats, "train/grad_norm", step.grad_norm)
            _add(stats, "train/lr", step.lr)
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    for key in ("mismatch/max_ratio", "mismatch/max_abs_diff"):
        out[key] = max(stats[key])
    return out


class _Update:
    """One training step's update: what every mini-batch of it shares (the logprobs and values before it, the
    critic's targets, the loss), and the gradient of one mini-batch."""

    def __init__(self, backend: TrainBackend, batch: StepBatch, cfg: Config, pad_id: int,
                 objective: Objective) -> None:
        a = cfg.algorithm
        self.backend, self.batch, self.cfg, self.pad_id, self.objective = backend, batch, cfg, pad_id, objective
        # Several updates per batch: the ratio needs the logprobs of the policy before the first of them. A critic's
        # values before the update give GAE its advantages and the value loss its clipping anchor.
        self.before = _before_update(backend, batch, cfg, pad_id) if cfg.steps_per_update > 1 or a.critic else None
        self.targets = _gae_targets(batch, self.before, cfg, pad_id) if a.critic and self.before is not None else None
        self.policy_loss = algo.policy_loss(a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high,
                                            dual_clip=a.dual_clip)

    def mini_batch(self, index: list[int]) -> dict[str, float]:
        """Accumulate the gradient of the mini-batch ``index`` (this rank's slice of it); its diagnostics, averaged
        over every rank's micro-batches."""
        backend = self.backend
        # This rank's slice; FSDP averages gradients over ranks, so scale each rank's share by world size.
        mine = index[backend.rank::backend.world_size]
        micro = list(_micro_batches(mine, self.batch, self.cfg, self.pad_id))
        totals = _global_counts([mb for mb, _ in micro])
        # Every forward/backward is a collective (FSDP all-gathers, ZeRO reduces): all ranks must run the same
        # number, so a rank with fewer micro-batches repeats its first one with zero weight.
        passes = max_over_ranks(len(micro))
        weighted: dict[str, float] = {}  # share-weighted sums: all-reduced, they are mini-batch means
        peaks: dict[str, float] = {}
        for k in range(passes):
            mb, rows = micro[k] if k < len(micro) else micro[0]
            share = _share(mb["loss_mask"], totals, self.cfg) * (1.0 if k < len(micro) else 0.0)
            loss = self.loss(mb, rows, share, weighted, peaks)
            backend.backward(loss * share * backend.world_size, last=k == passes - 1)
        return {**all_reduce_values(weighted), **all_reduce_values(peaks, max)}

    def loss(self, mb: Batch, rows: list[int], share: float, weighted: dict[str, float], peaks: dict[str, float]
             ) -> torch.Tensor:
        """The micro-batch's loss: the policy loss on the objective's per-token advantages, with the terms the
        algorithm adds (TIS, KL, entropy, value loss); its diagnostics added into ``weighted`` and ``peaks``."""
        a = self.cfg.algorithm
        out = self.backend.forward(mb, entropy_grad=a.entropy_coef > 0)
        logprobs, entropy, mask = out.logprobs, out.entropy, mb["loss_mask"]  # (B, T) each
        # One update per batch: the policy that sampled is the one being trained, so old = current.
        old = logprobs.detach() if self.before is None else stack_rows(self.before["logprobs"], rows, logprobs.shape)
        adv_tok = (self.batch.advantages[rows][:, None].expand_as(logprobs) if self.targets is None
                   else stack_rows(self.targets["advantages"], rows, logprobs.shape))
        adv_tok, diagnostics = self.objective.token_advantages(adv_tok, rows, mb)
        loss_tok, diag = self.policy_loss(logprobs, old, adv_tok, mask)
        terms: dict[str, torch.Tensor | float] = {key: algo.masked_mean(value, mask)
                                                   for key, value in diagnostics.items()}
        loss_tok = self._penalized(loss_tok * self._tis(old, mb), logprobs, entropy, out.values, mb, rows, terms)
        loss = algo.aggregate(loss_tok, mask, a.aggregation, max_tokens=self.cfg.generator.max_total_tokens)
        terms.update({"train/loss": loss.detach(), "train/entropy": algo.masked_mean(entropy.detach(), mask),
                      "train/clip_fraction": algo.masked_mean(diag["clipped"].float(), mask)})
        mismatch = algo.logprob_mismatch_stats(old.detach(), mb["rollout_logprobs"], mask)
        terms["mismatch/mean_abs_diff"] = mismatch["mean_abs_diff"]
        for key, value in terms.items():
            _accumulate(weighted, key, value, share)
        for key in ("max_abs_diff", "max_ratio"):
            peaks[f"mismatch/{key}"] = max(peaks.get(f"mismatch/{key}", 0.0), mismatch[key])
        return loss

    def _tis(self, old: torch.Tensor, mb: Batch) -> torch.Tensor | float:
        """Truncated importance weights correcting the sampler/trainer logprob mismatch (vLLM bf16 vs ours), or 1."""
        cap = self.cfg.algorithm.tis_cap
        return 1.0 if cap is None else algo.tis_weights(old, mb["rollout_logprobs"], cap=cap)

    def _penalized(self, loss_tok: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor,
                   values: torch.Tensor | None, mb: Batch, rows: list[int], terms: dict[str, torch.Tensor | float]
                   ) -> torch.Tensor:
        """``loss_tok`` with the per-token terms the algorithm adds (KL to the reference, the entropy bonus, the
        critic's value loss), their means noted in ``terms``."""
        a, mask = self.cfg.algorithm, mb["loss_mask"]
        if a.kl_coef > 0:
            kl = algo.kl_penalty(logprobs, self.backend.logprobs(mb, reference=True), a.kl_kind)
            loss_tok = loss_tok + a.kl_coef * kl
            terms["train/kl"] = algo.masked_mean(kl.detach(), mask)
        if a.entropy_coef > 0:
            loss_tok = loss_tok - a.entropy_coef * entropy
        if self.targets is not None and self.before is not None:
            value_loss = algo.value_loss(values, stack_rows(self.before["values"], rows, logprobs.shape),
                                         stack_rows(self.targets["returns"], rows, logprobs.shape), clip=a.value_clip)
            loss_tok = loss_tok + a.vf_coef * value_loss
            terms["train/value_loss"] = algo.masked_mean(value_loss.detach(), mask)
        return loss_tok


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


def _add(stats: dict[str, list[float]], key: str, value: float | torch.Tensor) -> None:
    stats.setdefault(key, []).append(float(value))
