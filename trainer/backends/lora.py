"""LoRA with ``peft``: adapters on the policy before sharding, and the policy as a plain model for serving.

``add_lora`` wraps the loaded model in a ``PeftModel``: every base weight is frozen, each targeted linear layer
computes ``W x + (alpha / r) · B A x`` with trainable ``A`` (r, in) and ``B`` (out, r; zero-initialized, so the
policy starts as the base model). A PPO value head, added after, is new and trains whole. The backend shards the
wrapped model like any other and hands only the trainable parameters to the optimizer: that is where LoRA saves
memory (no gradients, no Adam moments for the base weights), and checkpoints hold only those parameters (the base
comes from ``model.path``).

An engine serves the adapters merged (``model.lora.serve=merged``): :func:`merged_state_dict` turns the wrapped
model's full state dict into the base model's names with ``B A`` merged into each adapted weight, so weight sync
(from memory or disk), ``weights/vN`` and exported checkpoints are ordinary HF models that load without ``peft``.
Or it serves them as adapters beside the base model (vLLM's LoRA support, several policies on one server):
:func:`write_adapter` saves them as ``peft`` does, a few MB that the server loads in place of the last.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from trainer.backends.base import BackendConfig

if TYPE_CHECKING:  # peft takes seconds to import: only LoRA runs import it
    from peft import PeftModel

ADAPTER = "default"  # peft's name for the one adapter
_WRAPPER = "base_model.model."  # PeftModel → LoraModel → the HF model, in state-dict keys


def add_lora(model: PreTrainedModel, config: BackendConfig) -> PeftModel:
    """``model`` with LoRA adapters on ``config.lora_target_modules``; only the adapters require grad. (A value head
    added afterwards to the model inside trains whole.)"""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    targets = config.lora_target_modules
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
                      task_type="CAUSAL_LM")
    try:
        wrapped = get_peft_model(model, lora)
    except ValueError as e:  # peft: no module matched the targets
        linear = sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"model.lora.target_modules={list(targets)} does not name a linear layer of "
                         f"{config.model_path}: its linear layers are {', '.join(linear)} (or use [all-linear])"
                         ) from e
    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise ValueError(f"model.lora.target_modules matches {name} "
                             f"({type(module.get_base_layer()).__name__}): only linear layers can take an adapter "
                             "here (the served weights merge B·A into a linear layer's weight)")
    return wrapped


@contextmanager
def adapters_off(model: PeftModel, trainable: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """The base model's forward inside the block (the KL reference of a LoRA policy), and the ``trainable``
    parameters training again after it: peft turns requires_grad off and on again on the parameters its modules hold
    at entry and at exit (a sharding backend's gathered copies, say), and left off the adapters would silently stop
    training."""
    try:
        with model.disable_adapter():
            yield
    finally:
        for param in trainable:
            param.requires_grad_(True)


def lora_scalings(model: PeftModel) -> dict[str, tuple[float, bool]]:
    """Each adapted layer's state-dict prefix → (``alpha / r``, ``fan_in_fan_out``), as :func:`merged_state_dict`
    needs them."""
    from peft.tuners.lora import LoraLayer

    return {name: (float(module.scaling[ADAPTER]), bool(module.fan_in_fan_out))
            for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def merged_state_dict(state: dict[str, torch.Tensor], scalings: dict[str, tuple[float, bool]]
                      ) -> dict[str, torch.Tensor]:
    """A wrapped model's full state dict as the base model's, with each adapter merged into its layer's weight:
    ``W + (alpha / r) · B A``, in fp32 (what ``peft``'s ``merge_and_unload`` computes)."""
    if not state:
        return {}
    state = dict(state)
    merged: dict[str, torch.Tensor] = {}
    for prefix, (scaling, fan_in_fan_out) in scalings.items():
        a = state.pop(f"{prefix}.lora_A.{ADAPTER}.weight").float()  # (r, in)
        b = state.pop(f"{prefix}.lora_B.{ADAPTER}.weight").float()  # (out, r)
        weight = state.pop(f"{prefix}.base_layer.weight")  # (out, in)
        delta = (b @ a).T if fan_in_fan_out else b @ a  # (out, in) as the base layer stores it
        delta = delta * scaling
        merged[_base_name(f"{prefix}.weight")] = (weight.float() + delta).to(weight.dtype)
        if f"{prefix}.base_layer.bias" in state:
            merged[_base_name(f"{prefix}.bias")] = state.pop(f"{prefix}.base_layer.bias")
    leftover = [k for k in state if ".lora_" in k or ".base_layer." in k]
    if leftover:
        raise ValueError(f"adapter tensors without a layer to merge into: {leftover[:4]}")
    merged.update({_base_name(k): v for k, v in state.items()})
    return merged


def _base_name(key: str) -> str:
    return key.removeprefix(_WRAPPER)


def frozen_base(model_path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The frozen base weights of a wrapped model, by its parameter ``names`` (``...q_proj.base_layer.weight``), in
    fp32 as ``model_path``'s safetensors hold them: what a backend that keeps the base in its compute dtype exports."""
    wanted = {_base_name(name).replace(".base_layer.", "."): name for name in names}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found |= {wanted[key]: f.get_tensor(key).float() for key in f.keys() if key in wanted}  # noqa: SIM118
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{model_path} holds no safetensors weights for {missing[:4]}: the frozen base to export")
    return found


def write_adapter(state: dict[str, torch.Tensor], model: PeftModel, path: Path) -> None:
    """The adapters in a wrapped model's ``state`` (its trainable parameters), saved at ``path`` as ``peft``'s
    ``save_pretrained`` saves them (adapter_config.json, adapter_model.safetensors); the directory appears
    atomically."""
    tensors = {k.replace(f".{ADAPTER}.", "."): v.contiguous() for k, v in state.items() if ".lora_" in k}
    if not tensors:
        raise ValueError("the state holds no LoRA adapter tensors")
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, partial / "adapter_model.safetensors", metadata={"format": "pt"})
    model.peft_config[ADAPTER].save_pretrained(str(partial))
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
