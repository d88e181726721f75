"""What a run is, whatever its stage trains. Every stage (trainer/loop.py RL, trainer/sft.py SFT) reads:

    run     = open_run(cfg, ...)        seeds; this rank's part (rank 0: envs, judge, inference engine, logger)
    made    = run.start(prepare)        envs, judge and engine up; ``prepare`` runs meanwhile, its result broadcast
    policies = run.policies(make)       the policies being trained (trainer/policy.py), each with its checkpoints
                                        and engine: one, or with seats one per policy a seat names
    state   = run.resume(policies, ...) a fresh state, or the checkpoint ``trainer.resume`` names (policies served)
    results = run.results_before(...)   held-out results of the starting policies
    loop:   ... run.logger.log_step(...); run.due(...) and run.save(...); run.evaluate_every(...)
    results = run.finish(...)           the final weights on disk, held-out results after, the report
    run.close()                         everything started, stopped (in ``finally``)

Rank 0 holds the run's services (:class:`MainRun`); ranks above 0 hold :class:`Run`, whose parts do nothing (a
:class:`~trainer.metrics.NullLogger`, no engine, no evaluation) but take their part in every collective: checkpoints,
serving the weights, exporting them. So a stage's code has no rank checks. A run of a multi-agent env's seats is a
:class:`MainRun` too (trainer/seated_run.py): its policies, its players and how its episodes are played are its own.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from generators import ChatTokenizer, Generator, Trajectory
from generators.engines.base import EngineError, InferenceEngine, publish_judge, publish_policy, withdraw_judge
from generators.engines.factory import make_judge
from generators.models import resolve_model
from generators.report import passed
from trainer.async_rollouts import LoopThread
from trainer.backends.base import TrainBackend
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import Config
from trainer.distributed import broadcast_from_rank0, init_distributed, shutdown_distributed
from trainer.metrics import NullLogger, RunLogger
from trainer.placement.base import Placement
from trainer.policy import Policy
from trainer.sources import EnvStream, Mixture, Start, generate_starts

log = logging.getLogger(__name__)
T = TypeVar("T")


class Run:
    """A run on a rank above 0: it generates, evaluates and logs nothing, and takes its part in every collective."""

    engine: InferenceEngine | None = None
    runner: asyncio.Runner | LoopThread | None = None

    def __init__(self, cfg: Config, model_path: str, tokenizer: ChatTokenizer) -> None:
        self.cfg, self.model_path, self.tokenizer = cfg, model_path, tokenizer
        self.out = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.out / "checkpoints", keep_last=cfg.trainer.keep_last)
        self.logger: RunLogger | NullLogger = NullLogger()
        self.evaluating = False
        """Held-out evaluation happens (every rank knows after ``resume``: serving weights for it is collective)."""

    def start(self, prepare: Callable[[MainRun], Awaitable[T]] | None = None) -> T | None:
        """Start the run's services, running ``prepare(run)`` on rank 0 meanwhile; what it made, on every rank."""
        return broadcast_from_rank0(None)

    def on_main(self, make: Callable[[], T], elsewhere: T) -> T:
        """``make()`` on rank 0, ``elsewhere`` on the ranks above it: a part that rank 0 alone holds (a teacher),
        with the stand-in that takes its place in the collectives."""
        return elsewhere

    def policy(self, backend: TrainBackend) -> Policy:
        """The policy ``backend`` trains, with the run's checkpoints, output dir and engine."""
        return Policy(backend, self.checkpoints, self.out, self.engine)

    def policies(self, make: Callable[[str], TrainBackend]) -> list[Policy]:
        """The policies the run trains, each with the backend ``make(its starting weights)``: one here."""
        return [self.policy(make(self.model_path))]

    def resume(self, policies: Sequence[Policy], *, total_steps: int, stage: str) -> TrainState:
        """The state to train from: fresh, or the checkpoint ``trainer.resume`` names, loaded into ``policies``;
        resumed policies are served to their engines."""
        state = self.restored(policies)
        self.evaluating = broadcast_from_rank0(self.evaluating)
        self.begin(state, total_steps=total_steps, stage=stage)
        if state.policy_version:
            for policy in policies:
                self.serve(policy, state.policy_version)
        return state

    def restored(self, policies: Sequence[Policy]) -> TrainState:
        """A fresh state, or the loop state of the checkpoint ``trainer.resume`` names, loaded into ``policies``."""
        resume = self.cfg.trainer.resume
        [policy] = policies  # one policy's checkpoint is where trainer.resume says
        return policy.load_state(resume) if resume else TrainState()

    def begin(self, state: TrainState, *, total_steps: int, stage: str) -> None:
        """Rank 0: the logger, and the envs' data positions of a resumed run (``resume`` calls it; a stage that
        restores its state itself calls it after)."""

    def serve(self, policy: Policy, version: int) -> bool:
        """Have ``policy``'s engine serve it as ``version``; whether it went from memory."""
        try:
            return policy.save_weights_for_sampler(version, self.runner, self.cfg.weight_sync.mode)
        except EngineError as e:  # said now, naming the step, not after the teardown
            log.error("step %d: its weights reached no inference replica: %s: the run stops (its checkpoints are "
                      "intact)", version, e)
            raise

    def evaluate(self, *, step: int) -> dict[str, float]:
        """Held-out results of the policy the engine serves (see :func:`evaluate`)."""
        return {}

    def results_before(self, state: TrainState, *, evaluate_before: bool) -> dict[str, Any]:
        """Held-out results of the starting policy (``NAME_before``): measured, or for a resumed run, read back
        from the interrupted run's log (evaluating the resumed policy would call it "before")."""
        if not (self.evaluating and evaluate_before):
            return {}
        if state.step == 0:
            return {f"{k}_before": v for k, v in self.evaluate(step=0).items()}
        initial = next((row for row in self.logger.evals if row["step"] == 0), {})
        return {f"{k.removeprefix('eval/')}_before": v for k, v in initial.items() if k != "step"}

    def due(self, state: TrainState, *, last: bool) -> bool:
        """Whether this step is checkpointed: where ``trainer.save_every`` says, and the ``last``."""
        return last or state.step % self.cfg.trainer.save_every == 0

    def save(self, policies: Sequence[Policy], state: TrainState) -> None:
        """Checkpoint every policy with ``state`` (collective)."""
        for policy in policies:
            policy.save_state(state)

    def evaluate_every(self, state: TrainState, *, total_steps: int) -> None:
        """Evaluate held-out where ``trainer.eval_every`` says (after the step's checkpoint: a crash in a long
        evaluation costs no step); the final evaluation is ``finish``'s."""
        every = self.cfg.trainer.eval_every
        if self.evaluating and every and state.step % every == 0 and state.step < total_steps:
            self.evaluate(step=state.step)

    def finish(self, policies: Sequence[Policy], state: TrainState, results: dict[str, Any]) -> dict[str, Any]:
        """``results`` with each final policy's dir (``weights``, or ``weights/NAME`` for a named one; written if it
        is not on disk yet: collective), the held-out results after training and the report's paths."""
        results = {**results, **{f"weights/{p.name}" if p.name else "weights": p.save_weights(state.policy_version)
                                 for p in policies}}
        if self.evaluating:
            results.update({f"{k}_after": v for k, v in self.evaluate(step=state.step).items()})
        return {**results, **self.logger.finish(results)}

    def close(self) -> None:
        """Stop whatever the run started; safe after a failed start."""
        self.logger.close()
        shutdown_distributed()


