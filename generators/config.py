"""GeneratorConfig: how rollouts are sampled, the settings ``envkit eval``, the trainer and each episode runner share.

A leaf below :mod:`generators.rollout`: the runners (generators/episodes/) that the rollout scheduler imports read
these settings too. Importable from :mod:`generators.rollout` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from generators.engines.base import SamplingParams
from generators.parsers import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES
from generators.tool_prompt import TOOL_PROMPT_CHOICES


@dataclass
class GeneratorConfig:
    """How rollouts are sampled: the one set of rollout settings ``envkit eval`` and the trainer share."""

    samples_per_prompt: int = 1
    """Rollouts per task or seed: a GRPO group in training, samples per task in an evaluation."""
    temperature: float = 1.0
    """Sampling temperature; the rollout logprobs are taken after it, as the trainer computes its own."""
    top_p: float = 1.0
    """Nucleus sampling: 1.0 samples from the whole distribution, as RL should."""
    max_tokens: int = 256
    """Tokens per model turn."""
    max_turns: int = 8
    """Model turns per rollout."""
    max_total_tokens: int = 2048
    """Prompt plus response tokens per rollout (keep within the server's max model length)."""
    timeout_s: float = 300.0
    """Wall-clock limit of one rollout, env and model together; and of scoring one group with ``group_rubric``."""
    concurrency: int = 64
    """Rollouts in flight at once."""
    seed: int | None = None
    """Each request gets its own seed derived from this (rollout, turn, weight version), for engines that honour
    per-request seeds (hf, sglang, vLLM on GPU)."""
    check_template: bool = True
    """Count turns where re-rendering the chat would not reproduce the running ids (diagnostic only)."""
    close_timeout_s: float = 10.0
    """How long env.close() may take before it is abandoned (logged)."""
    tool_parser: str = "auto"
    """The format the model writes tool calls in: auto (read off the chat template; hermes without one), hermes,
    llama3_json, mistral, qwen3_coder or pythonic. An endpoint's own tool_calls (chat mode) come first."""
    reasoning_parser: str = "auto"
    """think: ``<think>...</think>`` text goes to the message's reasoning_content, not its content, and calls in it
    are not made; none: the env sees the text as written; auto: think when the chat template writes ``<think>``
    (always in chat mode). The trajectory's token ids are the same either way."""
    tool_prompt: str = "auto"
    """Where the env's tools go (generators/tool_prompt.py): auto (into the system message, in the tool parser's
    format, when the chat template drops tools=; else to the template), template, inject, or none."""
    gateway_host: str = "127.0.0.1"
    """Where agent envs' capture gateway listens. Loopback unless their agents run on other nodes (Ray env workers
    there): then an address of this node they reach, or 0.0.0.0 (every interface, announced to agents as this
    node's address on its default route). Each episode's key is its credential."""
    group_rubric: str | None = None
    """``module:attr`` naming an :class:`envkit.rewards.rubrics.GroupRubric` (a relative judge) that scores each group's
    finished rollouts together as the group finishes: its score is their reward (see :class:`Generator`)."""
    branch_at: int = 0
    """k >= 1: a group's rollouts share their first k turns, played once and snapshotted (``Env.snapshot``), and
    differ only after (the shared tokens are masked from the loss, so the group's advantages compare what came
    after); sooner where that episode ended before turn k. 0: each rollout plays its own episode."""

    @property
    def sampling(self) -> SamplingParams:
        """The per-turn sampling parameters."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed)

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "max_tokens", "max_turns", "max_total_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.branch_at < self.max_turns:
            raise ValueError(f"branch_at must be >= 0 and below max_turns ({self.max_turns}), got {self.branch_at}")
        for name in ("timeout_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        self.sampling  # noqa: B018 (validates temperature and top_p)
        for name, choices in (("tool_parser", TOOL_PARSER_CHOICES), ("reasoning_parser", REASONING_PARSER_CHOICES),
                              ("tool_prompt", TOOL_PROMPT_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
