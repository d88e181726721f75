"""Where an RL step's rollouts come from, picked once per rank so that the loop reads the same on every rank and in
every mode:

    RolloutSource   ranks above 0: nothing generated; rank 0's rollouts reach them by broadcast
    SyncSource      rank 0, ``trainer.mode=sync``: each step generates its own rollouts with the current weights
    AsyncSource     rank 0, ``trainer.mode=async``: the next steps' rollouts generate while a step trains, at most
                    ``trainer.max_staleness`` weight versions behind (trainer/async_rollouts.py)

The envs and how their rollouts are played are the run's (trainer/runs.py: the run's generator, or with seats every
seat's player at once: trainer/seated_run.py): a source draws on them, whatever the run's number of policies.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from envkit import tracing
from generators import Trajectory
from generators.report import first_errors
from generators.rollout import PartLost
from trainer.async_rollouts import AsyncRollouts, LoopThread
from trainer.batching import StepBatch
from trainer.checkpoint import TrainState
from trainer.metrics import rollout_metrics, step_outcomes
from trainer.policy import Policy
from trainer.runs import MainRun, Run
from trainer.sources import Mixture

log = logging.getLogger(__name__)


@dataclass
class PolicyStep:
    """One policy's part of a step: its name (none alone in its run), the rollouts it trained on (its seats'), its
    batch and its update's metrics."""

    name: str
    trajs: list[Trajectory]
    batch: StepBatch
    metrics: dict[str, float]

    def logged(self, version: int) -> dict[str, float]:
        """Its rollouts' metrics (``version``: the weights that trained on them) and the update's; under
        ``policy/NAME/`` for a named policy."""
        prefix = f"policy/{self.name}/" if self.name else ""
        return {prefix + k: v for k, v in {**rollout_metrics(self.trajs, self.batch, version), **self.metrics}.items()}


@dataclass
class RolloutDeadline:
    """How long one rollout may run: ``generator.timeout_s`` until a step has finished, then max(``deadline_steps`` ×
    the slowest step so far, ``deadline_floor_s``), never more than ``timeout_s`` (see trainer/config.py)."""

    timeout_s: float
    floor_s: float
    steps: float
    slowest_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The limit for the next step's rollouts."""
        if not self.slowest_s:
            return self.timeout_s
        return min(self.timeout_s, max(self.steps * self.slowest_s, self.floor_s))


class RolloutSource:
    """The source of ranks above 0: it generates nothing and logs nothing, and serves the weights with the run."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def start(self, state: TrainState) -> None:
        """Start generating from ``state`` (after the evaluation of the starting policy)."""

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        """The step's rollouts, and how many drawn groups were dropped as too stale."""
        return [], 0

    def serve(self, policies: list[Policy], version: int) -> bool:
        """Have each policy's engine serve it as ``version``; whether they went from memory."""
        return all([self.run.serve(policy, version) for policy in policies])

    def snapshot(self, state: TrainState) -> None:
        """Put the data positions (and drawn-but-untrained groups) into ``state``, for a checkpoint."""

    def record_step(self, state: TrainState, trajs: list[Trajectory], steps: list[PolicyStep],
                    metrics: dict[str, float]) -> None:
        """Record a finished step: its rollouts, each policy's part of it, and the step's ``metrics``."""

    def close(self) -> None:
        """Stop generating; safe after a failed start."""


