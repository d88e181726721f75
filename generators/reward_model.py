"""Reward models: an HF sequence-classification model scoring episodes as a rubric part, in batches.

``RewardModel(path)`` is an :class:`envkit.rewards.rubrics.Rubric`: each episode's chat, rendered by the model's chat
template, is one row of a batch; concurrent episodes (a step's rollouts finish together) share forward passes of up
to ``batch_size`` rows, gathered for at most ``max_wait_s``. The score is the model's single logit, squashed to
[0, 1] by a sigmoid unless ``raw=True``::

    rubric = WeightedSum({EnvReward(): 0.5, RewardModel("my-org/my-reward-model"): 0.5})
    env = envkit.make("arithmetic", rubric=rubric)

``RewardModel("bundled")`` is the bundled policy with a one-logit head, made from the bundled model at setup
(``make model``) or else on first use (no downloads, seeded): its scores mean nothing until it is trained, and it
runs the path a real reward model does.

In a process connected to a Ray cluster (``placement.backend=ray``: the trainer's, and its env workers), the model is
one named Ray actor, a :class:`RewardWorker`, that every process's episodes go to, so that they share its batches and
the cluster holds one copy of the weights (``placement="local"`` keeps it in the process). The first process that
scores makes it; the others find it by name.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
from pathlib import Path
from typing import Any, Literal

import ray

from envkit import tracing
from envkit.markup import control_pattern, inert
from envkit.rewards.rubrics import Episode, Rubric, Score
from generators.models import _file_lock, bundled_model_dir, cache_dir
from generators.nodes import node_name

HEAD_SEED = 0
"""The seed of the bundled reward head's initial weights: every machine makes the same one."""


