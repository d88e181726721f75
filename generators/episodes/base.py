"""What every episode runner shares: the rollout in progress (:class:`Rollout`) and the runner interface."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from envkit import Env, Task
from generators.trajectory import StopReason, Trajectory, mark_version


@dataclass
class Rollout:
    """The state of one rollout in progress."""

    traj: Trajectory
    tools: list[dict[str, Any]] | None = None
    """The env's tools as OpenAI schemas (what the parser types calls by)."""
    template_tools: list[dict[str, Any]] | None = None
    """The tools the chat template is given (None where they are written into the system message)."""
    ids: list[int] = field(default_factory=list)
    """The running context: prompt plus response so far."""
    written: dict[int, str] = field(default_factory=dict)
    """What the model wrote, by the index of its message in ``traj.messages`` (which holds it parsed)."""
    pending: list[int] = field(default_factory=list)
    """Env tokens, added to the context only once another model turn follows them."""
    generate_s: float = 0.0
    env_s: float = 0.0

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Add tokens to the context and the response: the model's (with ``logprobs``: trained on) or the env's."""
        self.ids.extend(ids)
        self.traj.response_ids.extend(ids)
        self.traj.loss_mask.extend([1 if logprobs is not None else 0] * len(ids))
        self.traj.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def mark_version(self, version: int) -> None:
        """Record that model tokens from here on are sampled by ``version``."""
        if not self.traj.version_spans:
            self.traj.policy_version = version
        mark_version(self.traj.version_spans, len(self.traj.response_ids), version)


AtTurn = Callable[[Env, Rollout], Awaitable[None]]
"""A hook awaited before each model turn (branching's: snapshot the env there)."""


class EpisodeRunner(Protocol):
    """Plays one kind of episode into a rollout's trajectory."""

    def accepts(self, env: Env) -> bool:
        """Whether this runner plays ``env``'s episodes (asked once the env is ``init``-ed)."""
        ...

    async def play(self, env: Env, state: Rollout, task: Task | None, seed: int | None, *,
                   at_turn: AtTurn | None = None, resumed: bool = False) -> StopReason:
        """Play the episode from its reset, or from where ``state`` stands (``resumed``: a branch, its env
        restored); ``at_turn`` is awaited before each model turn. Returns why it stopped."""
        ...
