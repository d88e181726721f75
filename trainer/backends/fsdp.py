"""FSDP2 backend: ``fully_shard`` per decoder layer and at the root, gloo on CPU, NCCL on GPU.

World size 1 runs in-process (a one-rank gloo/NCCL group, so the code path is the same); N ranks come from
``torchrun``. Parameters and optimizer state are fp32; compute runs in bf16 via ``MixedPrecisionPolicy``.

With LoRA (``lora_r > 0``, :mod:`trainer.backends.lora`) the policy is a ``PeftModel`` sharded the same way (FSDP2
shards frozen and trainable parameters alike); the optimizer and checkpoints cover the trainable parameters only,
and the KL reference is the policy with its adapters disabled instead of a second model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from trainer.backends.base import (
    BackendConfig,
    Batch,
    StepStats,
    TokenOutputs,
    TrainBackend,
    finite_grad_norm,
)
from trainer.backends.common import (
    add_value_head,
    load_model,
    lr_lambda,
    model_logprobs,
)
from trainer.backends.lora import adapters_off, add_lora, lora_scalings, merged_state_dict, write_adapter
from trainer.distributed import init_distributed


class FSDPBackend(TrainBackend):
    """The policy (and optional frozen reference) sharded with FSDP2 over all ranks of the default group."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.rank, self.world_size, self.device = init_distributed()
        torch.manual_seed(config.seed)
        compute = torch.bfloat16 if config.dtype == "bf16" else torch.float32
        self._mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        self.model = self._load(train=True)
        self.lora = config.lora_r > 0
        self._scalings = lora_scalings(self.model) if self.lora else {}
        # With LoRA the reference is the base model: the policy with its adapters off, not a second copy.
        self.reference = self._load(train=False) if config.reference and not self.lora else None
        # Adam state for the trainable parameters only (with LoRA: the adapters, a small fraction of the model).
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # fused: one kernel over all the parameters. foreach's ops on DTensors re-derive their sharding on first use,
        # which made a run's first step (and a checkpoint of a state not yet stepped) ~4 s slower on the CPU.
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))

    def _load(self, *, train: bool) -> PreTrainedModel:
        model = load_model(self.config, self.device)
        model.to(self.device)
        if train and self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        base = model
        if train and self.config.lora_r > 0:
            model = add_lora(base, self.config)  # base is the HF model inside, its linear layers adapted
        if train and self.config.value_head:
            add_value_head(base)  # after the adapters: the critic is new and trains whole
        # Shard every decoder layer, then the root (embeddings, final norm, tied head): one all-gather per layer.
        # One rank has nothing to free between forward and backward: keeping the gathered (bf16) parameters saves
        # the backward's second gather and cast, a third of FSDP's copies.
        reshard = self.world_size > 1
        for layer in base.model.layers:
            fully_shard(layer, mp_policy=self._mp, reshard_after_forward=reshard)
        fully_shard(base, mp_policy=self._mp, reshard_after_forward=reshard)
        if train:
            self._root = base
        model.train(train)
        if not train:
            model.requires_grad_(False)
        return model

    def forward(self, batch: Batch, *, entropy_grad: bool = False) -> TokenOutputs:
        return model_logprobs(self.model, batch, self.device, self.config.temperature, entropy_grad=entropy_grad)

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        if reference and not self.config.reference:
            raise ValueError("this backend was built without a reference model (BackendConfig.reference=False)")
        if reference and self.lora:
            # FSDP's sharded parameters are what it copies requires_grad from when it next gathers
            with adapters_off(self.model, self.trainable):
                return model_logprobs(self.model, batch, self.device, self.config.temperature).logprobs
        model = self.reference if reference else self.model
        return model_logprobs(model, batch, self.device, self.config.temperature).logprobs

    def backward(self, loss: torch.Tensor, *, last: bool = True) -> None:
        # One rank has no gradients to reduce and nothing to free: keeping each layer's gathered weights and its
        # unreduced (fp32) gradients until the step's last micro-batch saves a cast of every weight in each
        # micro-batch's forward and a copy of every gradient in its backward. With N ranks each micro-batch reduces
        # and frees, which is what sharding is for.
        if self.world_size == 1:
            self._root.set_requires_gradient_sync(last)
            self._root.set_reshard_after_backward(last)
        loss.backward()

    def step(self) -> StepStats:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        # clip_grad_norm_ on sharded (DTensor) grads returns a DTensor; the full norm is its local value here.
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.scheduler.get_last_lr()[0]
        finite_grad_norm(float(norm))  # raises before the update: the policy's weights stay as they were
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm=float(norm), lr=float(lr))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        return merged_state_dict(state, self._scalings) if self.lora else state

    def export_adapter(self, path: Path) -> None:
        if not self.lora:
            raise ValueError("this policy trains every weight (model.lora.r=0): it has no adapters to export")
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                          ignore_frozen_params=True))
        if self.rank == 0:
            write_adapter(state, self.model, path)
        if self.world_size > 1:
            dist.barrier()

    def _train_state(self) -> tuple[dict, dict]:
        """The model and optimizer state a checkpoint holds: with LoRA only what trains, as the frozen base (a head
        tied to its embeddings included) is ``model.path`` itself."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        if self.lora:
            trainable = {name for name, param in self.model.named_parameters() if param.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k in trainable}
        return model_state, optim_state

    def save_state(self, path: Path) -> None:
        model_state, optim_state = self._train_state()
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / "dcp"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        if self.world_size > 1:
            dist.barrier()

    def load_state(self, path: Path) -> None:
        model_state, optim_state = self._train_state()
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))  # raises if the checkpoint lacks any of these keys
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not self.lora))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
