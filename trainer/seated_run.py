"""A run of a multi-agent env's seats (``seats``): each seat bound to a player, and the policies among them trained
together by the RL loop (trainer/loop.py), each a model of its own. The loop, its sources (sync and async), its
checkpoints and its report are the same as for one policy; what a run of seats does its own way is here:

    policies   one per name the seats bind, each with its engine (a vLLM server of its own, or with LoRA,
               ``model.lora.serve=adapters``, its adapter on the run's one server of the base model) and its
               checkpoints (``OUT/policies/NAME/checkpoints``); a policy trains on its seats' trajectories
    rollouts   every seat's player at once (generators/seats.py): the episodes of each drawn start, every seat's
               trajectories of a start one group under the staleness bound (async mode), with per-seat baselines
    evaluate   held-out play of the trained seats together, and of each policy in each of its seats with every other
               trained seat played by the starting model, so co-adaptation shows apart from what one policy learned

The run's metrics carry one ``policy/NAME/...`` set per policy beside the step's outcomes over every seat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from envkit.imports import import_ref
from envkit.multi_agent import MultiAgentEnv, Seat
from generators import ChatTokenizer, Generator, GeneratorConfig, Trajectory
from generators.engines.base import InferenceEngine
from generators.engines.factory import make_engine
from generators.engines.vllm import VLLMEngine, lora_rank_limit
from generators.models import resolve_model
from generators.report import passed, seat_results
from generators.seats import AgentPlayer, Player, Seating, local_seats, play_starts, remote_seats
from trainer.async_rollouts import LoopThread
from trainer.backends.base import TrainBackend
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import Config, ConfigError, InferenceConfig
from trainer.placement.base import Placement
from trainer.policy import AdapterPolicy, Policy
from trainer.runs import MainRun, Run
from trainer.sources import EnvStream, Start, flat_groups, refilled


def main_run(cfg: Config) -> type[MainRun]:
    """The kind of rank 0's run an RL stage opens: with seats, a :class:`SeatedRun`."""
    return SeatedRun if cfg.seats else MainRun


def seated_policies(cfg: Config, out: Path, model_path: str, make: Callable[[str], TrainBackend],
                    engine: Callable[[str, str, Path], InferenceEngine | None], *, adapters: bool) -> list[Policy]:
    """One policy per name the seats bind, each with its own checkpoints under ``OUT/policies/NAME``, its starting
    weights (``model.policy_paths``, else ``model.path``) and ``engine(name, start, out)`` (none on the ranks above
    0); an :class:`AdapterPolicy` where the policies are ``adapters`` of one server."""
    kind = AdapterPolicy if adapters else Policy
    policies = []
    for name in cfg.policies:
        where = out / "policies" / name
        start = resolve_model(cfg.model.policy_paths[name]) if name in cfg.model.policy_paths else model_path
        policies.append(kind(make(start), CheckpointManager(where / "checkpoints", keep_last=cfg.trainer.keep_last),
                             where, engine=engine(name, start, where), name=name,
                             seats=[seat for seat, s in cfg.seats.items() if s.policy == name]))
    return policies


def restored_at_one_step(policies: Sequence[Policy], resume: str | None) -> TrainState:
    """A fresh state, or every policy's checkpoint of one step (``resume``: latest, or a step dir whose name each
    policy's checkpoints have)."""
    if not resume:
        return TrainState()
    states = [p.load_state("latest" if resume == "latest" else str(p.checkpoints.root / Path(resume).name))
              for p in policies]
    if len({s.step for s in states}) > 1:
        raise RuntimeError(f"the policies' latest checkpoints are of different steps {[s.step for s in states]}: "
                           "resume from one step all of them have")
    return states[-1]


class Seated(Run):
    """What every rank of a run with seats does alike: restore its policies at one step, and have a server of
    adapters serve each untrained one (it has none until one is loaded: the base's)."""

    def restored(self, policies: Sequence[Policy]) -> TrainState:
        return restored_at_one_step(policies, self.cfg.trainer.resume)

    def resume(self, policies: Sequence[Policy], *, total_steps: int, stage: str) -> TrainState:
        state = super().resume(policies, total_steps=total_steps, stage=stage)
        if self.cfg.lora_adapters and not state.policy_version:
            for p in policies:  # collective, as every serve is
                self.serve(p, 0)
        return state


