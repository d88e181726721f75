"""Trajectory: one rollout as training data, with JSONL I/O (the trainer's tensors: ``trainer/batching.py``).

Token layout (the contract between generators and trainer)::

    prompt_ids    the opening messages rendered by the chat template, with the generation prompt
    response_ids  every token after the prompt, in order: model tokens and env (observation) tokens
    loss_mask     per response token: 1 = sampled by the model, 0 = written by the env or the template
    rollout_logprobs  per response token: the sampler's logprob for model tokens, 0.0 for env tokens
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

StopReason = Literal["done", "max_turns", "max_tokens", "timeout", "error"]
STOP_REASONS: tuple[StopReason, ...] = ("done", "max_turns", "max_tokens", "timeout", "error")


def mark_version(spans: list[list[int]], position: int, version: int) -> None:
    """Record in ``spans`` (``[position, version]`` pairs, as :attr:`Trajectory.version_spans`) that the model
    tokens from ``position`` on are sampled by ``version``."""
    if not spans or spans[-1][1] != version:
        spans.append([position, version])


@dataclass
class Trajectory:
    """One multi-turn rollout of a model in an env. ``failed`` ones (error/timeout) carry the reason, not tokens."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    step_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    stop_reason: StopReason = "done"
    truncated: bool = False
    """The env ended the episode by truncation (its own budget) rather than termination."""
    error: str | None = None
    policy_version: int = 0
    """The weight version that sampled the first model token (the oldest, so the one staleness counts from); -1 for
    a demonstration, whose assistant turns the env wrote (``Generator.demonstrate``)."""
    version_spans: list[list[int]] = field(default_factory=list)
    """``[response position, weight version]`` at the first model token and wherever the version that sampled the
    model tokens changes: within a turn when a weight update interrupted it (partial rollouts), else between turns."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    env_name: str = ""
    task_id: str | None = None
    group_id: str = ""
    """Rollouts of the same task and seed share a group id (the unit GRPO normalizes over)."""
    sample_index: int = 0
    branch_turn: int | None = None
    """The turns this rollout shares with the rest of its group (``generator.branch_at``), masked from its loss:
    they are the group's, and its advantage is for what it did after them. None: it shares none."""
    seed: int | None = None
    template_mismatches: int = 0
    """Turns where re-rendering the chat would not reproduce the running token ids (counted, never fixed up)."""
    refused_calls: int = 0
    """An agent episode's calls that its own gateway port refused for their key (a key of another episode, or none
    the gateway gave): an agent process reaching for what is not its own."""
    tool_log: list[dict[str, Any]] = field(default_factory=list)
    """One entry per tool call the model wrote, in order: ``turn``, ``name``, ``status`` (ok, error, timeout as the
    env reports it; unknown where it does not; unparsed for a call that could not be read, with name None) and what
    the tool added (``sandbox``: where code ran)."""
    tokenizer: str = ""
    """``NAME@HASH`` of the tokenizer whose ids these are (:attr:`ChatTokenizer.fingerprint`): ids mean nothing to a
    model with another vocabulary."""
    scores: dict[str, float] = field(default_factory=dict)
    """The reward's breakdown by rubric part, where a rubric scored the episode (:mod:`envkit.rewards.rubrics`)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent: ``generate`` (model), ``env`` (reset+step), ``total``."""
    seat: str | None = None
    """The seat this rollout played in a multi-agent episode (:mod:`generators.seats`); None in a single-agent one."""
    outcome: dict[str, Any] = field(default_factory=dict)
    """A multi-agent episode's outcome as its env's last turn told it (``Turn.info``: scalars only)."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    """Further token sequences of the episode, each with its own ``prompt_ids``, ``response_ids``, ``loss_mask``,
    ``rollout_logprobs`` and ``version_spans``: an agent's calls that did not continue the first sequence
    (:mod:`generators.gateway`). Each trains as a sequence of its own with this episode's reward and advantage."""

    @property
    def failed(self) -> bool:
        """True for rollouts that errored or timed out; trainers drop these."""
        return self.stop_reason in ("error", "timeout")

    @property
    def tool_calls(self) -> int:
        """How many tool calls the model wrote that could be read."""
        return sum(entry["status"] != "unparsed" for entry in self.tool_log)

    @property
    def num_model_tokens(self) -> int:
        """How many response tokens the model sampled, in every segment."""
        return sum(sum(t.loss_mask) for t in self.sequences())

    def sequences(self) -> list[Trajectory]:
        """One trajectory per token sequence: this one's first sequence, then one per :attr:`segments` entry, each
        with the episode's reward (what the trainer trains on)."""
        if not self.segments:
            return [self]
        return [replace(self, segments=[]), *(replace(self, segments=[], **segment) for segment in self.segments)]

    def check(self) -> None:
        """Raise ValueError if the per-token lists disagree in length or the mask is not 0/1."""
        for segment in self.sequences()[1:]:
            segment.check()
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"response_ids ({n}), loss_mask ({len(self.loss_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        """Rebuild from ``to_json()`` output; unknown keys are rejected so format drift is loud."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Trajectory fields: {sorted(unknown)}")
        return cls(**data)


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """Write one trajectory per line (atomically: a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json()) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    """Read trajectories written by :func:`write_jsonl`."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield Trajectory.from_json(json.loads(line))
