"""Several policies trained in one run: each seat of a multi-agent env bound to a player (``seats``), the policies
among them trained together, each a model of its own. One step:

    episodes = play_starts(env, players, next prompts_per_step starts × samples_per_prompt)   every seat at once
    for each policy:
        trajs  = its seats' trajectories                        its own sampled tokens only (generators/seats.py)
        batch  = prepare_batch(trajs)                           groups per start and seat: per-seat baselines
        update_policy(its backend, batch)                       trainer/loop.py's update, its own optimizer
    for each policy: its weights v(step+1) → its engine

In ``trainer.mode=async`` the episodes come from :class:`~trainer.async_rollouts.AsyncRollouts`, as a single policy's
rollouts do: the next steps' episodes play while this one trains, each start's trajectories (every seat's) one
group under the staleness bound. Each policy has its own backend (optimizer, scheduler), engine, weight sync and
checkpoints (``OUT/policies/NAME/checkpoints``); the run's metrics carry one ``policy/NAME/...`` set per policy. An
engine is a vLLM server of the policy's own, or with LoRA (``model.lora.serve``) the policy's adapter on the run's
one server, which also serves the base model: its weight sync writes the adapter and has the server load it.
Held-out evaluation plays the trained seats together, and each policy in each of its seats with every other trained
seat played by the starting model, so co-adaptation shows apart from what one policy learned alone.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from envkit.imports import import_ref
from envkit.multi_agent import MultiAgentEnv, Seat
from generators import Generator, GeneratorConfig, Trajectory
from generators.engines.base import InferenceEngine
from generators.engines.factory import make_engine
from generators.engines.vllm import VLLMEngine, lora_rank_limit
from generators.models import resolve_model
from generators.report import passed, seat_results
from generators.seats import AgentPlayer, Player, Seating, local_seats, play_starts, remote_seats
from trainer.async_rollouts import AsyncRollouts, LoopThread
from trainer.backends import make_backend
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import Config, ConfigError, InferenceConfig
from trainer.loop import prepare_batch, update_policy
from trainer.metrics import RunLogger, rollout_metrics
from trainer.placement import make_placement
from trainer.placement.base import Placement
from trainer.policy import AdapterPolicy, Policy
from trainer.rollout_source import on_loop, snapshot_state
from trainer.runs import MainRun, open_run
from trainer.sft import train_sft
from trainer.sources import EnvStream, Start


class PolicyRun:
    """The run's policies and frozen players on the run skeleton (trainer/runs.py: seeding, the model and tokenizer,
    the placement, the envs, the judge, the logger and the event loop are the :class:`MainRun`'s)."""

    def __init__(self, cfg: Config) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("seats: a run of several policies trains on one rank (no torchrun) for now")
        run = open_run(cfg, placement=make_placement, engine=False,
                       runner=LoopThread if cfg.trainer.mode == "async" else asyncio.Runner)
        assert isinstance(run, MainRun)  # one rank: the check above
        self.main = run
        self.cfg, self.out, self.model_path, self.tokenizer = cfg, run.out, run.model_path, run.tokenizer
        self.runner, self.envs, placement = run.runner, run.envs, run.placement
        self.server: VLLMEngine | None = None
        """With ``model.lora.serve`` adapters: the one vLLM server, of the base model and each policy's adapter."""
        if cfg.lora_adapters:
            server = placement.engine(self.model_path, self.out / "server", max_loras=len(cfg.policies),
                                      max_lora_rank=lora_rank_limit(cfg.model.lora.r))
            assert isinstance(server, VLLMEngine)
            self.server = server
        self.policies: list[Policy] = []
        """One per name the seats bind (trainer/policy.py), each with its own checkpoints under
        ``OUT/policies/NAME``: an adapter of the one server, or a model with an engine of its own."""
        kind = AdapterPolicy if self.server else Policy
        for name in cfg.policies:
            out = self.out / "policies" / name
            start = resolve_model(cfg.model.policy_paths[name]) if name in cfg.model.policy_paths else self.model_path
            engine = self.server.adapter(name) if self.server else placement.engine(start, out)
            self.policies.append(kind(
                make_backend(cfg, start), CheckpointManager(out / "checkpoints", keep_last=cfg.trainer.keep_last),
                out, engine=engine, name=name, seats=[seat for seat, s in cfg.seats.items() if s.policy == name]))
        self.generators = {p.name: Generator(p.engine, self.tokenizer, cfg.generator) for p in self.policies}
        """What samples from each policy, by name."""
        self.frozen: dict[str, InferenceEngine] = {}
        """Engines of frozen checkpoints, by checkpoint."""
        self.fixed: dict[Seat, Player] = {seat: self._fixed_player(s.checkpoint, s.script, s.endpoint,
                                                                     s.endpoint_model, placement)
                                          for seat, s in cfg.seats.items() if not s.policy}
        self.agents = {seat: import_ref(s.agent) for seat, s in cfg.seats.items() if s.agent}
        """The agents that play seats, each calling its seat's policy or checkpoint through the capture gateway."""
        if cfg.trainer.eval_tasks:  # the starting model, each trained policy's frozen opponent in evaluation
            self._frozen_engine("initial", placement)
        self.seating = {stream.label: _seating(stream) for stream in self.envs.streams}
        """How each env's episodes seat their players: a session per seat on its server, or an env made here."""

    def _fixed_player(self, checkpoint: str | None, script: str | None, endpoint: str | None, endpoint_model: str,
                      placement: Placement) -> Player:
        """A seat's player that this run does not train."""
        if script:
            return import_ref(script)
        if endpoint:
            engine = make_engine(InferenceConfig(engine="openai", url=endpoint), endpoint_model)
            return Generator(engine, None, self.cfg.generator)
        assert checkpoint is not None
        return Generator(self._frozen_engine(checkpoint, placement), self.tokenizer, self.cfg.generator)

    def _frozen_engine(self, checkpoint: str, placement: Placement) -> InferenceEngine:
        """The engine serving ``checkpoint`` (a dir, or ``initial``: the starting model), one per checkpoint."""
        if checkpoint not in self.frozen:
            path = self.model_path if checkpoint == "initial" else resolve_model(checkpoint)
            self.frozen[checkpoint] = self.server if self.server and checkpoint == "initial" else \
                placement.engine(path, self.out / "frozen" / Path(checkpoint).name)
        return self.frozen[checkpoint]

    def players(self, *, config: GeneratorConfig | None = None, initial: frozenset[Seat] = frozenset()
                ) -> dict[Seat, Player]:
        """Every seat's player: the policy it is bound to, or its frozen, scripted or endpoint player; the seats in
        ``initial`` played by the starting model; an agent's seat played by its agent calling that player. With
        ``config`` the generators are new ones with those settings (held-out evaluation: the ones generating for
        training, in async mode at the same time, keep theirs)."""
        policy_of = {seat: self.generators[p.name] for p in self.policies for seat in p.seats}
        out: dict[Seat, Player] = {}
        for seat in self.cfg.seats:
            player = Generator(self.frozen["initial"], self.tokenizer, self.cfg.generator) if seat in initial \
                else policy_of.get(seat) or self.fixed[seat]
            if config is not None and isinstance(player, Generator):
                player = Generator(player.engine, player.tokenizer, config)
            out[seat] = AgentPlayer(self.agents[seat], player) if seat in self.agents else player
        return out

    @property
    def logger(self) -> RunLogger:
        """The run's logger (once :meth:`resume` began the run)."""
        assert isinstance(self.main.logger, RunLogger)  # rank 0's, after resume
        return self.main.logger

    def start(self) -> None:
        """The env's seats checked against the binding; the run's envs and judge, then every engine at once."""
        for stream in self.envs.streams:
            if _served(stream):  # a server checks its sessions' seats itself
                continue
            probe = stream.make(here=True)
            self.runner.run(probe.close())
            if not isinstance(probe, MultiAgentEnv) or set(probe.seats) != set(self.cfg.seats):
                has = f"has seats {list(probe.seats)}" if isinstance(probe, MultiAgentEnv) else "has no seats"
                raise ConfigError(f"env {stream.cfg.name!r} {has}; seats binds {sorted(self.cfg.seats)}: bind "
                                  "each of its seats to a player")
        engines = [p.engine for p in self.policies] + list(self.frozen.values())
        self.main.start(lambda _: _gather(*(e.start() for e in engines)))

    async def play(self, stream: EnvStream, starts: list[Start], *, samples: int,
                   players: Mapping[Seat, Player] | None = None) -> list[dict[Seat, Trajectory]]:
        """``samples`` episodes of each start in ``stream``'s env with ``players`` (the run's own by default); group
        ids carry the env's label, so a mixture's envs never share a group."""
        g = self.cfg.generator
        episodes = await play_starts(self.seating[stream.label], players or self.players(), starts, samples=samples,
                                     concurrency=g.concurrency, env_name=stream.label, timeout_s=g.timeout_s)
        for episode in episodes:
            for t in episode.values():
                t.group_id = f"{stream.label}/{t.group_id}"
        return episodes

    async def play_draws(self, draws: list[tuple[EnvStream, list[Start]]]) -> list[Trajectory]:
        """Sync mode's generation: the episodes of each drawn start in its env, every seat's trajectories of a
        start going to its env's sampler (a curriculum's pass rates count every seat's rollouts)."""
        samples = self.cfg.generator.samples_per_prompt

        async def one(stream: EnvStream, starts: list[Start]) -> list[Trajectory]:
            episodes = await self.play(stream, starts, samples=samples)  # each start's samples in a row
            for i, start in enumerate(starts):
                stream.observe(start, [t for e in episodes[i * samples:(i + 1) * samples] for t in e.values()])
            return [t for episode in episodes for t in episode.values()]

        played = await asyncio.gather(*(one(stream, starts) for stream, starts in draws))
        return [t for trajs in played for t in trajs]

    async def play_groups(self, stream: EnvStream, starts: list[Start],
                          on_group: Callable[[int, list[Trajectory]], None]) -> None:
        """Async mode's generation: each start's episodes, every seat's trajectories of them one group."""
        async def one(i: int, start: Start) -> None:
            episodes = await self.play(stream, [start], samples=self.cfg.generator.samples_per_prompt)
            on_group(i, [t for episode in episodes for t in episode.values()])

        await asyncio.gather(*(one(i, start) for i, start in enumerate(starts)))

    async def held_out(self, players: Mapping[Seat, Player]) -> list[dict[Seat, Trajectory]]:
        """``trainer.eval_samples`` episodes of each env's first ``trainer.eval_tasks`` held-out starts."""
        t = self.cfg.trainer
        jobs = [self.play(s, [s.eval[i] for i in range(min(t.eval_tasks, len(s.eval)))], samples=t.eval_samples,
                          players=players) for s in self.envs.streams if len(s.eval)]
        return [episode for episodes in await asyncio.gather(*jobs) for episode in episodes]

    def serve(self, policy: Policy, version: int) -> None:
        """Have ``policy``'s engine serve its weights as ``version``: as an adapter, or merged, from memory or disk
        (``weight_sync``)."""
        policy.save_weights_for_sampler(version, self.runner, self.cfg.weight_sync.mode)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Held-out results per seat of the run's own pairing, and, once trained, of each policy in each of its seats
        with every other trained seat played by the starting model (``vs_initial/POLICY@SEAT/...``): what a policy
        learned apart from what its partners or opponents learned with it."""
        t = self.cfg.trainer
        config = self.cfg.generator.generator_config(temperature=t.eval_temperature, seed=None, branch_at=0)
        episodes = self.runner.run(self.held_out(self.players(config=config)))
        if not episodes:
            return {}
        results = _outcomes(episodes, "")
        if state.step:
            trained = frozenset(seat for p in self.policies for seat in p.seats)
            for p in self.policies:
                for seat in p.seats:
                    crossed = self.runner.run(self.held_out(self.players(config=config, initial=trained - {seat})))
                    mine = seat_results([e[seat] for e in crossed if seat in e])
                    results.update({f"vs_initial/{p.name}@{seat}/{key}": mine[key] for key in ("accuracy", "reward")})
        self.logger.log_eval(state.step, "accuracy", results, [traj for e in episodes for traj in e.values()])
        return results

    def resume(self) -> TrainState:
        """A fresh state, or every policy's checkpoint of one step (``trainer.resume``: latest or a step dir name);
        the run's logger begun from it."""
        state = self._restored()
        self.main.begin(state, total_steps=self.cfg.trainer.steps, stage="rl")
        return state

    def _restored(self) -> TrainState:
        resume = self.cfg.trainer.resume
        if not resume:
            if self.server is not None:  # a server has no adapter until one is loaded: the untrained one, the base's
                for p in self.policies:
                    self.serve(p, 0)
            return TrainState()
        states = []
        for p in self.policies:
            where = "latest" if resume == "latest" else str(p.checkpoints.root / Path(resume).name)
            states.append(p.load_state(where))
        if len({s.step for s in states}) > 1:
            raise RuntimeError(f"the policies' latest checkpoints are of different steps "
                               f"{[s.step for s in states]}: resume from one step all of them have")
        state = states[-1]
        for p in self.policies:
            self.serve(p, state.policy_version)
        return state

    def close(self) -> None:
        """Stop every engine, then the run; safe after a failed start."""
        engines = [p.engine for p in self.policies] + list(self.frozen.values())
        for engine in engines:
            self.runner.run(engine.stop())
        self.main.close()


