"""RL algorithms as pure torch functions: advantages, policy losses, aggregation, KL, importance weights.

Batch layout (see ``trainer.batching.to_padded``): token tensors are (B, T), right-padded and aligned with
``input_ids``; ``mask`` (B, T) is 1 on model-sampled response tokens (the loss mask) and 0 on prompt, env tokens
and padding. Per-sequence values are (B,). ``group_ids`` (B,) long: rollouts of the same prompt share an index.

Token tensors must be finite everywhere, padding included (``model_logprobs`` puts 0 there): masking selects with
``torch.where`` so junk values never leak into a result, but a NaN upstream of a masked op still poisons gradients.

Sequence-level advantages are (B,); the caller broadcasts them over tokens (``adv[:, None] * mask``). Policy losses
return an unreduced per-token loss (B, T) plus per-token diagnostics; ``aggregate`` reduces it to a scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3"]
AdvantageFn = Callable[[Tensor, Tensor], Tensor]
PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]
"""``(logprobs, old_logprobs, advantages (B, T), mask) -> (loss (B, T), diagnostics)``: see :func:`policy_loss`."""


# ----------------------------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is nonzero (0/1 mask); positions with mask 0 are never read."""
    picked = torch.where(mask.bool(), x, torch.zeros_like(x))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero; 0 (not NaN) where there are none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Advantages: per-sequence rewards (B,) -> advantages (B,); GAE is per token
# ----------------------------------------------------------------------------------------------------------------


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group sum, group mean), each (B,), for arbitrary integer ``group_ids``."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) in [0, G)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards))  # (G,)
    total = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)  # (G,)
    return size[inverse], total[inverse], (total / size)[inverse]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True, unbiased: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i - mean(r_group)) / std(r_group).

    ``std`` is the sample std (Bessel, n-1) by default, as in the TRL and verl GRPO implementations; a group of one
    has std 0. ``eps`` is added to the std, so an all-equal group gives exactly 0 (not NaN). (B,) -> (B,)
    """
    rewards = _as_float(rewards)
    size, _, mean = _group_stats(rewards, group_ids)  # (B,) each
    centered = rewards - mean  # (B,)
    if not scale_by_std:
        return centered
    _, sq_total, _ = _group_stats(centered.square(), group_ids)  # (B,) sum of squared deviations per group
    denom = (size - 1).clamp(min=1) if unbiased else size
    std = (sq_total / denom).sqrt()  # (B,)
    return centered / (std + eps)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3): A_i = r_i - mean(r_group), no std.

    (B,) -> (B,)
    """
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024, eq. 6): A_i = r_i - mean_{j != i} r_j over the group; groups of one get 0.

    Equals n/(n-1) * (r_i - mean(r_group)). (B,) -> (B,)
    """
    rewards = _as_float(rewards)
    size, total, _ = _group_stats(rewards, group_ids)  # (B,) each
    others_mean = (total - rewards) / (size - 1).clamp(min=1)  # (B,)
    return torch.where(size > 1, rewards - others_mean, torch.zeros_like(rewards))


def reinforce_pp_advantages(rewards: Tensor, *, group_ids: Tensor | None = None, mask: Tensor | None = None,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu 2025, eq. 9): A_i = (r_i - mean_batch) / std_batch, normalized over the whole batch.

    The paper's KL-in-reward term is left out (KL belongs to the loss here: ``kl_penalty``); with it gone and
    gamma = 1 every token's return equals the sequence reward, so the per-token whitening reduces to this.
    ``mask`` (B, T): weight each sequence by its number of model tokens, i.e. whiten over tokens as the paper's
    OpenRLHF implementation does; None: over sequences. ``group_ids``: subtract the group mean first
    (REINFORCE++-baseline, same paper). Batch std is the population std (n), as in OpenRLHF. (B,) -> (B,)
    """
    rewards = _as_float(rewards)
    if group_ids is not None:
        rewards = dr_grpo_advantages(rewards, group_ids)  # (B,)
    weight = torch.ones_like(rewards) if mask is None else mask.bool().sum(-1).to(rewards.dtype)  # (B,)
    total = weight.sum().clamp(min=1)
    mean = (weight * rewards).sum() / total
    std = ((weight * (rewards - mean).square()).sum() / total).sqrt()
    return (rewards - mean) / (std + eps)


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, eq. 16): A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.

    The time steps are the model tokens (mask 1) of each row only: prompt, env tokens and padding are skipped, so
    in a multi-turn row the last token of turn k bootstraps from the first token of turn k+1 (one step, one gamma)
    and the env observation in between is part of the transition, not a step. A reward placed on a skipped token
    is credited to the nearest model token before it (the action that caused it); rewards before the first model
    token are dropped. The value after a row's last model token is 0 (episode end).
    Returns (advantages, returns), each (B, T), 0 where mask is 0, no gradient; returns = advantages + values.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError("token_rewards, values and mask must all be (B, T)")
    with torch.no_grad():
        live = mask.bool()  # (B, T)
        rewards = _as_float(token_rewards)
        values = values.to(rewards.dtype)
        advantages = torch.zeros_like(rewards)  # (B, T)
        next_value = rewards.new_zeros(rewards.shape[0])  # (B,) V of the next model token
        next_adv = rewards.new_zeros(rewards.shape[0])  # (B,) A of the next model token
        pending = rewards.new_zeros(rewards.shape[0])  # (B,) rewards seen on skipped tokens after this one
        for t in reversed(range(rewards.shape[1])):
            m = live[:, t]  # (B,)
            r = rewards[:, t] + pending  # (B,)
            delta = r + gamma * next_value - values[:, t]
            adv = delta + gamma * lam * next_adv
            advantages[:, t] = torch.where(m, adv, torch.zeros_like(adv))
            next_adv = torch.where(m, adv, next_adv)
            next_value = torch.where(m, values[:, t], next_value)
            pending = torch.where(m, torch.zeros_like(r), r)
        returns = torch.where(live, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": lambda rewards, group_ids: reinforce_pp_advantages(rewards),
    "reinforce_pp_baseline": lambda rewards, group_ids: reinforce_pp_advantages(rewards, group_ids=group_ids),
}
"""Sequence-level estimators, uniform signature ``(rewards (B,), group_ids (B,)) -> advantages (B,)``."""