class MainRun(Run):
    """Rank 0's run: the placement, the envs, the judge, the inference engine and its generator, the logger."""

    elsewhere: type[Run] = Run
    """The run of the ranks above 0 beside this one."""

    def __init__(self, cfg: Config, model_path: str, tokenizer: ChatTokenizer, *, placement: Placement,
                 engine: bool = True, runner: asyncio.Runner | LoopThread | None = None) -> None:
        super().__init__(cfg, model_path, tokenizer)
        self.runner = runner or asyncio.Runner()
        self.placement = placement
        self.judge = judge_engine(cfg, self.out, model_path)
        self.envs = Mixture(cfg.env, seed=cfg.trainer.seed, make_env=placement.make_env,
                            curriculum=cfg.curriculum)
        self.engine = placement.engine(model_path, self.out) if engine else None
        self.generator = Generator(self.engine, tokenizer, cfg.generator) if self.engine is not None else None

    def start(self, prepare: Callable[[MainRun], Awaitable[T]] | None = None) -> T | None:
        # the envs first: a wrong env or task source fails before the inference server starts
        self.runner.run(self.envs.open(pool_size=self.placement.sandbox_pool_size()))
        if self.judge is not None:
            self.runner.run(self.judge.start())
            publish_judge(self.judge, self.cfg.judge.api_key)
        made = self.runner.run(self._start_engine(prepare))
        self.evaluating = (self.generator is not None and self.cfg.trainer.eval_tasks > 0
                           and any(s.eval for s in self.envs.streams))
        return broadcast_from_rank0(made)

    def on_main(self, make: Callable[[], T], elsewhere: T) -> T:
        return make()

    async def _start_engine(self, prepare: Callable[[MainRun], Awaitable[T]] | None) -> T | None:
        """The engine starting (a minute on CPU) and ``prepare`` at once: the data need not wait for the server."""
        jobs: list[Awaitable[Any]] = [prepare(self) if prepare is not None else asyncio.sleep(0)]
        if self.engine is not None:
            jobs.append(self.engine.start())
        made = (await asyncio.gather(*jobs))[0]
        if self.engine is not None:
            publish_policy(self.engine)
        return made

    def begin(self, state: TrainState, *, total_steps: int, stage: str) -> None:
        self.logger = RunLogger(self.out, self.cfg, total_steps=total_steps, start_step=state.step, stage=stage)
        if state.data:
            self.envs.load_state(state.data)

    def evaluate(self, *, step: int) -> dict[str, float]:
        assert self.generator is not None and isinstance(self.logger, RunLogger)  # evaluating: both exist
        return evaluate(self.generator, self.envs, self.runner, self.cfg, self.logger, step=step)

    def finish(self, policies: Sequence[Policy], state: TrainState, results: dict[str, Any]) -> dict[str, Any]:
        nodes = self.placement.nodes()
        return super().finish(policies, state, {**results, **({"nodes": nodes} if nodes else {})})

    def limit_rollouts(self, timeout_s: float) -> None:
        """Rollouts started from now on run at most ``timeout_s`` (trainer/rollout_source.py's deadline)."""
        assert self.generator is not None  # an RL run always has an engine
        self.generator.config = replace(self.generator.config, timeout_s=timeout_s)

    def rollouts(self, prompts: int) -> Awaitable[list[Trajectory]]:
        """The ``samples_per_prompt`` rollouts of each of the next ``prompts`` starts (sync mode)."""
        assert self.generator is not None
        return self.envs.rollouts(self.generator, prompts, refill=self.cfg.curriculum.refill)

    def generate_groups(self, stream: EnvStream, starts: list[Start],
                        on_group: Callable[[int, list[Trajectory]], None]) -> Awaitable[Any]:
        """Each of ``starts``' rollouts as one group, handed to ``on_group(i, group)`` as it completes (async mode's
        :class:`~trainer.async_rollouts.AsyncRollouts` draws them)."""
        assert self.generator is not None
        return generate_starts(self.generator, stream, starts, on_group=on_group)

    def close(self) -> None:
        # the engine before the placement, which may hold the actors it runs on
        stops = [*([self.engine.stop] if self.engine is not None else []), self.envs.close, self.placement.close,
                 *([self.judge.stop] if self.judge is not None else [])]
        for stop in stops:
            self.runner.run(stop())
        if self.judge is not None:
            withdraw_judge()  # a later run in this process must not call a judge that is gone
        self.runner.close()
        super().close()


def open_run(cfg: Config, *, placement: Callable[[Config], Placement], engine: bool = True,
             runner: Callable[[], asyncio.Runner | LoopThread] = asyncio.Runner,
             main: type[MainRun] = MainRun) -> Run:
    """This rank's run, seeded: rank 0's a ``main`` holding the services (``placement(cfg)``, the engine unless
    ``engine`` is false, driven from ``runner()``), the others' take part in the collectives only."""
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    rank, _, _ = init_distributed()
    model_path = resolve_model(cfg.model.path)
    tokenizer = ChatTokenizer.from_pretrained(model_path)
    if rank != 0:
        return main.elsewhere(cfg, model_path, tokenizer)
    return main(cfg, model_path, tokenizer, placement=placement(cfg), engine=engine, runner=runner())


def judge_engine(cfg: Config, out: Path, model_path: str | Path) -> InferenceEngine | None:
    """The run's judge (``cfg.judge``), not started; None without one."""
    if cfg.judge.model is None:
        return None
    return make_judge(cfg.judge, cfg.judge.model, policy=model_path, log_dir=out / "judge")


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
