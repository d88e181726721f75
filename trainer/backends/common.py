"""Pieces every backend shares: logprobs from logits, the LR schedule, the HF checkpoint export."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.backends.base import BackendConfig, TokenOutputs
from trainer.backends.part_attention import PARTS_KERNEL, dense_mask, row_parts


def load_model(config: BackendConfig, device: torch.device) -> PreTrainedModel:
    """The initial policy in fp32 (master weights) with the configured attention kernel."""
    attention = config.attention
    if attention == "auto":
        attention = "sdpa" if device.type == "cuda" else "eager"
    if attention == "sdpa":
        attention = PARTS_KERNEL
    return AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32, attn_implementation=attention)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` (M,) under ``logits`` (M, V) at ``temperature`` and the entropies of those
    distributions, (M,) each, in fp32 (bf16 over a 49k vocabulary loses the precision logprob ratios need).

    Computed a few rows at a time (:class:`_ChunkedLogSoftmax`), so the fp32 temporaries stay in cache and nothing
    vocabulary-sized is kept for backward beyond the logits themselves. The entropy is only differentiable with
    ``entropy_grad``: most losses just log it.
    """
    return _ChunkedLogSoftmax.apply(logits, targets, temperature, entropy_grad)


class _ChunkedLogSoftmax(torch.autograd.Function):
    """``log_softmax(logits / T)[target]`` and the entropy, forward and backward, in chunks of rows.

    Done with whole-tensor ops, each of the ~6 passes (the fp32 cast, the division, logsumexp, the softmax for the
    entropy, and again in backward) streamed an (M, V) fp32 tensor through memory: with 1,000 predicted tokens over
    SmolLM2's 49k vocabulary, 200 MB a pass, a tenth of a CPU update. With d = ``log p`` and g, h the gradients
    arriving for the logprob and the entropy: d logp_t / d x_j = [j = t] - p_j and d H / d x_j = -p_j (d_j + H).
    """

    ROW_BYTES = 2**22
    """fp32 bytes of logits a chunk holds: a chunk's few temporaries fit a CPU's L3 cache or a GPU's L2."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        picked = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(picked)
        lse = torch.empty_like(picked)
        for start, end in _ChunkedLogSoftmax.chunks(logits):
            x = _ChunkedLogSoftmax.scaled(logits[start:end], temperature)
            lse[start:end] = torch.logsumexp(x, dim=-1)
            logp = x.sub_(lse[start:end, None])
            picked[start:end] = logp.gather(-1, targets[start:end, None]).squeeze(-1)
            entropy[start:end] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start, end in _ChunkedLogSoftmax.chunks(logits):
            logp = _ChunkedLogSoftmax.scaled(logits[start:end], ctx.temperature).sub_(lse[start:end, None])
            p = logp.exp()
            if grad_picked is None:
                g = torch.zeros_like(p)
            else:  # lp ([j = t] - p)
                g = p * -grad_picked[start:end, None]
                g.scatter_add_(-1, targets[start:end, None], grad_picked[start:end, None])
            if grad_entropy is not None:  # -h p (d + H)
                g.sub_(logp.add_(entropy[start:end, None]).mul_(p).mul_(grad_entropy[start:end, None]))
            grad[start:end] = g.div_(ctx.temperature) if ctx.temperature != 1 else g
        return grad, None, None, None

    @staticmethod
    def chunks(logits: torch.Tensor) -> list[tuple[int, int]]:
        size = max(1, _ChunkedLogSoftmax.ROW_BYTES // (4 * logits.shape[-1]))
        return [(start, min(start + size, logits.shape[0])) for start in range(0, logits.shape[0], size)]

    @staticmethod
    def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """An fp32 copy of ``logits`` / T, for the caller to modify in place."""
        x = logits.to(torch.float32, copy=True)
        return x.div_(temperature) if temperature != 1 else x


class ValueHead(torch.nn.Module):
    """PPO's critic: a scalar per position read off the policy's final hidden states (a trunk shared with it).

    Registered as the submodule ``value_head`` of the model, so sharding, optimizer and checkpoints include it. It
    runs inside the model's forward (a hook on the final norm), where a sharded backend has its parameters gathered.
    Zero-initialized: V = 0 before training.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.score = torch.nn.Linear(model.config.hidden_size, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)
        self.values: torch.Tensor | None = None  # (B, T) from the latest forward
        model.get_decoder().norm.register_forward_hook(self._capture)

    def _capture(self, module: torch.nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        self.values = self.score(hidden).squeeze(-1).float()


def add_value_head(model: PreTrainedModel) -> None:
    """Give ``model`` a zero-initialized :class:`ValueHead` (before sharding, so it is sharded with the root)."""
    model.value_head = ValueHead(model)


def model_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, temperature: float,
                   *, entropy_grad: bool = False) -> TokenOutputs:
    """Per-token logprobs, entropies and (with a value head) values of a padded or packed batch.

    Logits are computed only at the positions that predict a loss-mask token (``logits_to_keep``): prompts and
    environment turns never reach the vocabulary-sized head, which is most of the tokens of a typical rollout.
    """
    inner = getattr(model, "module", model)  # DeepSpeed wraps the model in .module
    mask = batch["loss_mask"].bool().clone()  # (B, T)
    mask[:, 0] = False  # the first token is not predicted by anything
    rows, cols = mask.nonzero(as_tuple=True)  # (M,) each: the predicted tokens
    if "packed_input_ids" in batch:  # one row: packed sequences, or a shared prompt and each rollout's rest
        packed = batch["packed_input_ids"].to(device)  # (1, N)
        keep = batch["row_starts"][rows] + cols - 1  # (M,) packed positions predicting those tokens
        # Packed sequences are kept apart by their restarting position ids; parts that share a prompt need masks.
        parts = {}
        dense = None
        if "part_bounds" in batch:
            segments = batch["segments"].to(device)
            bounds = batch["part_bounds"].tolist()
            if inner.config._attn_implementation == PARTS_KERNEL:
                parts = {"parts": row_parts(segments, bounds)}
            else:  # other kernels read one mask over the whole row
                dense = dense_mask(segments, bounds)
        logits = model(input_ids=packed, position_ids=batch["position_ids"].to(device), attention_mask=dense,
                       use_cache=False, logits_to_keep=keep.to(device), **parts).logits[0]  # (M, V)
        targets = packed[0, (keep + 1).to(device)]  # (M,)
        where = (torch.zeros_like(keep), keep)  # (M,) each: the predicting positions in the model's output
    else:
        input_ids = batch["input_ids"].to(device)  # (B, T)
        # One window of columns for every row: from the earliest predicting position to the last one.
        first = int(cols.min()) if len(cols) else input_ids.shape[1] - 1
        window = torch.arange(first - 1, input_ids.shape[1] - 1)  # (K,)
        logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), use_cache=False,
                       logits_to_keep=window.to(device)).logits  # (B, K, V)
        logits = logits[rows.to(device), (cols - first).to(device)]  # (M, V)
        targets = input_ids[rows.to(device), cols.to(device)]  # (M,)
        where = (rows, cols - 1)
    picked, entropy = token_logprobs(logits, targets, temperature, entropy_grad=entropy_grad)  # (M,) each
    head = getattr(inner, "value_head", None)
    values = None
    if head is not None:
        values = _scatter(head.values[where[0].to(device), where[1].to(device)], rows, cols, mask.shape)
        head.values = None
    return TokenOutputs(_scatter(picked, rows, cols, mask.shape), _scatter(entropy, rows, cols, mask.shape), values)


def _scatter(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(M,) values at (rows, cols) → a (B, T) tensor, zero elsewhere, differentiable in ``values``."""
    return torch.zeros(shape, dtype=values.dtype).index_put((rows, cols), values.cpu())


def lr_lambda(config: BackendConfig):
    """Multiplier of the base LR at each step: linear warmup, then constant or cosine decay."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_schedule == "constant":
            return 1.0
        span = max(1, config.total_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