# ----------------------------------------------------------------------------------------------------------------
# Policy losses: per-token loss (B, T) + per-token diagnostics; reduce with ``aggregate``
# ----------------------------------------------------------------------------------------------------------------


def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages_tok: Tensor, *, clip_low: float,
                      clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), loss = -min(rho A, clip(rho, 1-eps_lo, 1+eps_hi) A).

    Decoupled clip range from DAPO (Yu et al. 2025, "clip-higher", eq. 10). ``dual_clip`` c > 1 (Ye et al. 2020,
    eq. 5): for A < 0 the loss is further capped at c |A|. Diagnostics (detached, 0/1 float unless noted):
    ``ratio``; ``clipped`` where the clip branch is active (zero gradient), split into ``clipped_low`` (rho below
    the range) and ``clipped_high``; ``dual_clipped`` where the dual cap is active. All (B, T).
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    pg_unclipped = -advantages_tok * ratio  # (B, T)
    pg_clipped = -advantages_tok * ratio.clamp(1 - clip_low, 1 + clip_high)  # (B, T)
    loss = torch.maximum(pg_unclipped, pg_clipped)  # (B, T) pessimistic bound
    clipped = pg_clipped > pg_unclipped  # (B, T)
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -advantages_tok * dual_clip  # (B, T) = c |A| where A < 0
        dual_clipped = (advantages_tok < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    with torch.no_grad():
        diag = {
            "ratio": ratio.detach(),
            "clipped": clipped.to(ratio.dtype),
            "clipped_low": (clipped & (ratio < 1)).to(ratio.dtype),
            "clipped_high": (clipped & (ratio > 1)).to(ratio.dtype),
            "dual_clipped": dual_clipped.to(ratio.dtype),
        }
    return loss, diag


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages_seq: Tensor, mask: Tensor, *,
              clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), GSPO-token form (eq. 13-14), returned per token (B, T).

    s_i = exp(mean_t (logp_it - old_it)) over row i's model tokens (eq. 7); s_it = sg[s_i] * p_it / sg[p_it], whose
    value is s_i and whose gradient w.r.t. logp_it is s_i. Every token of row i carries the sequence loss
    -min(s_i A_i, clip(s_i, 1-eps_lo, 1+eps_hi) A_i), so ``aggregate(loss, mask, "seq-mean-token-mean")`` is exactly
    the GSPO objective (mean over sequences), and its gradient equals GSPO's: s_i A_i / |y_i| * grad logp_it.
    ("token-mean" would weight sequences by length instead.) Positions with mask 0 hold the same value; aggregate
    drops them.
    ``advantages_seq`` (B,), or (B, T) for per-token advantages as GSPO-token allows. Diagnostics (detached, B, T):
    ``ratio`` (s_i broadcast), ``clipped``, ``clipped_low``, ``clipped_high``.
    """
    adv = advantages_seq[:, None] if advantages_seq.dim() == 1 else advantages_seq  # (B, 1) or (B, T)
    log_seq_ratio = masked_mean(logprobs - old_logprobs, mask, dim=-1)  # (B,)
    seq_ratio = torch.exp(log_seq_ratio).detach()[:, None]  # (B, 1) sg[s_i]
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())  # (B, T) value s_i, d/dlogp_it = s_i
    pg_unclipped = -adv * ratio  # (B, T)
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # (B, T)
    loss = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    with torch.no_grad():
        clipped = pg_clipped > pg_unclipped
        seq = seq_ratio.expand_as(loss)
        diag = {
            "ratio": seq.clone(),
            "clipped": clipped.to(loss.dtype),
            "clipped_low": (clipped & (seq < 1)).to(loss.dtype),
            "clipped_high": (clipped & (seq > 1)).to(loss.dtype),
        }
    return loss, diag


def policy_loss(kind: str, *, clip_low: float, clip_high: float, dual_clip: float | None = None) -> PolicyLoss:
    """The policy loss ``kind`` with its clip range, built once: ppo (:func:`clipped_surrogate`, token ratios; the
    mask is applied by :func:`aggregate`) or gspo (:func:`gspo_loss`, sequence ratios; no dual clip)."""
    if kind == "ppo":
        return lambda logprobs, old_logprobs, advantages, mask: clipped_surrogate(
            logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    if kind == "gspo":
        return lambda logprobs, old_logprobs, advantages, mask: gspo_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    raise ValueError(f"unknown policy loss {kind!r}: ppo or gspo")


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float | None = 0.2) -> Tensor:
    """PPO's clipped value loss (Schulman et al. 2017; as in OpenAI baselines ppo2), per token (B, T):
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2); ``clip=None`` gives plain 0.5 (V - R)^2."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries (PPO's advantage normalization); 0 where mask is 0."""
    live = mask.bool()
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    return torch.where(live, (x - mean) / (var.sqrt() + eps), torch.zeros_like(x))


