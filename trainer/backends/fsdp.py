"""FSDP2 backend: ``fully_shard`` per decoder layer and at the root, gloo on CPU, NCCL on GPU.

World size 1 runs in-process (a one-rank gloo/NCCL group, so the code path is the same); N ranks come from
``torchrun``. Parameters and optimizer state are fp32; compute runs in bf16 via ``MixedPrecisionPolicy``.
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

from trainer.backends.base import BackendConfig, Batch, StepStats, TrainBackend
from trainer.backends.common import (
    TokenOutputs,
    add_value_head,
    load_model,
    lr_lambda,
    model_logprobs,
)
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
        self.reference = self._load(train=False) if config.reference else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))

    def _load(self, *, train: bool) -> PreTrainedModel:
        model = load_model(self.config, self.device)
        model.to(self.device)
        if train and self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if train and self.config.value_head:
            add_value_head(model)
        # Shard every decoder layer, then the root (embeddings, final norm, tied head): one all-gather per layer.
        # One rank has nothing to free between forward and backward: keeping the gathered (bf16) parameters saves
        # the backward's second gather and cast, a third of FSDP's copies.
        reshard = self.world_size > 1
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=self._mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=self._mp, reshard_after_forward=reshard)
        model.train(train)
        if not train:
            model.requires_grad_(False)
        return model

    def forward(self, batch: Batch, *, entropy_grad: bool = False) -> TokenOutputs:
        return model_logprobs(self.model, batch, self.device, self.config.temperature, entropy_grad=entropy_grad)

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        if reference and self.reference is None:
            raise ValueError("this backend was built without a reference model (BackendConfig.reference=False)")
        model = self.reference if reference else self.model
        return model_logprobs(model, batch, self.device, self.config.temperature).logprobs

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> StepStats:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        # clip_grad_norm_ on sharded (DTensor) grads returns a DTensor; the full norm is its local value here.
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm=float(norm), lr=float(lr))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else {}

    def save_state(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / "dcp"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        if self.world_size > 1:
            dist.barrier()

    def load_state(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
