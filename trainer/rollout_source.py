"""Where a training step's rollouts come from, picked once per rank so that the loop reads the same on every rank
and in every mode:

    RolloutSource   ranks above 0: no envs, no engine; rank 0's rollouts reach them by broadcast
    SyncSource      rank 0, ``trainer.mode=sync``: each step generates its own rollouts with the current weights
    AsyncSource     rank 0, ``trainer.mode=async``: the next steps' rollouts generate while a step trains, at most
                    ``trainer.max_staleness`` weight versions behind (trainer/async_rollouts.py)

Rank 0's sources also hold what rollouts need (the placement, the envs, the inference engine and its generator),
serve each new policy version to the engine, evaluate held-out, and log. Every rank takes part in serving the weights
and in the final export: the backend gathers them collectively.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from generators import ChatTokenizer, Generator, Trajectory
from generators.engines.base import InferenceEngine, publish_judge, publish_policy, withdraw_judge
from generators.engines.factory import make_judge
from generators.report import first_errors, passed
from trainer.async_rollouts import AsyncRollouts, LoopThread
from trainer.backends.base import TrainBackend
from trainer.backends.hf_export import write_hf_checkpoint
from trainer.checkpoint import TrainState
from trainer.config import Config
from trainer.metrics import RunLogger, rollout_metrics
from trainer.placement import make_placement
from trainer.sources import Mixture

if TYPE_CHECKING:
    from trainer.loop import StepBatch

log = logging.getLogger(__name__)


class RolloutSource:
    """The source of ranks above 0: it generates nothing, evaluates nothing and logs nothing, and takes its part in
    serving and exporting the weights."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self.cfg, self.out = cfg, out

    def open(self, backend: TrainBackend, state: TrainState, *, evaluate_before: bool) -> dict[str, Any]:
        """Get ready to train from ``state`` (a resumed run serves its checkpoint's policy); the held-out results
        before training, where measured."""
        if state.policy_version:
            self.serve(backend, state.policy_version)
        return {}

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        """The step's rollouts, and how many drawn groups were dropped as too stale."""
        return [], 0

    def serve(self, backend: TrainBackend, version: int) -> bool:
        """Have the engine serve the policy as ``version``; whether it went from memory."""
        return sync_weights(backend, None, None, self.out, version, self.cfg.weight_sync.mode)

    def snapshot(self, state: TrainState) -> None:
        """Put the data positions (and drawn-but-untrained groups) into ``state``, for a checkpoint."""

    def log_step(self, state: TrainState, trajs: list[Trajectory], batch: StepBatch, metrics: dict[str, float]
                 ) -> None:
        """Record a finished step: its rollouts, what was trained on, and the update's ``metrics``."""

    def evaluate_every(self, state: TrainState) -> None:
        """Evaluate held-out where ``trainer.eval_every`` says this step should (after its checkpoint: a crash in a
        long evaluation costs no step)."""

    def finish(self, backend: TrainBackend, state: TrainState) -> dict[str, Any]:
        """Put the final policy on disk; its dir, and the held-out results after training where measured."""
        weights = self.out / "weights" / f"v{state.policy_version}"
        if state.policy_version and self.cfg.weight_sync.mode != "disk":  # synced from memory: put it on disk
            backend.export_weights(weights)
        return {"weights": str(weights) if state.policy_version else str(backend.config.model_path)}

    def close(self) -> None:
        """Stop whatever the source started; safe after a failed ``open``."""


