"""Attention over a row of parts (``trainer.batching.shared_prompt_batch``): each part is a shared prompt, then
rollouts that each see the prompt and themselves, and no part sees another.

Under one mask, a kernel computes every (query, key) pair of a part, of which a group of 8 rollouts needs about a
fifth. :class:`_PartAttention` computes only what is seen, or near it: every token of a part against the prompt's
keys (a causal mask for the prompt's own tokens), and each rollout's tokens against that rollout's keys, the
rollouts padded to the longest one and batched. Scores, softmax and the gradient of the probabilities are fp32;
the products with values and gradients run in the input dtype, as flash kernels do. Like them it keeps no score
matrix for backward (it recomputes them), so memory stays linear in a part's length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PARTS_KERNEL = "envkit_parts"
"""The attention kernel for ``trainer.attention=sdpa``: :func:`parts_attention` given ``parts``, else SDPA."""


class Part(NamedTuple):
    """One part of a packed row: tokens [begin, end), the first ``shared`` of them its prompt."""

    begin: int
    end: int
    shared: int
    valid: torch.Tensor
    """(rollouts, longest) bool: which slots of each rollout's padded rest hold its tokens."""
    hidden: torch.Tensor
    """(rollouts, longest, longest) bool: the keys of its own rest a rollout's token does not see."""
    slots: torch.Tensor
    """(R,) where each of the rests' tokens goes among the rollouts x longest padded slots."""


def row_parts(segments: torch.Tensor, bounds: list[list[int]]) -> list[Part]:
    """The parts of a (1, N) row numbered as ``shared_prompt_batch`` numbers it (0 shared, r + 1 rollout r)."""
    parts = []
    for begin, end in bounds:
        seg = segments[0, begin:end]
        lengths = torch.bincount(seg)
        shared, lengths = int(lengths[0]), lengths[1:]
        position = torch.arange(int(lengths.max()), device=seg.device)
        valid = position[None] < lengths[:, None]
        hidden = (position[None, :] > position[:, None])[None] | ~valid[:, None, :]
        parts.append(Part(begin, end, shared, valid, hidden, valid.flatten().nonzero()[:, 0]))
    return parts


