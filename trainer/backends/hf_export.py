"""The policy as inference engines load it: the served tensors of a state dict, and an HF checkpoint dir of them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# Non-weight files an exported checkpoint needs to be served (vLLM) and reloaded (transformers).
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def served_tensors(state_dict: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """The language model's tensors of a full state dict, contiguous on the CPU, as an engine loads them: without
    the critic (the trainer's own) or a head tied to the embeddings (HF ties it again from the config; safetensors
    refuses shared tensors)."""
    if not state_dict:
        return {}
    tied = _tied(source)
    return {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()
            if not k.startswith("value_head.") and (k != "lm_head.weight" or not tied)}


def write_hf_checkpoint(tensors: dict[str, torch.Tensor], source: Path, path: Path) -> None:
    """Write ``tensors`` (:func:`served_tensors`) as ``model.safetensors`` plus ``source``'s config and tokenizer
    files, atomically: into a temp dir renamed into place, so a reader (vLLM) never sees a half-written checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _CHECKPOINT_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, tmp / name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def _tied(source: Path) -> bool:
    config = json.loads((source / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))