class SyncSource(RolloutSource):
    """Rank 0: the envs, the engine and the generator; each step's rollouts come from the policy it trains."""

    def __init__(self, cfg: Config, out: Path, model_path: str | Path, tokenizer: ChatTokenizer, start_step: int,
                 runner: asyncio.Runner | LoopThread | None = None) -> None:
        super().__init__(cfg, out)
        self.runner = runner or asyncio.Runner()
        self.judge = judge_engine(cfg, out, model_path)
        self.placement = make_placement(cfg)  # the engine and the envs: here, or on Ray actors
        self.envs = Mixture(cfg.env, seed=cfg.trainer.seed, make_env=self.placement.make_env)
        self.engine = self.placement.engine(model_path, out)
        self.generator = Generator(self.engine, tokenizer, cfg.generator)
        self.logger = RunLogger(out, cfg, total_steps=cfg.trainer.steps, start_step=start_step)
        self.evaluating = False

    def open(self, backend: TrainBackend, state: TrainState, *, evaluate_before: bool) -> dict[str, Any]:
        # the envs first: a wrong env or task source fails before the inference server starts
        self.runner.run(self.envs.open(pool_size=self.placement.sandbox_pool_size()))
        if self.judge is not None:
            self.runner.run(self.judge.start())
            publish_judge(self.judge, self.cfg.judge.api_key)
        if state.data:
            self.envs.load_state(state.data)
        self.runner.run(self.engine.start())
        publish_policy(self.engine)
        super().open(backend, state, evaluate_before=evaluate_before)
        self.evaluating = self.cfg.trainer.eval_tasks > 0 and any(s.eval for s in self.envs.streams)
        if not (self.evaluating and evaluate_before):
            return {}
        if state.step == 0:
            return {f"{k}_before": v for k, v in self.evaluate(step=0).items()}
        # Resumed: the interrupted run's own evaluation of the initial policy, so the results still read before ->
        # after (evaluating the resumed policy instead would call it "before").
        initial = next((row for row in self.logger.evals if row["step"] == 0), {})
        return {f"{k.removeprefix('eval/')}_before": v for k, v in initial.items() if k != "step"}

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        trajs = self.runner.run(self.envs.rollouts(self.generator, self.cfg.generator.prompts_per_step))
        state.data = self.envs.state()
        return trajs, 0

    def serve(self, backend: TrainBackend, version: int) -> bool:
        return sync_weights(backend, self.engine, self.runner, self.out, version, self.cfg.weight_sync.mode)

    def log_step(self, state: TrainState, trajs: list[Trajectory], batch: StepBatch, metrics: dict[str, float]
                 ) -> None:
        if batch.counts["failed"]:
            failed = [t for t in trajs if t.failed]
            by_env = Counter(t.env_name for t in failed)  # in a mixture, which env's rollouts they were
            log.warning("step %d: %d of %d rollouts failed and were not trained on; first errors: %s; by env: %s",
                        state.step, batch.counts["failed"], len(trajs), first_errors(failed, limit=3),
                        ", ".join(f"{env} {n}" for env, n in by_env.most_common()))
        metrics = {**rollout_metrics(trajs, batch, state.policy_version - 1), **metrics, **self.placement.metrics()}
        self.logger.log_step(state.step, metrics, trajs)

    def evaluate_every(self, state: TrainState) -> None:
        every = self.cfg.trainer.eval_every
        if self.evaluating and every and state.step % every == 0 and state.step < self.cfg.trainer.steps:
            self.evaluate(step=state.step)

    def finish(self, backend: TrainBackend, state: TrainState) -> dict[str, Any]:
        results = super().finish(backend, state)
        if self.evaluating:
            results.update({f"{k}_after": v for k, v in self.evaluate(step=state.step).items()})
        return {**results, **self.logger.finish(results)}

    def evaluate(self, *, step: int) -> dict[str, float]:
        """Held-out results of the policy the engine serves (see :func:`evaluate`)."""
        return evaluate(self.generator, self.envs, self.runner, self.cfg, self.logger, step=step)

    def close(self) -> None:
        stops = [self.engine.stop, self.envs.close, self.placement.close]
        for stop in stops + ([self.judge.stop] if self.judge is not None else []):
            self.runner.run(stop())
        if self.judge is not None:
            withdraw_judge()  # a later run in this process must not call a judge that is gone
        self.runner.close()
        self.logger.close()


class AsyncSource(SyncSource):
    """Rank 0 in async mode: generation runs on an event loop in a thread of its own, so it goes on while the
    trainer trains; a step takes groups drawn at most ``max_staleness`` versions ago."""

    def __init__(self, cfg: Config, out: Path, model_path: str | Path, tokenizer: ChatTokenizer,
                 start_step: int) -> None:
        super().__init__(cfg, out, model_path, tokenizer, start_step, runner=LoopThread())
        self.rollouts = AsyncRollouts(self.envs, self.generator, prompts_per_step=cfg.generator.prompts_per_step,
                                      max_staleness=cfg.trainer.max_staleness)
        self.started = False

    def open(self, backend: TrainBackend, state: TrainState, *, evaluate_before: bool) -> dict[str, Any]:
        results = super().open(backend, state, evaluate_before=evaluate_before)
        self.runner.run(self.rollouts.start(step=state.step, version=state.policy_version, pending=state.pending))
        self.started = True
        return results

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        return self.runner.run(self.rollouts.batch(state.step))

    def serve(self, backend: TrainBackend, version: int) -> bool:
        from_memory = super().serve(backend, version)
        if self.started:  # a resumed run serves its checkpoint before generation starts
            self.runner.run(self.rollouts.set_version(version))
        return from_memory

    def snapshot(self, state: TrainState) -> None:
        # a consistent cut: nothing runs on the loop meanwhile
        state.data, state.pending = self.runner.run(_snapshot(self.envs, self.rollouts))

    def close(self) -> None:
        if self.started:
            self.runner.run(self.rollouts.close())
        super().close()