class SeatedRank(Seated):
    """A rank above 0 of a run with seats: every policy's backend and checkpoints, no engine; it takes its part in
    each policy's collectives, in the order rank 0 takes them."""

    def policies(self, make: Callable[[str], TrainBackend]) -> list[Policy]:
        return seated_policies(self.cfg, self.out, self.model_path, make, lambda *_: None,
                               adapters=self.cfg.lora_adapters)


class SeatedRun(Seated, MainRun):
    """Rank 0's run of a multi-agent env's seats: its policies, its frozen, scripted and endpoint players, and a
    seating per env (seeding, the model and tokenizer, the placement, the envs, the judge, the logger and the event
    loop are :class:`MainRun`'s; its policies' engines are its own, so it starts none of MainRun's)."""

    elsewhere = SeatedRank

    def __init__(self, cfg: Config, model_path: str, tokenizer: ChatTokenizer, *, placement: Placement,
                 engine: bool = True, runner: asyncio.Runner | LoopThread | None = None) -> None:
        super().__init__(cfg, model_path, tokenizer, placement=placement, engine=False, runner=runner)
        self.server: VLLMEngine | None = None
        """With ``model.lora.serve`` adapters: the one vLLM server, of the base model and each policy's adapter."""
        if cfg.lora_adapters:
            server = placement.engine(model_path, self.out / "server", max_loras=len(cfg.policies),
                                      max_lora_rank=lora_rank_limit(cfg.model.lora.r))
            assert isinstance(server, VLLMEngine)
            self.server = server
        self.trained: list[Policy] = []
        """The policies it trains (:meth:`policies` makes them)."""
        self.generators: dict[str, Generator] = {}
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
        self.timeout_s = cfg.generator.timeout_s
        """How long a training episode may run (the rollout deadline: :meth:`limit_rollouts`)."""

    def policies(self, make: Callable[[str], TrainBackend]) -> list[Policy]:
        """One policy per name the seats bind, each with its own checkpoints under ``OUT/policies/NAME`` and its
        starting weights (``model.policy_paths``, else ``model.path``): an adapter of the one server, or a model
        with an engine of its own."""
        server = self.server

        def engine(name: str, start: str, out: Path) -> InferenceEngine:
            return server.adapter(name) if server else self.placement.engine(start, out)

        self.trained = seated_policies(self.cfg, self.out, self.model_path, make, engine, adapters=bool(server))
        self.generators = {p.name: Generator(p.engine, self.tokenizer, self.cfg.generator) for p in self.trained}
        return self.trained

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
        policy_of = {seat: self.generators[p.name] for p in self.trained for seat in p.seats}
        out: dict[Seat, Player] = {}
        for seat in self.cfg.seats:
            player = Generator(self.frozen["initial"], self.tokenizer, self.cfg.generator) if seat in initial \
                else policy_of.get(seat) or self.fixed[seat]
            if config is not None and isinstance(player, Generator):
                player = Generator(player.engine, player.tokenizer, config)
            out[seat] = AgentPlayer(self.agents[seat], player) if seat in self.agents else player
        return out

    def start(self, prepare: Callable[[MainRun], Awaitable[Any]] | None = None) -> Any:
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
        made = super().start(prepare)
        self.evaluating = self.cfg.trainer.eval_tasks > 0 and any(s.eval for s in self.envs.streams)
        return made

    async def _start_engine(self, prepare: Callable[[MainRun], Awaitable[Any]] | None) -> Any:
        made, *_ = await asyncio.gather(super()._start_engine(prepare), *(e.start() for e in self._engines()))
        return made

    def _engines(self) -> list[InferenceEngine]:
        """Every engine the run started: its policies' and its frozen players'."""
        return [p.engine for p in self.trained if p.engine is not None] + list(self.frozen.values())

    def limit_rollouts(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def play(self, stream: EnvStream, starts: list[Start], *, samples: int,
                   timeout_s: float, players: Mapping[Seat, Player] | None = None) -> list[dict[Seat, Trajectory]]:
        """``samples`` episodes of each start in ``stream``'s env with ``players`` (the run's own by default), each
        within ``timeout_s``; group ids carry the env's label, so a mixture's envs never share a group."""
        g = self.cfg.generator
        episodes = await play_starts(self.seating[stream.label], players or self.players(), starts, samples=samples,
                                     concurrency=g.concurrency, env_name=stream.label,
                                     timeout_s=timeout_s)
        for episode in episodes:
            for t in episode.values():
                t.group_id = f"{stream.label}/{t.group_id}"
        return episodes

    async def rollouts(self, prompts: int) -> list[Trajectory]:
        """Sync mode's generation: the episodes of each of the next ``prompts`` starts in its env, every seat's
        trajectories of a start going to its env's sampler (a curriculum's pass rates count every seat's);
        ``curriculum.refill`` draws a start again for each one that teaches no policy anything (:meth:`flat`)."""
        samples = self.cfg.generator.samples_per_prompt

        async def one(stream: EnvStream, starts: list[Start]) -> list[Trajectory]:
            # each start's samples in a row
            episodes = await self.play(stream, starts, samples=samples, timeout_s=self.timeout_s)
            for i, start in enumerate(starts):
                stream.observe(start, [t for e in episodes[i * samples:(i + 1) * samples] for t in e.values()])
            return [t for episode in episodes for t in episode.values()]

        async def generate(n: int) -> list[Trajectory]:
            played = await asyncio.gather(*(one(stream, starts) for stream, starts in self.envs.draw(n)))
            return [t for trajs in played for t in trajs]

        trajs, drawn = await refilled(generate, prompts, self.cfg.curriculum.refill, flat=self.flat)
        self.envs.refilled += drawn
        return trajs

    def flat(self, trajs: list[Trajectory]) -> set[str]:
        """The starts that teach no policy anything: each group of theirs that a policy trains on (one per seat,
        ``START/SEAT``) is flat."""
        trained = {seat for p in self.trained for seat in p.seats}
        played = [t for t in trajs if t.seat in trained]
        flat = flat_groups(played)
        groups: dict[str, set[str]] = {}
        for t in played:
            head, _, seat_and_tag = t.group_id.rpartition("/")
            groups.setdefault(head + seat_and_tag.removeprefix(str(t.seat)), set()).add(t.group_id)
        return {start for start, ids in groups.items() if ids <= flat}

    async def generate_groups(self, stream: EnvStream, starts: list[Start],
                              on_group: Callable[[int, list[Trajectory]], None]) -> None:
        """Async mode's generation: each start's episodes, every seat's trajectories of them one group."""
        async def one(i: int, start: Start) -> None:
            episodes = await self.play(stream, [start], samples=self.cfg.generator.samples_per_prompt,
                                       timeout_s=self.timeout_s)
            on_group(i, [t for episode in episodes for t in episode.values()])

        await asyncio.gather(*(one(i, start) for i, start in enumerate(starts)))

    async def held_out(self, players: Mapping[Seat, Player]) -> list[dict[Seat, Trajectory]]:
        """``trainer.eval_samples`` episodes of each env's first ``trainer.eval_tasks`` held-out starts."""
        t = self.cfg.trainer
        jobs = [self.play(s, [s.eval[i] for i in range(min(t.eval_tasks, len(s.eval)))], samples=t.eval_samples,
                          players=players, timeout_s=self.cfg.generator.timeout_s)
                for s in self.envs.streams if len(s.eval)]
        return [episode for episodes in await asyncio.gather(*jobs) for episode in episodes]

    def evaluate(self, *, step: int) -> dict[str, float]:
        """Held-out results per seat of the run's own pairing, and, once trained, of each policy in each of its seats
        with every other trained seat played by the starting model (``vs_initial/POLICY@SEAT/...``): what a policy
        learned apart from what its partners or opponents learned with it."""
        t = self.cfg.trainer
        config = self.cfg.generator.generator_config(temperature=t.eval_temperature, seed=None, branch_at=0)
        episodes = self.runner.run(self.held_out(self.players(config=config)))
        if not episodes:
            return {}
        results = _outcomes(episodes, "")
        if step:
            trained = frozenset(seat for p in self.trained for seat in p.seats if seat is not None)
            for p in self.trained:
                for seat in p.seats:
                    assert seat is not None  # a seat of a multi-agent env
                    crossed = self.runner.run(self.held_out(self.players(config=config, initial=trained - {seat})))
                    mine = seat_results([e[seat] for e in crossed if seat in e])
                    results.update({f"vs_initial/{p.name}@{seat}/{key}": mine[key] for key in ("accuracy", "reward")})
        self.logger.log_eval(step, "accuracy", results, [traj for e in episodes for traj in e.values()])
        return results

    def close(self) -> None:
        """Stop every engine, then the run; safe after a failed start."""
        for engine in self._engines():
            self.runner.run(engine.stop())
        super().close()


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