def bundled_reward_model_dir() -> Path:
    """The bundled model with a one-logit sequence-classification head, made on first use; safe across
    processes."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = bundled_model_dir()
    target = cache_dir() / "models" / f"{base.name}-reward-head{HEAD_SEED}"
    marker = target / ".envkit-complete"
    if marker.exists():
        return target
    with _file_lock(target.with_name(target.name + ".lock")):  # not with_suffix: the name has dots in it
        if marker.exists():
            return target
        tokenizer = AutoTokenizer.from_pretrained(base)
        torch.manual_seed(HEAD_SEED)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / marker.name).write_text(json.dumps({"base": str(base), "seed": HEAD_SEED}))
        tmp.rename(target)
    return target


class RewardModel(Rubric):
    """A sequence-classification reward model as a rubric part (see the module docstring)."""

    def __init__(self, path: str | Path = "bundled", *, batch_size: int = 16, max_wait_s: float = 0.005,
                 max_length: int = 2048, raw: bool = False, name: str = "reward_model",
                 placement: Literal["auto", "local", "ray"] = "auto", resources: dict[str, float] | None = None
                 ) -> None:
        if batch_size < 1 or max_wait_s < 0:
            raise ValueError(f"batch_size must be >= 1 and max_wait_s >= 0, got {batch_size}, {max_wait_s}")
        if placement not in ("auto", "local", "ray"):
            raise ValueError(f"placement must be 'auto', 'local' or 'ray', got {placement!r}")
        self.path, self.batch_size, self.max_wait_s = path, batch_size, max_wait_s
        self.max_length, self.raw, self.name = max_length, raw, name
        self.placement = placement
        """auto: the cluster's :class:`RewardWorker` where this process is connected to Ray, else this process."""
        self.resources = resources or {}
        """What the Ray actor reserves (``CPU``, ``GPU``, a node's custom resource to pin it there); none by default,
        so that it never waits for a slot."""
        self._model: Any = None
        self._tokenizer: Any = None
        self._handle: Any = None  # the RewardWorker actor, once found
        self._actor_lock = threading.Lock()
        self._lock = threading.Lock()  # one forward pass at a time, from whichever event loop's thread
        self._queues: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Future[float]]]] = {}
        self._workers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self.batches: list[int] = []
        """The size of every forward pass so far."""

    async def evaluate(self, episode: Episode) -> Score:
        if self._on_ray():
            return Score(await self._remote_score(episode.messages))
        return Score(await self.score_messages(episode.messages))

    def _on_ray(self) -> bool:
        return ray.is_initialized() if self.placement == "auto" else self.placement == "ray"

    @property
    def actor_name(self) -> str:
        """The name of this model's :class:`RewardWorker` (one per path and batching settings)."""
        key = json.dumps([str(self.path), self.batch_size, self.max_wait_s, self.max_length, self.raw])
        return "envkit-reward-" + hashlib.sha256(key.encode()).hexdigest()[:16]

    async def _remote_score(self, messages: list[Any]) -> float:
        try:
            return await (await self._actor()).score_messages.remote(messages, trace=tracing.carrier())
        except ray.exceptions.RayActorError:  # its owner (the process that made it) exited: make it again, once
            self._handle = None
            return await (await self._actor()).score_messages.remote(messages, trace=tracing.carrier())

    async def _actor(self) -> Any:
        """The cluster's worker for this model: found by name, or made here."""
        if self._handle is None:
            await asyncio.to_thread(self._find_actor)  # a blocking lookup by name
        return self._handle

    def _find_actor(self) -> None:
        # One lookup at a time: a second handle to an actor this process made, taken by name while the first is
        # being stored, would replace it, and dropping the creating handle ends the actor.
        with self._actor_lock:
            if self._handle is None:
                options = RewardWorker.options(name=self.actor_name, get_if_exists=True,
                                               num_cpus=self.resources.get("CPU", 0),
                                               num_gpus=self.resources.get("GPU", 0),
                                               resources={k: v for k, v in self.resources.items()
                                                          if k not in ("CPU", "GPU")})
                self._handle = options.remote(str(self.path), self.batch_size, self.max_wait_s, self.max_length,
                                              self.raw)

    async def score_messages(self, messages: list[Any]) -> float:
        """The score of one chat, in this process, batched with the others scored now."""
        loop = asyncio.get_running_loop()
        if self._model is None:
            await asyncio.to_thread(self._load)
        text = self.render(messages)
        future: asyncio.Future[float] = loop.create_future()
        self._queues.setdefault(loop, []).append((text, future))
        worker = self._workers.get(loop)
        if worker is None or worker.done():
            self._workers[loop] = asyncio.ensure_future(self._drain(loop))
        return await future

    def render(self, messages: list[Any]) -> str:
        """The chat as the reward model reads it: every message's text, the policy's included, kept as data (its
        control tokens stay text: a reply cannot close its own turn and write the next); loads the tokenizer."""
        if self._model is None:
            self._load()
        data = [m if not isinstance(m.get("content"), str) else {**m, "content": inert(m["content"], self._control)}
                for m in messages]
        return self._tokenizer.apply_chat_template(data, tokenize=False)

    def _load(self) -> None:
        with self._lock:  # the import too: transformers' lazy imports from two threads at once can fail
            if self._model is not None:
                return
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = bundled_reward_model_dir() if str(self.path) == "bundled" else self.path
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            self._control = control_pattern(self._tokenizer.all_special_tokens)
            model = AutoModelForSequenceClassification.from_pretrained(path)
            if model.config.num_labels != 1:
                raise ValueError(f"a reward model has one output, {path} has {model.config.num_labels}")
            self._model = model.eval()

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run this loop's queued rows in batches until none is left."""
        queue = self._queues[loop]
        while queue:
            if len(queue) < self.batch_size:
                await asyncio.sleep(self.max_wait_s)  # let the rollouts finishing now join this batch
            batch, queue[:] = queue[:self.batch_size], queue[self.batch_size:]
            try:
                values = await asyncio.to_thread(self._forward, [text for text, _ in batch])
            except Exception as e:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), value in zip(batch, values, strict=True):
                if not future.done():
                    future.set_result(value)

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        with self._lock, torch.inference_mode():
            inputs = self._tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                     max_length=self.max_length, add_special_tokens=False)
            logits = self._model(**inputs).logits[:, 0].float().tolist()
        self.batches.append(len(texts))
        return [v if self.raw else 1 / (1 + math.exp(-v)) for v in logits]


@ray.remote
class RewardWorker:
    """A :class:`RewardModel` serving a Ray cluster: concurrent calls, from any process, share its batches."""

    def __init__(self, path: str, batch_size: int, max_wait_s: float, max_length: int, raw: bool) -> None:
        self.model = RewardModel(path, batch_size=batch_size, max_wait_s=max_wait_s, max_length=max_length, raw=raw,
                                 placement="local")

    @tracing.remote_side
    async def score_messages(self, messages: list[Any]) -> float:
        """One chat's score, batched with the other calls in flight."""
        return await self.model.score_messages(messages)

    def node(self) -> str:
        """The node this actor runs on."""
        return node_name()

    def batches(self) -> list[int]:
        """The size of every forward pass so far."""
        return self.model.batches