class SyncSource(RolloutSource):
    """Rank 0: each step's rollouts come from the policies it trains."""

    def __init__(self, run: MainRun) -> None:
        super().__init__(run)
        self.main = run
        g = run.cfg.generator
        self.deadline = RolloutDeadline(g.timeout_s, g.deadline_floor_s, g.deadline_steps)

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        run = self.main
        run.limit_rollouts(self.deadline.seconds)
        try:
            # each rollout's trace says the step it is generated for
            rollouts = run.rollouts(run.cfg.generator.prompts_per_step)
            trajs = run.runner.run(tracing.within(rollouts, step=state.step + 1))
        except PartLost as e:
            lost = PartLost(f"step {state.step + 1}: {e}")
            log.error("%s: the run stops (its checkpoints are intact)", lost)  # now, not after the teardown
            raise lost from e
        state.data = run.envs.state()
        return trajs, 0

    def record_step(self, state: TrainState, trajs: list[Trajectory], steps: list[PolicyStep],
                    metrics: dict[str, float]) -> None:
        if failed := [t for t in trajs if t.failed]:
            by_env = Counter(t.env_name for t in failed)  # in a mixture, which env's rollouts they were
            log.warning("step %d: %d of %d rollouts failed and were not trained on; first errors: %s; by env: %s",
                        state.step, len(failed), len(trajs), first_errors(failed, limit=3),
                        ", ".join(f"{env} {n}" for env, n in by_env.most_common()))
        # the step's outcomes over every seat's rollouts; a lone policy's own metrics say the same under these names
        metrics = {**step_outcomes(trajs), **{k: v for step in steps for k, v in
                                              step.logged(state.policy_version - 1).items()},
                   **metrics, **self.curriculum(), **self.main.placement.metrics(),
                   "rollout/deadline_s": self.deadline.seconds}
        self.main.logger.log_step(state.step, metrics, trajs)
        self.deadline.slowest_s = max(self.deadline.slowest_s, metrics["time/step_s"])


    def curriculum(self) -> dict[str, float]:
        """The samplers' metrics (trainer/curriculum.py)."""
        return self.main.envs.metrics()


class AsyncSource(SyncSource):
    """Rank 0 in async mode: generation runs on the run's event loop in a thread of its own (a :class:`LoopThread`),
    so it goes on while the trainer trains; a step takes groups drawn at most ``max_staleness`` versions ago."""

    def __init__(self, run: MainRun) -> None:
        super().__init__(run)
        assert isinstance(run.runner, LoopThread)  # open_run(runner=LoopThread) for this mode
        self.loop = run.runner
        self.rollouts = AsyncRollouts(run.envs, run.generate_groups,
                                      prompts_per_step=run.cfg.generator.prompts_per_step,
                                      max_staleness=run.cfg.trainer.max_staleness)
        self.started = False

    def start(self, state: TrainState) -> None:
        self.loop.run(self.rollouts.start(step=state.step, version=state.policy_version, pending=state.pending))
        self.started = True

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        # the rollouts started from now on (they run ahead of the steps: the limit is per rollout, not per step)
        self.main.limit_rollouts(self.deadline.seconds)
        return self.loop.run(self.rollouts.batch(state.step))

    def serve(self, policies: list[Policy], version: int) -> bool:
        from_memory = super().serve(policies, version)
        if self.started:  # a resumed run serves its checkpoint before generation starts
            self.loop.run(self.rollouts.set_version(version))
        return from_memory

    def curriculum(self) -> dict[str, float]:
        return self.loop.run(on_loop(self.main.envs.metrics))  # the samplers draw and observe on the loop

    def snapshot(self, state: TrainState) -> None:
        # a consistent cut: nothing runs on the loop meanwhile
        state.data, state.pending = self.loop.run(snapshot_state(self.main.envs, self.rollouts))

    def close(self) -> None:
        if self.started:
            self.loop.run(self.rollouts.close())


def rollout_source(run: Run) -> RolloutSource:
    """The source of this rank's run: rank 0's generates (in ``trainer.mode``), the others' receive."""
    if not isinstance(run, MainRun):
        return RolloutSource(run)
    return AsyncSource(run) if run.cfg.trainer.mode == "async" else SyncSource(run)


T = TypeVar("T")


async def on_loop(call: Callable[[], T]) -> T:
    """``call()`` run on the event loop awaiting this (the state it reads is that loop's)."""
    return call()


async def snapshot_state(envs: Mixture, rollouts: AsyncRollouts
                         ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The data positions and the drawn-but-untrained groups, taken in one go on the event loop."""
    return envs.state(), rollouts.pending()
