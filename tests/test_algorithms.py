"""trainer.algorithms against hand-computed values, autograd checks and seeded property checks."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    aggregate,
    approx_kl,
    clip_fraction,
    clipped_surrogate,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    gspo_loss,
    kl_penalty,
    logprob_mismatch_stats,
    masked_mean,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    tis_weights,
    value_loss,
    whiten,
)

D = torch.float64


def t(*rows, dtype=D) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=dtype)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


REWARDS = t([1, 0, 0, 1, 1, 1, 1, 1])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


# ---------------------------------------------------------------------------------------------------- advantages


def test_grpo_hand_computed():
    # group 0 [1,0,0,1]: mean 0.5, deviations ±0.5, sample var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    #   -> ±0.5 / (0.5773503 + 1e-6) = ±0.8660239
    # group 1 [1,1,1,1]: all equal -> 0 / (0 + eps) = 0, not NaN
    adv = grpo_advantages(REWARDS, GROUPS)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])
    # population std: var = 1/4, std = 0.5 -> ±0.5 / 0.500001
    b = 0.5 / (0.5 + 1e-6)
    close(grpo_advantages(REWARDS, GROUPS, unbiased=False), [b, -b, -b, b, 0, 0, 0, 0])
    close(grpo_advantages(REWARDS, GROUPS, scale_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_singleton_group_and_arbitrary_ids():
    # group ids need not be contiguous or sorted; a group of one has std 0 and advantage 0
    rewards = t([3.0, 1.0, 5.0, 0.0])
    ids = torch.tensor([42, 7, 99, 42])  # groups {42: [3, 0]}, {7: [1]}, {99: [5]}
    # group 42: mean 1.5, deviations ±1.5, sample var = 2 * 2.25 / 1 = 4.5, std = 2.1213203 -> ±0.7071065
    a = 1.5 / (math.sqrt(4.5) + 1e-6)
    adv = grpo_advantages(rewards, ids)
    close(adv, [a, 0, 0, -a])
    assert torch.isfinite(adv).all()


def test_dr_grpo_hand_computed():
    # group mean baseline, no std: group 0 mean 0.5, group 1 mean 1
    close(dr_grpo_advantages(REWARDS, GROUPS), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # integer rewards are promoted to float
    close(dr_grpo_advantages(torch.tensor([2, 0]), torch.tensor([0, 0])), [1.0, -1.0])


def test_rloo_hand_computed():
    # group 0 [1,0,0,1]: r=1 -> 1 - (0+0+1)/3 = 2/3 ; r=0 -> 0 - (1+0+1)/3 = -2/3 ; group 1 all equal -> 0
    close(rloo_advantages(REWARDS, GROUPS), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    # group of one -> 0 ; group {0: [2, 4, 9]}: 2 - 6.5 = -4.5, 4 - 5.5 = -1.5, 9 - 3 = 6
    close(rloo_advantages(t([2.0, 5.0, 4.0, 9.0]), torch.tensor([0, 1, 0, 0])), [-4.5, 0, -1.5, 6])


def test_reinforce_pp_hand_computed():
    # batch [2, 0, 1, 1]: mean 1, deviations [1, -1, 0, 0], population var = 2/4 = 0.5, std = 0.7071068
    s = 1 / (math.sqrt(0.5) + 1e-6)
    close(reinforce_pp_advantages(t([2.0, 0.0, 1.0, 1.0])), [s, -s, 0, 0])
    # normalization is global, not per group: groups do not matter
    close(ADVANTAGES["reinforce_pp"](t([2.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])), [s, -s, 0, 0])


def test_reinforce_pp_token_weighted():
    # rewards [1, 0] over 3 and 1 model tokens: weighted mean = 3/4 = 0.75
    # var = (3 * 0.25^2 + 1 * 0.75^2) / 4 = (0.1875 + 0.5625) / 4 = 0.1875, std = 0.4330127
    mask = t([0, 1, 1, 1], [0, 1, 0, 0])
    std = math.sqrt(0.1875) + 1e-6
    close(reinforce_pp_advantages(t([1.0, 0.0]), mask=mask), [0.25 / std, -0.75 / std])


def test_reinforce_pp_baseline():
    # group means subtracted first: [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]; batch mean 0,
    # population var = 4 * 0.25 / 8 = 0.125, std = 0.3535534 -> ±0.5 / 0.3535544 = ±1.4142096
    a = 0.5 / (math.sqrt(0.125) + 1e-6)
    close(ADVANTAGES["reinforce_pp_baseline"](REWARDS, GROUPS), [a, -a, -a, a, 0, 0, 0, 0])


def test_advantage_registry_uniform():
    assert set(ADVANTAGES) >= {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    for name, fn in ADVANTAGES.items():
        adv = fn(REWARDS, GROUPS)
        assert adv.shape == (8,), name
        assert torch.isfinite(adv).all(), name


def test_group_advantages_properties():
    torch.manual_seed(0)
    for _ in range(20):
        b = int(torch.randint(2, 40, ()))
        ids = torch.randint(0, 5, (b,))
        rewards = torch.randn(b, dtype=D)
        for fn in (dr_grpo_advantages, rloo_advantages, grpo_advantages):
            adv = fn(rewards, ids)
            for g in ids.unique():
                close(adv[ids == g].sum(), 0.0, atol=1e-9)  # zero-sum within each group
        sizes = (ids[:, None] == ids[None, :]).sum(1).to(D)  # (B,) group size per sample
        factor = torch.where(sizes > 1, sizes / (sizes - 1).clamp(min=1), torch.zeros_like(sizes))
        close(rloo_advantages(rewards, ids), factor * dr_grpo_advantages(rewards, ids), atol=1e-9)
        # permuting the batch permutes the advantages
        perm = torch.randperm(b)
        close(grpo_advantages(rewards[perm], ids[perm]), grpo_advantages(rewards, ids)[perm], atol=1e-9)
        # REINFORCE++ output is whitened over the batch
        adv = reinforce_pp_advantages(rewards)
        close(adv.mean(), 0.0, atol=1e-9)
        close(adv.std(unbiased=False), 1.0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------- GAE


def test_gae_hand_computed_with_env_tokens():
    # row 0: [prompt, m, m, env, env, m, pad]; values on skipped tokens are junk (9) and must be ignored
    # model steps: k1 = pos1 (V .5), k2 = pos2 (V .6), k3 = pos5 (V .4, r 1); gamma .9, lam .8, gamma*lam = .72
    #   delta3 = 1 + .9*0 - .4 = .6                        A3 = .6
    #   delta2 = 0 + .9*.4 - .6 = -.24                     A2 = -.24 + .72*.6 = .192
    #   delta1 = 0 + .9*.6 - .5 = .04                      A1 = .04 + .72*.192 = .17824
    #   returns = A + V: .67824, .792, 1.0
    # row 1: no model tokens at all -> zeros
    mask = t([0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0])
    values = t([9, 0.5, 0.6, 9, 9, 0.4, 9], [9, 9, 9, 9, 9, 9, 9])
    rewards = t([0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 5])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0, 0.17824, 0.192, 0, 0, 0.6, 0], [0] * 7])
    close(ret, [[0, 0.67824, 0.792, 0, 0, 1.0, 0], [0] * 7])
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_reward_on_env_token_credits_previous_model_token():
    # same row, plus 0.5 on the env token at pos3 -> credited to pos2 (the action before it):
    #   delta2 = .5 + .9*.4 - .6 = .26                     A2 = .26 + .72*.6 = .692
    #   delta1 = .04                                       A1 = .04 + .72*.692 = .53824
    mask = t([[0, 1, 1, 0, 0, 1, 0]])
    values = t([[9, 0.5, 0.6, 9, 9, 0.4, 9]])
    rewards = t([[0, 0, 0, 0.5, 0, 1, 0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0, 0.53824, 0.692, 0, 0, 0.6, 0]])
    # a reward on trailing padding goes to the last model token; one on the prompt is dropped
    adv2, _ = gae_advantages(t([[3, 0, 0, 0, 0, 0, 1]]), values, mask, gamma=0.9, lam=0.8)
    close(adv2, adv.new_tensor([[0, 0.17824, 0.192, 0, 0, 0.6, 0]]))


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    torch.manual_seed(1)
    b, n = 4, 12
    mask = (torch.rand(b, n) < 0.6).to(D)
    rewards = torch.randn(b, n, dtype=D) * mask
    values = torch.randn(b, n, dtype=D)
    adv, ret = gae_advantages(rewards, values, mask)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{j >= t} r_j
    close(adv, (to_go - values) * mask, atol=1e-9)
    close(ret, to_go * mask, atol=1e-9)
    # padding invariance: extra zero-mask columns change nothing
    pad = torch.zeros(b, 5, dtype=D)
    adv_p, _ = gae_advantages(torch.cat([rewards, pad], 1), torch.cat([values, pad + 7], 1),
                              torch.cat([mask, pad], 1), gamma=0.95, lam=0.9)
    adv_0, _ = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    close(adv_p[:, :n], adv_0, atol=1e-12)


# ---------------------------------------------------------------------------------------------- policy losses


RATIOS = [0.5, 0.9, 1.1, 1.5]


def _surrogate(ratios, adv, **kw):
    logprobs = torch.log(t([ratios])).requires_grad_()
    loss, diag = clipped_surrogate(logprobs, torch.zeros_like(logprobs), t([adv]), **kw)
    loss.sum().backward()
    return loss.detach()[0], diag, logprobs.grad[0]


def test_clipped_surrogate_positive_advantage():
    # A = +1, range [0.8, 1.28]: loss = max(-r, -clip(r)) -> r=.5: max(-.5, -.8) = -.5 (not clipped, A>0 low ratio)
    # r=.9, 1.1 inside -> -r ; r=1.5: max(-1.5, -1.28) = -1.28 (clipped high, zero gradient)
    loss, diag, grad = _surrogate(RATIOS, [1.0] * 4, clip_low=0.2, clip_high=0.28)
    close(loss, [-0.5, -0.9, -1.1, -1.28])
    close(diag["clipped"][0], [0, 0, 0, 1])
    close(diag["clipped_high"][0], [0, 0, 0, 1])
    close(diag["clipped_low"][0], [0, 0, 0, 0])
    # d loss / d logp = -A * r where not clipped, 0 where clipped
    close(grad, [-0.5, -0.9, -1.1, 0.0])


def test_clipped_surrogate_negative_advantage():
    # A = -1: loss = max(r, clip(r)) -> r=.5: max(.5, .8) = .8 (clipped low, zero gradient); r=1.5: max(1.5, 1.28)
    # = 1.5 (not clipped: the pessimistic bound keeps the unclipped term)
    loss, diag, grad = _surrogate(RATIOS, [-1.0] * 4, clip_low=0.2, clip_high=0.28)
    close(loss, [0.8, 0.9, 1.1, 1.5])
    close(diag["clipped"][0], [1, 0, 0, 0])
    close(diag["clipped_low"][0], [1, 0, 0, 0])
    close(grad, [0.0, 0.9, 1.1, 1.5])
    close(diag["ratio"][0], RATIOS)


def test_clipped_surrogate_dual_clip():
    # A = -2, c = 3: cap = c |A| = 6. r=5: max(10, 2*1.2) = 10 -> capped at 6 (zero gradient);
    # r=1.5: 3 < 6 stays, gradient -A r = 3 ; A = +2 row is untouched by the dual clip: r=5 -> -2*1.2 = -2.4
    logprobs = torch.log(t([[5.0, 1.5], [5.0, 1.5]])).requires_grad_()
    adv = t([[-2.0, -2.0], [2.0, 2.0]])
    loss, diag = clipped_surrogate(logprobs, torch.zeros_like(logprobs), adv, clip_low=0.2, clip_high=0.2,
                                   dual_clip=3.0)
    loss.sum().backward()
    close(loss.detach(), [[6.0, 3.0], [-2.4, -2.4]])
    close(diag["dual_clipped"], [[1, 0], [0, 0]])
    close(logprobs.grad, [[0.0, 3.0], [0.0, 0.0]])


def test_clipped_surrogate_gradient_random():
    torch.manual_seed(2)
    logprobs = (torch.randn(6, 10, dtype=D) * 0.3).requires_grad_()
    old = torch.randn(6, 10, dtype=D) * 0.3 + logprobs.detach()
    adv = torch.randn(6, 10, dtype=D)
    loss, diag = clipped_surrogate(logprobs, old, adv, clip_low=0.2, clip_high=0.3)
    loss.sum().backward()
    ratio = diag["ratio"]
    clipped = diag["clipped"].bool()
    assert clipped.any() and (~clipped).any()
    close(logprobs.grad[clipped], torch.zeros(int(clipped.sum()), dtype=D))
    close(logprobs.grad[~clipped], (-adv * ratio)[~clipped])
    # clipped exactly where the ratio has left the range in the direction the advantage pushes
    expected = ((adv > 0) & (ratio > 1.3)) | ((adv < 0) & (ratio < 0.8))
    assert torch.equal(clipped, expected)


def test_gspo_hand_computed():
    # clip range [1 - 3e-4, 1 + 4e-4]
    # row 0: mask [1,1,0], log-ratios [2e-4, 4e-4, junk] -> mean 3e-4, s = exp(3e-4) inside -> loss = -A s, A = 2
    # row 1: log-ratios all 1e-3 -> s = exp(1e-3) = 1.0010005 > 1.0004, A = +1 -> clipped: loss = -1.0004
    # row 2: log-ratios all -1e-3 -> s = exp(-1e-3) = 0.9990005 < 0.9997, A = -1 -> clipped: loss = 0.9997
    mask = t([1, 1, 0], [1, 1, 1], [1, 1, 1])
    delta = t([2e-4, 4e-4, 5.0], [1e-3, 1e-3, 1e-3], [-1e-3, -1e-3, -1e-3])
    old = torch.zeros(3, 3, dtype=D)
    logprobs = (old + delta).requires_grad_()
    adv = t([2.0, 1.0, -1.0])
    loss, diag = gspo_loss(logprobs, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    s0 = math.exp(3e-4)
    close(loss.detach(), [[-2 * s0] * 3, [-1.0004] * 3, [0.9997] * 3], atol=1e-9)
    close(diag["ratio"][:, 0], [s0, math.exp(1e-3), math.exp(-1e-3)], atol=1e-12)
    close(diag["clipped"], [[0] * 3, [1] * 3, [1] * 3])
    close(diag["clipped_high"][:, 0], [0, 1, 0])
    close(diag["clipped_low"][:, 0], [0, 0, 1])
    # seq-mean-token-mean gives the GSPO objective: mean_i -min(s_i A_i, clip(s_i) A_i) = (-2 s0 - 1.0004 + .9997)/3
    obj = aggregate(loss, mask, "seq-mean-token-mean")
    close(obj.detach(), (-2 * s0 - 1.0004 + 0.9997) / 3, atol=1e-9)
    # gradient: d obj / d logp_it = -A_i s_i / (|y_i| * 3) on row 0's masked tokens: -2 s0 / 6; clipped rows 0
    obj.backward()
    close(logprobs.grad, [[-2 * s0 / 6, -2 * s0 / 6, 0], [0] * 3, [0] * 3], atol=1e-12)


def test_gspo_gradient_matches_sequence_level_form():
    # GSPO-token's gradient equals the sequence-level GSPO gradient s_i A_i / |y_i| sum_t grad logp_it, at every
    # masked token; compare with autograd through the plain sequence-level objective (no clipping: wide range)
    torch.manual_seed(3)
    b, n = 5, 9
    mask = (torch.rand(b, n) < 0.7).to(D)
    mask[:, 1] = 1
    logprobs = (torch.randn(b, n, dtype=D) * 0.01).requires_grad_()
    old = logprobs.detach() + torch.randn(b, n, dtype=D) * 0.01
    adv = torch.randn(b, dtype=D)
    loss, _ = gspo_loss(logprobs, old, adv, mask, clip_low=0.9, clip_high=10.0)
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    grad_token = logprobs.grad.clone()
    logprobs.grad = None
    s = torch.exp(masked_mean(logprobs - old, mask, dim=-1))  # (B,) full-gradient sequence ratio
    (-(s * adv).mean()).backward()
    close(grad_token, logprobs.grad, atol=1e-12)
    assert (grad_token[mask.bool()] != 0).all()  # flows to every masked token
    assert (grad_token[~mask.bool()] == 0).all()
    # (B, T) constant advantages are the same as (B,)
    loss_tok, _ = gspo_loss(logprobs, old, adv[:, None].expand(b, n), mask, clip_low=0.9, clip_high=10.0)
    close(loss_tok.detach(), loss.detach())


def test_policy_loss_built_once_with_its_clip_range():
    torch.manual_seed(4)
    logprobs = torch.randn(3, 5, dtype=D) * 0.1
    old = logprobs + torch.randn(3, 5, dtype=D) * 0.1
    mask = torch.ones(3, 5, dtype=D)
    adv_tok = torch.randn(3, 1, dtype=D).expand(3, 5)
    ppo, _ = policy_loss("ppo", clip_low=0.05, clip_high=0.08, dual_clip=3.0)(logprobs, old, adv_tok, mask)
    close(ppo, clipped_surrogate(logprobs, old, adv_tok, clip_low=0.05, clip_high=0.08, dual_clip=3.0)[0])
    assert not torch.allclose(ppo, clipped_surrogate(logprobs, old, adv_tok, clip_low=0.2, clip_high=0.2)[0])
    gspo, _ = policy_loss("gspo", clip_low=3e-4, clip_high=1e-3)(logprobs, old, adv_tok, mask)
    close(gspo, gspo_loss(logprobs, old, adv_tok[:, 0], mask, clip_low=3e-4, clip_high=1e-3)[0])
    with pytest.raises(ValueError, match="unknown policy loss 'trpo'"):
        policy_loss("trpo", clip_low=0.2, clip_high=0.2)


# ------------------------------------------------------------------------------------------------- aggregation


LOSS = t([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
MASK = t([1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0])


def test_aggregate_modes_hand_computed():
    # token-mean: (1 + 2 + 5 + 6 + 7) / 5 = 4.2
    close(aggregate(LOSS, MASK, "token-mean"), 4.2)
    # seq-mean-token-mean: row means 1.5 and 6; the fully masked row is left out -> (1.5 + 6) / 2 = 3.75
    close(aggregate(LOSS, MASK, "seq-mean-token-mean"), 3.75)
    # seq-mean-token-sum-norm, max_tokens 4: row sums 3 / 4 = .75 and 18 / 4 = 4.5 -> (0.75 + 4.5) / 2 = 2.625
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_tokens=4), 2.625)
    with pytest.raises(ValueError):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate(LOSS, MASK, "sum")  # type: ignore[arg-type]


def test_aggregate_empty_and_nonfinite_padding():
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate(LOSS, empty, mode, max_tokens=4)
        assert out.item() == 0.0, mode
        # junk (inf) on masked-out positions never leaks into the result
        junk = torch.where(MASK.bool(), LOSS, torch.full_like(LOSS, float("inf")))
        assert torch.isfinite(aggregate(junk, MASK, mode, max_tokens=4)), mode


def test_aggregate_padding_invariance():
    torch.manual_seed(5)
    for _ in range(10):
        b, n, extra = 4, 7, int(torch.randint(1, 6, ()))
        loss = torch.randn(b, n, dtype=D)
        mask = (torch.rand(b, n) < 0.5).to(D)
        padded_loss = torch.cat([loss, torch.randn(b, extra, dtype=D) * 100], 1)
        padded_mask = torch.cat([mask, torch.zeros(b, extra, dtype=D)], 1)
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            close(aggregate(padded_loss, padded_mask, mode, max_tokens=16),
                  aggregate(loss, mask, mode, max_tokens=16), atol=1e-12)


def test_masked_mean():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    m = t([1, 0, 1], [0, 0, 0])
    close(masked_mean(x, m), 2.0)  # (1 + 3) / 2
    close(masked_mean(x, m, dim=-1), [2.0, 0.0])  # empty row -> 0
    close(masked_mean(x, m, dim=0), [1.0, 0.0, 3.0])


# ------------------------------------------------------------------------------------------- KL, TIS, stats


def test_kl_penalty_values():
    logp, ref = t([0.0, -1.0]), t([-1.0, 0.0])
    close(kl_penalty(logp, ref, "k1"), [1.0, -1.0])  # logp - ref
    close(kl_penalty(logp, ref, "k2"), [0.5, 0.5])  # (logp - ref)^2 / 2
    # k3 with x = ref - logp = [-1, 1]: e^-1 + 1 - 1 = 0.3678794 ; e - 1 - 1 = 0.7182818
    close(kl_penalty(logp, ref), [math.exp(-1), math.e - 2])
    torch.manual_seed(6)
    a, b = torch.randn(100, dtype=D), torch.randn(100, dtype=D)
    assert (kl_penalty(a, b, "k3") >= 0).all()
    close(kl_penalty(a, a, "k3"), torch.zeros(100, dtype=D))
    with pytest.raises(ValueError):
        kl_penalty(a, b, "k4")  # type: ignore[arg-type]


def test_tis_weights_cap_and_detached():
    # exp(old - rollout) = [1, 1.5, 3 -> capped at 2, e^-1]
    rollout = torch.zeros(1, 4, dtype=D)
    old = t([[0.0, math.log(1.5), math.log(3.0), -1.0]]).requires_grad_()
    w = tis_weights(old, rollout, cap=2.0)
    close(w, [[1.0, 1.5, 2.0, math.exp(-1)]])
    assert not w.requires_grad


def test_logprob_mismatch_stats():
    # masked |delta| = [0.1, 0.3] (third token masked out, its junk ignored): mean .2, max .3, ratio e^.3 = 1.3498588
    stats = logprob_mismatch_stats(t([[0.0, -1.0, -2.5]]), t([[0.1, -1.3, 0.0]]), t([[1, 1, 0]]))
    assert stats.keys() == {"mean_abs_diff", "max_abs_diff", "max_ratio"}
    assert stats["mean_abs_diff"] == pytest.approx(0.2)
    assert stats["max_abs_diff"] == pytest.approx(0.3)
    assert stats["max_ratio"] == pytest.approx(math.exp(0.3))
    empty = logprob_mismatch_stats(t([[0.0]]), t([[5.0]]), t([[0]]))
    assert empty == {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "max_ratio": 1.0}


def test_clip_fraction_and_approx_kl():
    logprobs = torch.log(t([RATIOS]))
    old = torch.zeros_like(logprobs)
    # range [0.8, 1.28]: 0.5 and 1.5 are outside -> 2 / 4
    close(clip_fraction(logprobs, old, torch.ones_like(old), clip_low=0.2, clip_high=0.28), 0.5)
    # masking out the 1.5 token -> 1 / 3
    close(clip_fraction(logprobs, old, t([[1, 1, 1, 0]]), clip_low=0.2, clip_high=0.28), 1 / 3)
    # approx_kl with ratios [2, 1]: ((2 - 1) - ln 2 + 0) / 2 = (1 - 0.6931472) / 2 = 0.1534264
    close(approx_kl(torch.log(t([[2.0, 1.0]])), torch.zeros(1, 2, dtype=D), torch.ones(1, 2, dtype=D)),
          (1 - math.log(2)) / 2)


def test_value_loss_hand_computed():
    values, old, returns = t([1.5, 0.0, -0.1]), t([1.0, 0.0, 0.0]), t([1.0, 1.0, 0.0])
    # token 0: V moved +0.5 past the 0.2 clip: max((1.5-1)^2, (1.2-1)^2) = 0.25; token 1: 1; token 2: 0.01
    close(value_loss(values, old, returns, clip=0.2), t([0.125, 0.5, 0.005]))
    # moving toward the return by more than the clip: the pessimistic max keeps the clipped error, max(0.25, 0.64)
    close(value_loss(t([1.5]), t([2.0]), t([1.0]), clip=0.2), t([0.32]))
    close(value_loss(values, old, returns, clip=None), t([0.125, 0.5, 0.005]))


def test_whiten_over_masked_entries_only():
    x = t([1.0, 3.0, 100.0], [5.0, 7.0, -50.0])
    mask = t([1, 1, 0], [1, 1, 0])
    out = whiten(x, mask)  # masked entries 1, 3, 5, 7: mean 4, population std sqrt(5)
    close(out, t([-3 / math.sqrt(5), -1 / math.sqrt(5), 0.0], [1 / math.sqrt(5), 3 / math.sqrt(5), 0.0]), atol=1e-6)


def test_gae_credits_each_turn_reward_to_that_turns_last_model_token():
    from generators.trajectory import Trajectory
    from trainer.config import AlgorithmConfig, Config
    from trainer.loop import StepBatch, _gae_targets, turn_rewards

    # prompt of 3 tokens; model turn 1 (2 tokens), env turn (2), model turn 2 (1)
    two_turns = Trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7, 8], loss_mask=[1, 1, 0, 0, 1],
                           rollout_logprobs=[-1.0] * 5, reward=1.0, step_rewards=[0.25, 0.75], num_turns=2)
    assert turn_rewards(two_turns) == [(1, 0.25), (4, 0.75)]
    unpaired = Trajectory(prompt_ids=[1], response_ids=[4, 5], loss_mask=[1, 1], rollout_logprobs=[-1.0] * 2,
                          reward=0.5, step_rewards=[0.2, 0.3], num_turns=2)
    assert turn_rewards(unpaired) == [(1, 0.5)]  # turns and rewards do not pair up: the total on the last token

    cfg = Config(algorithm=AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0))
    batch = StepBatch([two_turns], torch.zeros(1))
    targets = _gae_targets(batch, {"values": {0: torch.zeros(8)}}, cfg, pad_id=0)
    returns = targets["returns"][0]  # (T,) over prompt + response; with V = 0 and γ = λ = 1: reward to go
    assert returns[3:5].tolist() == [1.0, 1.0]  # turn 1 sees both turns' rewards ahead of it
    assert returns[7].item() == 0.75  # turn 2 only its own


def test_failed_rollouts_are_dropped_and_counted():
    from generators.trajectory import Trajectory
    from trainer.config import Config
    from trainer.loop import prepare_batch

    def rollout(group: str, reward: float, error: str = "") -> Trajectory:
        return Trajectory(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[-1.0], reward=reward,
                          group_id=group, stop_reason="error" if error else "done", error=error or None)

    trajs = [rollout("a", 1.0), rollout("a", 0.0), rollout("a", 1.0, "EngineError: server went away"),
             rollout("b", 0.0, "ValueError: bad move"), rollout("b", 1.0), rollout("c", 0.0), rollout("c", 0.0)]
    batch = prepare_batch(trajs, Config())
    assert batch.counts["failed"] == 2 and batch.trajectories == trajs[:2]  # b is flat once its failure is gone
    assert batch.counts["zero_variance_groups"] == 2 and batch.counts["zero_variance_groups_passed"] == 1  # b; c not


def test_an_agent_episodes_segments_train_as_sequences_with_the_episodes_advantage():
    """GRPO statistics are over a group's episodes: one of two sequences (an agent that compressed its context)
    counts once, and both its sequences carry its advantage."""
    from generators.trajectory import Trajectory
    from trainer.config import Config
    from trainer.loop import prepare_batch

    segment = {"prompt_ids": [5, 6], "response_ids": [7, 8], "loss_mask": [1, 1], "rollout_logprobs": [-0.5, -0.7],
               "version_spans": [[0, 0]]}
    two = Trajectory(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 0], rollout_logprobs=[-1.0, 0.0], reward=1.0,
                     group_id="g", segments=[segment])
    one = Trajectory(prompt_ids=[1], response_ids=[4], loss_mask=[1], rollout_logprobs=[-1.0], reward=0.0,
                     group_id="g", sample_index=1)
    batch = prepare_batch([two, one], Config())
    assert [t.prompt_ids + t.response_ids for t in batch.trajectories] == [[1, 2, 3], [5, 6, 7, 8], [1, 4]]
    assert batch.trajectories[1].rollout_logprobs == [-0.5, -0.7] and batch.trajectories[1].reward == 1.0
    a = batch.advantages.tolist()
    assert a[0] == a[1] > 0 > a[2] and abs(a[0] + a[2]) < 1e-6  # two episodes: +x and -x, whatever the segments
    assert batch.counts["trained"] == 2 and two.num_model_tokens == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_and_entropy_match_the_whole_tensor_formula(dtype, temperature, entropy_grad, monkeypatch):
    """The trainer's chunked log-softmax gather (values and gradients) against log_softmax over whole fp32 logits,
    with chunks small enough that the rows span several, one of them partial."""
    from trainer.backends.common import _ChunkedLogSoftmax, token_logprobs

    monkeypatch.setattr(_ChunkedLogSoftmax, "ROW_BYTES", 4 * 1000 * 7)  # 7 rows a chunk: 50 rows in 8 chunks
    torch.manual_seed(0)
    base = (torch.randn(50, 1000, dtype=torch.float64) * 4).to(dtype)
    targets = torch.randint(0, 1000, (50,))
    weights_lp, weights_h = torch.randn(50), torch.randn(50)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()

    picked, entropy = token_logprobs(ours, targets, temperature, entropy_grad=entropy_grad)
    logp = torch.log_softmax(theirs.float() / temperature, dim=-1)
    want_picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    assert picked.dtype == entropy.dtype == torch.float32 and entropy.requires_grad == entropy_grad
    torch.testing.assert_close(picked, want_picked.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=0, atol=2e-5)

    loss = (picked * weights_lp).sum() + ((entropy * weights_h).sum() if entropy_grad else 0)
    want = (want_picked * weights_lp).sum() + ((want_entropy * weights_h).sum() if entropy_grad else 0)
    loss.backward()
    want.backward()
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=0, atol=2e-5 if dtype == torch.float32
                               else 2e-3)
