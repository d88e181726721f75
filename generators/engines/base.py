"""The InferenceEngine interface every backend implements, and its value types."""

from __future__ import annotations

import abc
import hashlib
import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from envkit import tracing
from envkit.integrations.opponent import POLICY_MODEL_VAR, POLICY_URL_VAR
from envkit.rewards.judges import JUDGE_KEY_VAR, JUDGE_MODEL_VAR, JUDGE_URL_VAR
from generators.engines.transports import TRANSPORTS

FinishReason = Literal["stop", "length", "abort"]

MAX_CONTINUATIONS = 8
"""How often one model turn is continued after weight updates interrupted it, before it ends as it is."""


WEIGHT_SWAPS = ("finish", "interrupt")
"""What a server's requests in flight do when new weights arrive (vLLM's ``weight_swap``)."""
WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)
"""How weights reach a vLLM server from memory (its ``weight_transport``): auto picks the first registered one that
can reach the server."""
_CORE_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def check_cpu_cores(cores: str) -> None:
    """Raise ValueError unless ``cores`` is auto, all, vllm or a core list such as ``0-3`` or ``0,2``."""
    if cores not in ("auto", "all", "vllm") and not _CORE_LIST.fullmatch(cores):
        raise ValueError(f"cpu_cores must be auto, all, vllm or a list of cores such as 0-3 or 0,2; got {cores!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one completion. ``max_tokens`` bounds one model turn."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class Completion:
    """One token-in/token-out generation: the sampled ids and the sampler's logprob of each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    """The weight version that produced this completion."""
    stop_string: str | None = None
    """The ``SamplingParams.stop`` string that ended it, where the engine says which did."""


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """One chat-mode generation (endpoints that cannot take or return token ids)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    completion_tokens: int = 0
    weight_version: int = 0
    reasoning: str | None = None
    """Reasoning the endpoint returned apart from ``content`` (a server running a reasoning parser)."""


class EngineError(RuntimeError):
    """The inference engine failed (server down, crashed, or answered with an error)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered with, when it answered."""


class InferenceEngine(abc.ABC):
    """A model behind an HTTP server. ``supports_token_ids`` engines do token-in/token-out ``generate``; all do
    ``chat``. Use as ``async with engine:`` or call ``start()``/``stop()``."""

    supports_token_ids: bool = True
    model_name: str
    """The name requests use for the served model."""

    @property
    @abc.abstractmethod
    def base_url(self) -> str:
        """The server's root URL, e.g. ``http://127.0.0.1:8000`` (OpenAI routes live under ``/v1``)."""

    @property
    def chat_url(self) -> str | None:
        """The OpenAI-compatible root (``.../v1``) where others can chat with the served model; None in-process."""
        return self.base_url + "/v1"

    @property
    def weight_version(self) -> int:
        """The version of the weights being served (0 = the initial checkpoint)."""
        return 0

    async def start(self) -> None:  # noqa: B027 - external endpoints have nothing to start
        """Start (or connect to) the server and wait until it answers."""

    async def stop(self) -> None:  # noqa: B027
        """Stop the server if this engine owns it; idempotent."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        """Sample a continuation of ``prompt_ids``; returns the new token ids and their logprobs."""
        raise NotImplementedError(f"{type(self).__name__} cannot generate from token ids; use chat()")

    @abc.abstractmethod
    async def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: list[dict[str, Any]] | None = None
    ) -> ChatCompletion:
        """One chat completion for ``messages`` (and OpenAI ``tools``)."""

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF safetensors checkpoint in ``path`` as weight ``version`` (same architecture)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights")

    supports_weight_push: bool = False
    """Whether ``push_weights`` can move weights without the filesystem."""

    async def push_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Serve ``tensors`` (HF parameter names to torch tensors) as weight ``version``, with no file in between."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights from memory; use load_weights")

    async def __aenter__(self) -> InferenceEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def generate_turn(engine: InferenceEngine, prompt_ids: list[int], sampling: SamplingParams,
                        seeded: Callable[[SamplingParams, int], SamplingParams] = lambda s, _: s
                        ) -> AsyncIterator[Completion]:
    """Sample one model turn, in parts: a weight update that aborts the request (partial rollouts) is continued from
    where it stopped on the new weights, up to :data:`MAX_CONTINUATIONS` times. ``seeded(sampling, k)`` gives the
    k-th request its sampling parameters (a per-request seed)."""
    ids, total, sampled = list(prompt_ids), sampling.max_tokens, 0  # the caller may extend prompt_ids meanwhile
    for continuation in range(MAX_CONTINUATIONS + 1):
        with tracing.span("generate", prompt_tokens=len(ids), max_tokens=sampling.max_tokens):
            part = await engine.generate(ids, seeded(sampling, continuation))
            tracing.annotate(tokens=len(part.token_ids), weight_version=part.weight_version,
                             stop_reason=part.finish_reason)
        yield part
        ids += part.token_ids
        sampled += len(part.token_ids)
        if part.finish_reason != "abort" or sampled >= total:
            return
        sampling = replace(sampling, max_tokens=total - sampled)


def request_seed(base: int, *identity: object) -> int:
    """A stable 32-bit seed for one request, from the run's ``base`` seed and what identifies the request (its
    rollout or episode, turn, weight version, continuation)."""
    key = ":".join(str(part) for part in (base, *identity)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big")


def publish_policy(engine: InferenceEngine) -> None:
    """Tell this process's envs (and the processes they start) where the policy answers chat requests: a two-player
    env's ``opponent="policy"`` plays against it (nothing to tell for an in-process engine)."""
    if engine.chat_url is not None:
        os.environ[POLICY_URL_VAR] = engine.chat_url
        os.environ[POLICY_MODEL_VAR] = engine.model_name


def publish_judge(engine: InferenceEngine, api_key: str | None = None) -> None:
    """Tell this process's envs (and the processes they start) where the run's judge answers: an LLM judge made with
    no endpoint calls it (see envkit/rewards/judges.py)."""
    if engine.chat_url is None:
        raise ValueError(f"{type(engine).__name__} runs in-process: no env can call it as a judge")
    os.environ[JUDGE_URL_VAR] = engine.chat_url
    os.environ[JUDGE_MODEL_VAR] = engine.model_name
    if api_key:
        os.environ[JUDGE_KEY_VAR] = api_key


def withdraw_judge() -> None:
    """Forget the judge :func:`publish_judge` published (its server stopped)."""
    for name in (JUDGE_URL_VAR, JUDGE_MODEL_VAR, JUDGE_KEY_VAR):
        os.environ.pop(name, None)


def published() -> dict[str, str]:
    """What :func:`publish_policy` and :func:`publish_judge` told this process, for envs that run in another one
    (a Ray env worker)."""
    names = (POLICY_URL_VAR, POLICY_MODEL_VAR, JUDGE_URL_VAR, JUDGE_MODEL_VAR, JUDGE_KEY_VAR)
    return {name: os.environ[name] for name in names if name in os.environ}