class Episodes:
    """Where a step's episodes come from in ``trainer.mode=sync``: each step plays its own starts with the
    policies it trains (picked once, as trainer/rollout_source.py picks a single policy's source)."""

    def __init__(self, run: PolicyRun) -> None:
        self.run = run

    def start(self, state: TrainState) -> None:
        """Start generating from ``state`` (after the evaluation of the starting policies)."""

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        """Every seat's trajectories of the step's episodes, and how many drawn groups were dropped as too stale."""
        run = self.run
        return run.runner.run(run.play_draws(run.envs.draw(run.cfg.generator.prompts_per_step))), 0

    def served(self, version: int) -> None:
        """Every policy's engine serves ``version`` now."""

    def metrics(self) -> dict[str, float]:
        """The envs' samplers' metrics (trainer/curriculum.py) and the placement's health, for the step's row."""
        return {**self.run.envs.metrics(), **self.run.main.placement.metrics()}

    def snapshot(self, state: TrainState) -> None:
        """Put the data positions (and drawn-but-untrained groups) into ``state``, for a checkpoint."""
        state.data, state.pending = self.run.envs.state(), []

    def close(self) -> None:
        """Stop generating; safe to call again."""


class EpisodesAhead(Episodes):
    """``trainer.mode=async``: the next steps' episodes play while a step trains, each start's trajectories (every
    seat's) one group under the staleness bound."""

    def __init__(self, run: PolicyRun) -> None:
        super().__init__(run)
        g = run.cfg.generator
        self.ahead = AsyncRollouts(run.envs, None, prompts_per_step=g.prompts_per_step,
                                   max_staleness=run.cfg.trainer.max_staleness, generate=run.play_groups)
        self.started = False

    def start(self, state: TrainState) -> None:
        self.run.runner.run(self.ahead.start(step=state.step, version=state.policy_version, pending=state.pending))
        self.started = True

    def next(self, state: TrainState) -> tuple[list[Trajectory], int]:
        return self.run.runner.run(self.ahead.batch(state.step))

    def served(self, version: int) -> None:
        self.run.runner.run(self.ahead.set_version(version))

    def metrics(self) -> dict[str, float]:
        # the samplers draw and observe on the loop
        return {**self.run.runner.run(on_loop(self.run.envs.metrics)), **self.run.main.placement.metrics()}

    def snapshot(self, state: TrainState) -> None:
        state.data, state.pending = self.run.runner.run(snapshot_state(self.run.envs, self.ahead))

    def close(self) -> None:
        if self.started:
            self.run.runner.run(self.ahead.close())
            self.started = False


