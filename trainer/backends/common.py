"""Pieces every backend shares: logprobs from logits, the LR schedule, the HF checkpoint export."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer.backends.base import BackendConfig

# Non-weight files an exported checkpoint needs to be served (vLLM) and reloaded (transformers).
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, *, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs and entropies aligned with ``input_ids``: (B, T) each, position 0 zero.

    ``logits`` (B, T, V) at position t predict token t+1, hence the shift. Computed in fp32 (bf16 over a 49k
    vocabulary loses the precision logprob ratios need) as ``logit[token] - logsumexp(logits)``, which never keeps
    a (B, T, V) log-softmax for backward. The entropy is only differentiable with ``entropy_grad``: most losses
    just log it, and its graph would double the memory of the vocabulary-sized tensors.
    """
    logits = logits[:, :-1].float() / temperature  # (B, T-1, V)
    lse = torch.logsumexp(logits, dim=-1)  # (B, T-1)
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse  # (B, T-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (B, T-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)


def model_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, temperature: float,
                   *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on a padded or packed batch; per-token logprobs and entropies in the padded (B, T) layout."""
    if "cu_seqlens" in batch:  # packed: one row, sequences kept apart by restarting position ids
        packed = batch["packed_input_ids"].to(device)
        logits = model(input_ids=packed, position_ids=batch["position_ids"].to(device),
                       use_cache=False).logits  # (1, N, V)
        logprobs, entropy = token_logprobs(logits, packed, temperature, entropy_grad=entropy_grad)  # (1, N)
        width, cu = batch["input_ids"].shape[1], batch["cu_seqlens"]
        return unpack(logprobs.cpu(), cu, width), unpack(entropy.cpu(), cu, width)  # (B, T)
    input_ids = batch["input_ids"].to(device)
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device),
                   use_cache=False).logits  # (B, T, V)
    logprobs, entropy = token_logprobs(logits, input_ids, temperature, entropy_grad=entropy_grad)
    return logprobs.cpu(), entropy.cpu()


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """(1, N) per-token values of packed sequences → (B, width) right-padded rows; each row's first position is
    zeroed (in the packed row it was predicted from the previous sequence's last token)."""
    bounds = cu_seqlens.tolist()
    rows = []
    for start, end in itertools.pairwise(bounds):
        row = packed[0, start:end]
        rows.append(torch.nn.functional.pad(row[1:], (1, width - (end - start)), value=0.0))
    return torch.stack(rows)


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


def write_hf_checkpoint(state_dict: dict[str, torch.Tensor], source: Path, path: Path) -> None:
    """Write ``state_dict`` as ``model.safetensors`` plus ``source``'s config and tokenizer files, atomically:
    into a temp dir renamed into place, so a reader (vLLM) never sees a half-written checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _CHECKPOINT_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, tmp / name)
    # Tied weights share storage; safetensors refuses shared tensors, and HF reloads ties from the config.
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k != "lm_head.weight"
               or not _tied(source)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def _tied(source: Path) -> bool:
    config = json.loads((source / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))