def dense_mask(segments: torch.Tensor, bounds: list[list[int]]) -> torch.Tensor:
    """The additive (1, 1, N, N) mask of a whole row of parts, for kernels that read one mask."""
    n = segments.shape[1]
    mask = torch.full((1, 1, n, n), float("-inf"), device=segments.device)
    for begin, end in bounds:
        seg = segments[0, begin:end]
        position = torch.arange(len(seg), device=seg.device)
        seen = (position[None, :] <= position[:, None]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
        mask[0, 0, begin:end, begin:end].masked_fill_(seen, 0.0)
    return mask


def parts_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *, parts: list[Part] | None = None, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """Attention of a (1, H, N, d) packed row over each of its ``parts``; SDPA for rows without parts."""
    if parts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("dropout", 0.0):
        raise ValueError("attention over shared-prompt parts has no dropout: set trainer.share_prompt=false")
    heads, kv_heads, d = query.shape[1], key.shape[1], query.shape[3]
    scale = kwargs.get("scaling") or d ** -0.5
    out = []
    for part in parts:
        span = slice(part.begin, part.end)
        q = query[0, :, span].reshape(kv_heads, heads // kv_heads, part.end - part.begin, d)
        o = _PartAttention.apply(q, key[0, :, span], value[0, :, span], part, scale)
        out.append(o.reshape(heads, part.end - part.begin, d).transpose(0, 1))
    return torch.cat(out)[None], None  # (1, N, H, d)


AttentionInterface.register(PARTS_KERNEL, parts_attention)


class _PartAttention(torch.autograd.Function):
    """Attention of one part: q (KV, g, n, d) (the g query heads of each key head), k and v (KV, n, d)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: Part, scale: float) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            kv, g, n, d = q.shape
            s = part.shared
            shared_k, shared_v = k[:, :s], v[:, :s]
            rest_q, rest_k, rest_v = (_pad(x[:, :, s:], part) for x in (q, k[:, None], v[:, None]))
            on_shared, on_rest = _scores(q, shared_k, rest_q, rest_k, part, scale)
            # One softmax over both blocks of a row: shift by the row's max, exponentiate once, normalize.
            top = on_shared.amax(-1, keepdim=True) if s else on_shared.new_full((kv, g, n, 1), float("-inf"))
            top[:, :, s:] = torch.maximum(top[:, :, s:], _unpad(on_rest.amax(-1, keepdim=True), part))  # (KV, g, n, 1)
            p_shared, p_rest = on_shared.sub_(top).exp_(), on_rest.sub_(_pad(top[:, :, s:], part)).exp_()
            total = p_shared.sum(-1, keepdim=True)
            total[:, :, s:] += _unpad(p_rest.sum(-1, keepdim=True), part)
            lse = top.add_(total.log())
            rest_lse = _pad(lse[:, :, s:], part)  # (KV, rollouts, g * longest, 1)
            p_shared = p_shared.div_(total).to(q.dtype)
            p_rest = _padding_zeroed(p_rest.div_(_pad(total[:, :, s:], part)), part).to(q.dtype)
            out = (p_shared.view(kv, g * n, s) @ shared_v).view(kv, g, n, d)
            out[:, :, s:] += _unpad(p_rest @ rest_v, part)
        ctx.save_for_backward(q, shared_k, shared_v, rest_q, rest_k, rest_v, lse, rest_lse, out)
        ctx.part, ctx.scale = part, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, shared_k, shared_v, rest_q, rest_k, rest_v, lse, rest_lse, out = ctx.saved_tensors
        part, scale = ctx.part, ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            kv, g, n, d = q.shape
            s, dtype = part.shared, q.dtype
            grad = grad.to(dtype)
            on_shared, on_rest = _scores(q, shared_k, rest_q, rest_k, part, scale)
            p_shared, p_rest = on_shared.sub_(lse).exp_(), _padding_zeroed(on_rest.sub_(rest_lse).exp_(), part)
            rows = grad.reshape(kv, g * n, d)
            rest_grad = _pad(grad[:, :, s:], part)
            # dV = Pᵀ dO, summed over each key head's g query heads (they are rows of the same product)
            dv_shared = p_shared.to(dtype).view(kv, g * n, s).transpose(1, 2) @ rows
            dv_rest = p_rest.to(dtype).transpose(2, 3) @ rest_grad
            # dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), the softmax's backward, in fp32
            delta = (grad.float() * out.float()).sum(-1, keepdim=True)  # (KV, g, n, 1)
            ds_shared = (rows.float() @ shared_v.float().transpose(1, 2)).view(p_shared.shape).sub_(delta)
            ds_shared = p_shared.mul_(ds_shared).mul_(scale).to(dtype)
            ds_rest = (rest_grad.float() @ rest_v.float().transpose(2, 3)).sub_(_pad(delta[:, :, s:], part))
            ds_rest = p_rest.mul_(ds_rest).mul_(scale).to(dtype)
            dq = (ds_shared.view(kv, g * n, s) @ shared_k).view(kv, g, n, d)
            dq[:, :, s:] += _unpad(ds_rest @ rest_k, part)
            dk_shared = ds_shared.view(kv, g * n, s).transpose(1, 2) @ q.reshape(kv, g * n, d)
            dk_rest = ds_rest.transpose(2, 3) @ rest_q
            dk = torch.cat([dk_shared, _unpad(dk_rest, part)[:, 0]], 1)
            dv = torch.cat([dv_shared, _unpad(dv_rest, part)[:, 0]], 1)
        return dq, dk, dv, None, None


def _scores(q: torch.Tensor, shared_k: torch.Tensor, rest_q: torch.Tensor, rest_k: torch.Tensor, part: Part,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled fp32 scores, -inf where unseen: every token against the prompt's keys (KV, g, n, s), and each
    rollout's padded rest against its own keys (KV, rollouts, g * longest, longest)."""
    kv, g, n, d = q.shape
    s = shared_k.shape[1]
    on_shared = (q.float().reshape(kv, g * n, d) @ shared_k.float().transpose(1, 2)).mul_(scale).view(kv, g, n, s)
    on_shared.masked_fill_(torch.ones(n, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    on_rest = (rest_q.float() @ rest_k.float().transpose(2, 3)).mul_(scale)
    rollouts, longest = part.valid.shape
    on_rest.view(kv, rollouts, g, longest, longest).masked_fill_(part.hidden[:, None], float("-inf"))
    return on_shared, on_rest


def _padding_zeroed(p: torch.Tensor, part: Part) -> torch.Tensor:
    """``p`` (KV, rollouts, g * longest, longest) with its padding rows (past each rollout's end) set to 0, in place.

    Their log-sum-exps and totals are padding too (0), so those rows hold inf or NaN. Each product row reads only
    its own row, yet on a CPU with AMX the bf16 matmul carried a padding row's NaN into the rollout's last real row.
    """
    kv, rollouts, rows, longest = p.shape
    padding = ~part.valid[:, None, :, None]  # (rollouts, 1, longest, 1)
    return p.view(kv, rollouts, rows // longest, longest, longest).masked_fill_(padding, 0.0).view(p.shape)


def _pad(x: torch.Tensor, part: Part) -> torch.Tensor:
    """The rests' rows (KV, g, R, d) → (KV, rollouts, g * longest, d): each rollout's rows for its g heads, zero
    past its end."""
    kv, g, _, d = x.shape
    rollouts, longest = part.valid.shape
    out = x.new_zeros(kv, g, rollouts * longest, d).index_copy_(2, part.slots, x)
    return out.view(kv, g, rollouts, longest, d).transpose(1, 2).reshape(kv, rollouts, g * longest, d)


def _unpad(x: torch.Tensor, part: Part) -> torch.Tensor:
    """The inverse of :func:`_pad`: (KV, rollouts, g * longest, d) → (KV, g, R, d)."""
    kv, rollouts, rows, d = x.shape
    longest = part.valid.shape[1]
    g = rows // longest
    return x.view(kv, rollouts, g, longest, d).transpose(1, 2).reshape(kv, g, rollouts * longest, d).index_select(
        2, part.slots)
