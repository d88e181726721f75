"""DeepSpeed ZeRO backend (stage 2 or 3): the same semantics as the FSDP2 backend, on DeepSpeed's engine.

The process group is ours (``init_distributed``: torchrun's, or a one-rank gloo group); DeepSpeed wraps it rather
than creating its own. On CPU DeepSpeed picks its CPU accelerator and gloo by itself.

Gradient accumulation belongs to the RL loop, which divides each micro-batch's loss itself; DeepSpeed must not do
it again. The engine runs with ``gradient_accumulation_steps=1`` (``backward`` divides the loss by 1) and
``managed_gradient_accumulation=False``: ``backward`` only accumulates (ZeRO reduces into the partitioned
gradients), and every ``step()`` is the boundary, so one ``TrainBackend.step()`` is exactly one optimizer step
whatever the number of micro-batches. ZeRO averages gradients over ranks like FSDP does, and clips by the global
norm with the same ``max_norm / (norm + 1e-6)`` factor as ``torch.nn.utils.clip_grad_norm_``.

The optimizer is ``torch.optim.AdamW`` handed to ``deepspeed.initialize`` (ZeRO partitions its state), not
DeepSpeed's FusedAdam: it is the FSDP backend's optimizer, so both backends run the same update rule and defaults
(eps, bias correction, decoupled weight decay), and nothing has to be compiled for it (FusedAdam is a C++ op built
on first use: ~40 s on CPU). The LR schedule is a torch ``LambdaLR`` that the engine steps after each update.

With ``dtype="bf16"`` DeepSpeed keeps bf16 module weights for compute and fp32 master weights plus optimizer state
in the ZeRO optimizer. Two settings make that FSDP's mixed precision (fp32 parameters cast to bf16 for compute,
gradients reduced in fp32), to the bit on the parity runs: gradients are reduced and accumulated in fp32
(``communication_data_type``, ``data_types.grad_accum_dtype``), and the master weights are reset to the
checkpoint's fp32 values after ``initialize``, which seeds them from the bf16-cast module.

With LoRA (``lora_r > 0``, :mod:`trainer.backends.lora`) the engine wraps the ``PeftModel``, as the FSDP backend
shards it: ZeRO partitions the adapters' fp32 masters and Adam state only (the frozen base stays in the compute
dtype, as DeepSpeed casts the module, and is read from ``model.path`` for export), checkpoints leave the frozen
base out, and the KL reference is the policy with its adapters disabled instead of a second engine.

Ops DeepSpeed compiles on first use (the CPU ``deepspeed_shm_comm``) go to ``$TORCH_EXTENSIONS_DIR``, which
defaults here to ``<envkit cache>/torch_extensions`` so they are built once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from generators.models import cache_dir
from trainer.backends.base import BackendConfig, Batch, StepStats, TokenOutputs, TrainBackend, finite_grad_norm
from trainer.backends.common import (
    add_value_head,
    load_model,
    lr_lambda,
    model_logprobs,
)
from trainer.backends.lora import adapters_off, add_lora, frozen_base, lora_scalings, merged_state_dict, write_adapter
from trainer.distributed import init_distributed

# Before importing deepspeed: its op builder reads the variable when it compiles.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

_CHECKPOINT_TAG = "state"


def ds_config(config: BackendConfig, zero_stage: int, *, train: bool = True) -> dict[str, Any]:
    """The DeepSpeed config of the policy engine (``train``) or of the frozen reference engine."""
    ds: dict[str, Any] = {
        # Placeholder: the loop sizes micro-batches itself and never hands DeepSpeed a data loader.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": config.dtype == "bf16"},
        "steps_per_print": 2**31 - 1,  # the loop logs; silence DeepSpeed's periodic progress lines
        "wall_clock_breakdown": False,
    }
    if not train:
        # Inference only: ZeRO-3 keeps the reference sharded like the policy; otherwise a plain replica.
        ds["zero_optimization"] = {"stage": 3 if zero_stage == 3 else 0}
        return ds
    return ds | {
        # The loop owns accumulation: backward() accumulates, each step() is an optimizer step (module docstring).
        "managed_gradient_accumulation": False,
        "gradient_clipping": config.grad_clip,
        # bf16: reduce and accumulate gradients in fp32 (FSDP's reduce_dtype); DeepSpeed's default would round the
        # averaged gradient (and its sum over micro-batches) to bf16.
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": zero_stage},
    }


class DeepSpeedBackend(TrainBackend):
    """The policy as a DeepSpeed ZeRO engine over all ranks of the default group, plus an optional frozen reference.

    The reference is a second engine without optimizer: sharded with ZeRO-3 when the policy is (memory per rank
    stays 1/N, as with FSDP's sharded reference), else a plain replica in the compute dtype (ZeRO-2 already keeps
    full compute weights on every rank, so a replica is the same footprint and needs no collectives).
    """

    def __init__(self, config: BackendConfig, *, zero_stage: int = 2) -> None:
        if zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {zero_stage}")
        self.config = config
        self.zero_stage = zero_stage
        # Our group first: deepspeed.initialize(dist_init_required=False) then wraps it instead of making one.
        self.rank, self.world_size, self.device = init_distributed()
        # DeepSpeed reads the local rank only from the environment; torchrun sets it, our one-rank group does not.
        os.environ.setdefault("LOCAL_RANK", "0")
        torch.manual_seed(config.seed)

        base = self._load()
        if config.gradient_checkpointing:
            base.gradient_checkpointing_enable()
        self.lora = config.lora_r > 0
        model = add_lora(base, config) if self.lora else base
        if config.value_head:
            add_value_head(base)  # after the adapters: the critic is new and trains whole
        model.train()
        self._scalings = lora_scalings(model) if self.lora else {}
        if self.lora:
            # DeepSpeed's exclude_frozen_parameters misses a tied head (a second name of the frozen embeddings), which
            # is much of a small model: the module's state dict leaves out every name of a frozen parameter.
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}

            def trained_only(_module: Any, state: dict[str, Any], _prefix: str, _meta: Any) -> None:
                for name in frozen & state.keys():
                    del state[name]

            model.register_state_dict_post_hook(trained_only)
        # bf16: DeepSpeed casts the module to bf16, then seeds its fp32 master weights from those bf16 values,
        # which rounds the checkpoint's weights away for good (and updates smaller than half a bf16 ulp then never
        # move a compute weight). Keep the fp32 weights to put them back into the masters.
        fp32_weights = {n: p.detach().clone() for n, p in model.named_parameters()
                        if p.requires_grad} if config.dtype == "bf16" else {}
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=lambda params: torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                                       weight_decay=config.weight_decay),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config)),
            config=ds_config(config, zero_stage),
            dist_init_required=False,
        )
        for name, param in self.engine.module.named_parameters():
            if name in fp32_weights:
                _set_fp32_master(param, fp32_weights.pop(name))
        self.trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.reference = None
        if config.reference and not self.lora:
            reference = self._load()
            reference.requires_grad_(False)
            reference.eval()
            self.reference = deepspeed.initialize(model=reference, config=ds_config(config, zero_stage, train=False),
                                                  dist_init_required=False)[0]

    def _load(self) -> PreTrainedModel:
        # A plain fp32 load: DeepSpeed casts to bf16 and (ZeRO-3) partitions at initialize. Wrapping this in
        # deepspeed.zero.Init fails inside transformers' _init_weights.
        return load_model(self.config, self.device)

    def forward(self, batch: Batch, *, entropy_grad: bool = False) -> TokenOutputs:
        device = self.engine.device
        return model_logprobs(self.engine, batch, device, self.config.temperature, entropy_grad=entropy_grad)

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        if reference and not self.config.reference:
            raise ValueError("this backend was built without a reference model (BackendConfig.reference=False)")
        if reference and self.lora:
            with adapters_off(self.engine.module, self.trainable):
                return model_logprobs(self.engine, batch, self.engine.device, self.config.temperature).logprobs
        model = self.reference if reference else self.engine
        return model_logprobs(model, batch, self.engine.device, self.config.temperature).logprobs

    def backward(self, loss: torch.Tensor, *, last: bool = True) -> None:
        self.engine.backward(loss)  # divides by gradient_accumulation_steps == 1: the loss as given

    def step(self) -> StepStats:
        lr = self.scheduler.get_last_lr()[0]  # the LR this update uses; the engine steps the schedule after it
        self.engine.step()  # reduce, clip to grad_clip, AdamW, LR schedule, zero grads
        norm = self.engine.get_global_grad_norm()  # before clipping, like clip_grad_norm_'s return value
        # the engine has applied the update: raising now keeps it from reaching an inference engine or a checkpoint
        return StepStats(grad_norm=finite_grad_norm(float(norm)), lr=float(lr))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (the optimizer's master copy, not bf16 compute weights) plus persistent buffers, on
        rank 0 (empty elsewhere); with LoRA the adapters merged into the base, under the base model's names.

        Collective: ``safe_get_full_fp32_param`` assembles each parameter from its ZeRO-2/3 partitions on every
        rank, so all ranks walk the parameters in the same order; only rank 0 keeps them, one at a time.
        """
        module = self.engine.module
        state = self._full_params(trainable_only=False)
        if self.rank == 0:
            for name, buffer in module.named_buffers():
                owner, _, leaf = name.rpartition(".")
                if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
                    state[name] = buffer.detach().cpu()
        return merged_state_dict(state, self._scalings) if self.lora else state

    def export_adapter(self, path: Path) -> None:
        if not self.lora:
            raise ValueError("this policy trains every weight (model.lora.r=0): it has no adapters to export")
        state = self._full_params(trainable_only=True)
        if self.rank == 0:
            write_adapter(state, self.engine.module, path)
        if self.world_size > 1:
            dist.barrier()

    def _full_params(self, *, trainable_only: bool) -> dict[str, torch.Tensor]:
        """Each parameter whole on rank 0 (empty elsewhere): a trained one its fp32 master, a frozen one (LoRA's
        base) from ``model.path``, as DeepSpeed holds it in the compute dtype only. Collective: every rank walks the
        trained parameters in the same order."""
        state, frozen = {}, []
        for name, param in self.engine.module.named_parameters():
            if not param.requires_grad:
                frozen.append(name)
                continue
            full = safe_get_full_fp32_param(param)
            if self.rank == 0:
                state[name] = full.detach().cpu()
        if self.rank == 0 and frozen and not trainable_only:
            state |= frozen_base(self.config.model_path, frozen)
        return state

    def save_state(self, path: Path) -> None:
        # Each rank writes its own ZeRO partitions (model, optimizer); the LR schedule goes with the engine state.
        # With LoRA the frozen base is model.path itself: a checkpoint holds what trains.
        self.engine.save_checkpoint(str(path), tag=_CHECKPOINT_TAG, exclude_frozen_parameters=self.lora)
        if self.world_size > 1:
            dist.barrier()

    def load_state(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path), tag=_CHECKPOINT_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True, load_module_strict=not self.lora)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag {_CHECKPOINT_TAG!r}) under {path}")


def _set_fp32_master(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's partition of ``param``'s fp32 master weight with the matching slice of ``value``."""
    if hasattr(param, "ds_id"):
        # ZeRO-3: each rank holds one equal slice of the parameter padded to a multiple of the world size.
        # (safe_set_full_fp32_param slices the unpadded value, which overruns it on the last rank when padded, so
        # this uses the private accessor that public helper is built on.)
        optimizer = param._z3_optimizer
        partition, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False)
        n = partition.numel()
        flat = torch.nn.functional.pad(value.flatten(), (0, n * dist.get_world_size() - value.numel()))
        partition.data.copy_(flat[n * dist.get_rank():n * (dist.get_rank() + 1)])
    else:
        safe_set_full_fp32_param(param, value)  # ZeRO-2: the fragment of the flat fp32 partition it maps to