# ----------------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------------


def aggregate(loss_tok: Tensor, mask: Tensor, mode: AggMode, *, max_tokens: int | None = None) -> Tensor:
    """Reduce a per-token (B, T) loss to a scalar over the masked tokens.

    - ``token-mean``: sum over all masked tokens / their count (DAPO, Yu et al. 2025, eq. 12).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's masked mean (GRPO, Shao et al. 2024, eq. 3).
    - ``seq-mean-token-sum-norm``: each sequence's masked sum / ``max_tokens`` (a constant), mean over sequences
      (Dr. GRPO, Liu et al. 2025, eq. 3).
    Sequences without masked tokens are left out of the sequence means; an empty batch gives 0, never NaN.
    """
    if loss_tok.shape != mask.shape or loss_tok.dim() != 2:
        raise ValueError(f"loss_tok and mask must both be (B, T), got {tuple(loss_tok.shape)}, {tuple(mask.shape)}")
    if mode == "token-mean":
        return masked_mean(loss_tok, mask)
    has_tokens = mask.bool().any(-1)  # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_tok, mask, dim=-1)  # (B,)
    elif mode == "seq-mean-token-sum-norm":
        if max_tokens is None or max_tokens <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive max_tokens")
        per_seq = masked_sum(loss_tok, mask, dim=-1) / max_tokens  # (B,)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    return masked_mean(per_seq, has_tokens)


# ----------------------------------------------------------------------------------------------------------------
# KL, importance weights, diagnostics
# ----------------------------------------------------------------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimator of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence").

    k1 = logp - ref (unbiased, can be < 0); k2 = (logp - ref)^2 / 2 (biased, low variance); k3 = exp(ref - logp)
    - (ref - logp) - 1 (unbiased, >= 0; the GRPO KL, Shao et al. 2024, eq. 4). (B, T) -> (B, T)
    """
    log_ratio = logprobs - ref_logprobs  # (B, T) log pi / pi_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}")


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, *, cap: float = 2.0) -> Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training"): w = min(pi_train_old / pi_rollout, cap), detached, (B, T); multiply the per-token loss by it."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


@torch.no_grad()
def logprob_mismatch_stats(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Trainer-vs-sampler logprob gap over masked tokens, for logging: ``mean_abs_diff``, ``max_abs_diff`` and
    ``max_ratio`` = exp(max |delta|), the largest per-token probability ratio either way. Zeros (ratio 1) if empty."""
    live = mask.bool()  # (B, T)
    if not live.any():
        return {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "max_ratio": 1.0}
    abs_diff = (trainer_logprobs - rollout_logprobs).abs()[live]  # (N,) masked tokens
    max_abs = abs_diff.max()
    return {"mean_abs_diff": float(abs_diff.mean()), "max_abs_diff": float(max_abs), "max_ratio": float(max_abs.exp())}


@torch.no_grad()
def clip_fraction(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, clip_low: float,
                  clip_high: float) -> Tensor:
    """Fraction of masked tokens whose ratio lies outside [1 - clip_low, 1 + clip_high] (CleanRL's clipfrac,
    whatever the advantage sign). Scalar."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)  # (B, T)
    return masked_mean(outside.to(ratio.dtype), mask)


@torch.no_grad()
def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """CleanRL's approx_kl = mean((ratio - 1) - log ratio) over masked tokens (the k3 estimator of
    KL(pi_old || pi) from samples of pi_old). Scalar."""
    log_ratio = logprobs - old_logprobs  # (B, T)
    return masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask)