def rollout_source(cfg: Config, rank: int, out: Path, model_path: str | Path, tokenizer: ChatTokenizer,
                   state: TrainState) -> RolloutSource:
    """This rank's source: rank 0 generates (in ``cfg.trainer.mode``), the others receive."""
    if rank != 0:
        return RolloutSource(cfg, out)
    kind = AsyncSource if cfg.trainer.mode == "async" else SyncSource
    return kind(cfg, out, model_path, tokenizer, state.step)


def judge_engine(cfg: Config, out: Path, model_path: str | Path) -> InferenceEngine | None:
    """The run's judge (``cfg.judge``), not started; None without one."""
    if cfg.judge.model is None:
        return None
    return make_judge(cfg.judge, cfg.judge.model, policy=model_path, log_dir=out / "judge")


def sync_weights(backend: TrainBackend, engine: InferenceEngine | None, runner: asyncio.Runner | LoopThread | None,
                 out: Path, version: int, how: str) -> bool:
    """Have the engine serve the policy as ``version``: sent from memory (``how`` memory, or auto where the engine
    can take it), else as an HF checkpoint it reloads (only the newest is kept); whether it went from memory. Every
    rank gathers the weights; rank 0, which holds the engine (and the ``runner`` it is driven from), sends them."""
    weights = backend.served_weights()
    if engine is None or runner is None:
        return False
    if how != "disk" and engine.supports_weight_push:
        try:
            runner.run(engine.push_weights(weights, version))
            return True
        except Exception as e:
            if how == "memory":
                raise
            log.warning("sending weights v%d from memory failed (%s: %s); loading them from disk instead", version,
                        type(e).__name__, e)
    path = out / "weights" / f"v{version}"
    write_hf_checkpoint(weights, Path(backend.config.model_path), path)
    runner.run(engine.load_weights(path, version))
    for old in (out / "weights").glob("v*"):
        if old != path and old.name[1:].isdigit():
            shutil.rmtree(old, ignore_errors=True)
    return False


async def _snapshot(envs: Mixture, rollouts: AsyncRollouts) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """The data positions and the drawn-but-untrained groups, taken in one go on the event loop."""
    return envs.state(), rollouts.pending()


def evaluate(generator: Generator, envs: Mixture, runner: asyncio.Runner | LoopThread, cfg: Config,
             logger: RunLogger, *, step: int) -> dict[str, float]:
    """Held-out accuracy (fraction of rollouts with reward >= 1) and mean reward, over every env and per env of a
    mixture: sampled at the eval temperature with ``eval_samples`` per task, and greedy (one per task) when
    ``eval_greedy``. Where an env has tools, also the share of episodes that called one (``tool_call_rate``)."""
    settings = {"accuracy": (cfg.trainer.eval_temperature, cfg.trainer.eval_samples)}
    if cfg.trainer.eval_greedy:
        settings["greedy_accuracy"] = (0.0, 1)
    # Both sets of rollouts at once, each with its share of the concurrency: one after the other, the engine would
    # idle while the first set's slowest rollouts finish.
    total = sum(samples for _, samples in settings.values())
    generators = [Generator(generator.engine, generator.tokenizer, cfg.generator.generator_config(
        temperature=temperature, samples_per_prompt=samples, seed=None, branch_at=0,
        concurrency=max(1, cfg.generator.concurrency * samples // total)))
        for temperature, samples in settings.values()]

    async def rollouts() -> list[list[Trajectory]]:
        return await asyncio.gather(*(envs.eval_rollouts(g, cfg.trainer.eval_tasks) for g in generators))

    results: dict[str, float] = {}
    for name, trajs in zip(settings, runner.run(rollouts()), strict=True):
        groups = {"": trajs} if len(envs.streams) == 1 else {"": trajs, **{
            f"{label}/": [t for t in trajs if t.env_name == label] for label in envs.labels}}
        reward_name = "reward" if name == "accuracy" else "greedy_reward"
        values: dict[str, float] = {}
        tool_envs = {s.label for s in envs.streams if s.tools}
        for prefix, group in groups.items():
            n = max(len(group), 1)
            values[prefix + name] = sum(passed(t) for t in group) / n
            values[prefix + reward_name] = sum(t.reward for t in group if not t.failed) / n
            if any(t.env_name in tool_envs or t.tool_log for t in group):
                rate = "tool_call_rate" if name == "accuracy" else "greedy_tool_call_rate"
                values[prefix + rate] = sum(t.tool_calls > 0 for t in group if not t.failed) / n
        logger.log_eval(step, name, values, trajs)
        results.update(values)
    return results