def train_seat_sft(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """The sft stage of a run with seats: ``sft.policy``'s model trained on its seats' demonstrations (trainer/
    sft.py; its results name the policy its weights start). The held-out loss is the stage's; held-out play, which
    needs every seat's player, is the rl stage's."""
    return train_sft(replace(cfg, trainer=replace(cfg.trainer, eval_tasks=0)), evaluate_before=evaluate_before)


def train_policies(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """Train the policies ``cfg.seats`` names for ``trainer.steps`` steps; returns held-out results before (unless
    ``evaluate_before`` is false: a later stage's) and after (per seat, and of each policy with its frozen initial
    partners) and each policy's final weights."""
    run = PolicyRun(cfg)
    episodes = EpisodesAhead(run) if cfg.trainer.mode == "async" else Episodes(run)
    try:
        run.start()
        state = run.resume()
        results: dict[str, Any] = {}
        if state.step == 0 and cfg.trainer.eval_tasks and evaluate_before:
            results.update({f"{k}_before": v for k, v in run.evaluate(state).items()})
        episodes.start(state)
        while state.step < cfg.trainer.steps:
            metrics, everything = _train_step(run, episodes, state)
            run.logger.log_step(state.step, metrics, everything)
            if state.step % cfg.trainer.save_every == 0 or state.step == cfg.trainer.steps:
                episodes.snapshot(state)
                for p in run.policies:
                    p.save_state(state)
            every = cfg.trainer.eval_every
            if every and state.step % every == 0 and state.step < cfg.trainer.steps:
                run.evaluate(state)
        episodes.close()  # what it drew for steps past the last is not evaluated or trained
        if cfg.trainer.eval_tasks:
            results.update({f"{k}_after": v for k, v in run.evaluate(state).items()})
        results.update(_final_weights(run, state))
        return {**results, **run.logger.finish(results)}
    finally:
        episodes.close()
        run.close()


def _train_step(run: PolicyRun, episodes: Episodes, state: TrainState) -> tuple[dict[str, float], list[Trajectory]]:
    """One step: the episodes, each policy's update on its seats' trajectories, every engine serving the new
    weights; the step's metrics (``policy/NAME/...`` per policy) and every seat's trajectories."""
    cfg = run.cfg
    t0 = time.perf_counter()
    everything, stale = episodes.next(state)
    t1 = time.perf_counter()
    metrics: dict[str, float] = {"time/generate_s": t1 - t0, "rollout/stale_dropped": float(stale)}
    for p in run.policies:
        trajs = [t for t in everything if t.seat in p.seats]
        batch = prepare_batch(trajs, cfg)
        trained = update_policy(p.backend, batch, cfg, run.tokenizer.pad_id)
        for key, value in {**rollout_metrics(trajs, batch, state.policy_version), **trained}.items():
            metrics[f"policy/{p.name}/{key}"] = value
    t2 = time.perf_counter()
    state.step = state.policy_version = state.step + 1
    for p in run.policies:
        run.serve(p, state.policy_version)
    episodes.served(state.policy_version)
    ok = [t for t in everything if not t.failed]
    metrics.update({
        "reward/mean": sum(t.reward for t in ok) / max(len(ok), 1),
        "rollout/failed": float(sum(t.failed for t in everything)),
        "time/train_s": t2 - t1, "time/sync_s": time.perf_counter() - t2, **episodes.metrics(),
        "time/step_s": time.perf_counter() - t0})
    return metrics, everything


def _final_weights(run: PolicyRun, state: TrainState) -> dict[str, str]:
    """Each policy's final weights (``weights/NAME``): written now if no step wrote them, or where it started."""
    return {f"weights/{p.name}": p.save_weights(state.policy_version) for p in run.policies}


def _outcomes(episodes: list[dict[Seat, Trajectory]], prefix: str) -> dict[str, float]:
    """Per seat: the share of its rollouts that passed (reward >= 1) and its mean reward; ``accuracy``, the share of
    episodes every trained seat passed, and ``reward``, the mean over seats and episodes."""
    out: dict[str, float] = {}
    seats = sorted({seat for episode in episodes for seat in episode})
    for seat in seats:
        results = seat_results([e[seat] for e in episodes if seat in e])
        out.update({f"{prefix}{seat}/{key}": results[key] for key in ("accuracy", "reward")})
    n = max(len(episodes), 1)
    out[f"{prefix}accuracy"] = sum(bool(e) and all(passed(t) for t in e.values()) for e in episodes) / n
    out[f"{prefix}reward"] = sum(out[f"{prefix}{seat}/reward"] for seat in seats) / max(len(seats), 1)
    return out


def _served(stream: EnvStream) -> bool:
    """Whether ``stream``'s env is served (``http://``, ``ws://``: a session per seat on its server)."""
    return urlsplit(stream.cfg.name).scheme in ("http", "https", "ws", "wss")


def _seating(stream: EnvStream) -> Seating:
    """How ``stream``'s episodes seat their players: sessions on its server, or an env made here."""
    return remote_seats(stream.cfg.name, **stream.cfg.kwargs) if _served(stream) else local_seats(stream.make)


async def _gather(*jobs: Any) -> None:
    await asyncio.gather(*jobs)
