"""Training while serving (``stages=[online]``; docs/training/online.md), top to bottom:

    serving engine  the promoted policy, answering clients through a PolicyServer (generators/serving) whose store
                    keeps their consenting calls and feedback; it never stops answering while the trainer works
    run engine      the candidate: each round's weights go to it, and the gate samples it
    before round 1: the serving policy's held-out scores (the gate's baseline), and a checkpoint to go back to
    each round (online.rounds of them, default trainer.steps):
        wait     until online.round_episodes conversations have their reward (the client's late feedback; past
                 online.deadline_s, the rubric's), or online.round_s with at least online.min_episodes
        trajs    = those conversations, less any sampled more than trainer.max_staleness updates before the
                   trainer's weights (dropped, counted)
        update   = the RL step on them (trainer/loop.py) as one group: each reward against the round's mean; TIS
                   corrects with the logprobs captured when each call was served
        gate     = candidate vs serving, paired: on the env's held-out tasks (its reward), and on the latest served
                   calls answered again (the rubric): promoted if the one-sided paired-bootstrap lower bound of the
                   difference is at least -online.gate_margin on both
        promoted → the serving engine loads it (vLLM pauses and resumes its requests: none is dropped); checkpoint
        refused  → the next round trains on from the candidate, while what serves is within trainer.max_staleness
                   updates of it (small gains add up to one the gate can see); past that, the trainer goes back to
                   the serving weights (that checkpoint), so it never drifts far from what serves
        every decision, with its numbers → OUT/gate.jsonl; the round's conversations are taken (never trained again)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from envkit.imports import import_ref
from envkit.rewards.rubrics import Episode as RubricEpisode
from envkit.rewards.rubrics import Rubric, load_rubric
from generators import Generator, Trajectory
from generators.engines.factory import make_engine
from generators.gateway import ChatRequest, Episode, Gateway, Limits
from generators.gateway.chat import openai_message
from generators.serving import ADMIN_KEY_ENV
from generators.serving.episodes import RewardRule, due
from generators.serving.server import Client, PolicyServer, ServingConfig
from generators.serving.store import CallStore
from trainer.async_rollouts import LoopThread
from trainer.backends import make_backend
from trainer.backends.base import TrainBackend
from trainer.checkpoint import TrainState
from trainer.config import Config, ConfigError
from trainer.loop import prepare_batch, update_policy
from trainer.placement import make_placement
from trainer.policy import Policy
from trainer.priority import separate
from trainer.runs import MainRun, open_run

log = logging.getLogger(__name__)


def train_online(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """Serve, train on the traffic and promote what the gate passes, for ``online.rounds`` rounds; returns every
    round's decision and where the promoted weights are."""
    rounds = cfg.online.rounds or cfg.trainer.steps
    run = open_run(cfg, placement=make_placement, runner=LoopThread)
    assert isinstance(run, MainRun) and isinstance(run.runner, LoopThread)  # one rank (the config's check)
    serving = Serving(cfg, run)
    try:
        policy = run.policy(make_backend(cfg, run.model_path))
        run.start()
        state = run.resume([policy], total_steps=rounds, stage="online")
        serving.start(state)
        _leave_cores(cfg.online.serving_cpu_cores)
        serving.take_priority()
        gate = Gate(cfg, run, serving)
        baseline = gate.held_out()  # the run engine holds the serving weights now
        if not run.checkpoints.all():
            run.save([policy], state)  # the weights a refused candidate goes back to
        decisions: list[dict[str, Any]] = []
        while state.step < rounds:
            if serving.server.rollback_to is not None:
                del policy  # its memory, before the one from the earlier weights is built
                policy = run.policy(serving.roll_back(state))
                run.serve(policy, state.policy_version)
                baseline = gate.held_out()
                run.save([policy], state)
                continue
            t0 = time.perf_counter()
            trajs, dropped, stale = serving.next_round(state)
            if serving.server.rollback_to is not None:  # asked for meanwhile: first that, then the round
                continue
            t1 = time.perf_counter()
            batch = prepare_batch(trajs, cfg)
            metrics = update_policy(policy.backend, batch, cfg, run.tokenizer.pad_id)
            state.step = state.policy_version = state.step + 1
            if "train/skipped_update" not in metrics:
                state.lineage.append(state.policy_version)
            t2 = time.perf_counter()
            decision: dict[str, Any] = {"round": state.step, "serving": state.promoted[-1], "trained": len(trajs),
                                        "stale_dropped": stale, "reward": _mean([t.reward for t in trajs])}
            if "train/skipped_update" in metrics:  # every reward alike: nothing to learn, no candidate
                decision.update(candidate=None, promoted=False, reason="no update: the round's rewards were equal")
            else:
                run.serve(policy, state.policy_version)
                candidate = gate.held_out()
                decision.update(candidate=state.policy_version, **gate.decide(candidate, baseline))
                if decision["promoted"]:
                    swap = time.time()
                    serving.promote(policy, state.policy_version)
                    decision["swap"] = [swap, time.time()]
                    state.promoted.append(state.policy_version)
                    baseline = candidate
                    run.save([policy], state)
                elif len(state.lineage) - 1 - state.lineage.index(state.promoted[-1]) > cfg.trainer.max_staleness:
                    # what serves would sample the next round too many updates behind: start again from it
                    done, version = state.step, state.policy_version
                    state = replace(policy.load_state(str(run.checkpoints.all()[-1])), step=done,
                                    policy_version=version, lineage=[state.promoted[-1]])
                    decision["reverted"] = state.promoted[-1]
            serving.take(trajs, dropped, state.step)
            decision["gate_s"] = round(time.perf_counter() - t2, 1)
            serving.log(decision)
            decisions.append(decision)
            run.logger.log_step(state.step, {
                **metrics, "online/reward": decision["reward"], "online/trained": float(len(trajs)),
                "online/promoted": float(decision["promoted"]), "online/serving_version": float(state.promoted[-1]),
                "time/wait_s": t1 - t0, "time/train_s": t2 - t1, "time/gate_s": decision["gate_s"],
                "time/step_s": time.perf_counter() - t0}, trajs)
        results = {"rounds": state.step, "promoted": state.promoted[1:], "serving_version": state.promoted[-1],
                   "decisions": decisions, "weights": str(serving.weights(state.promoted[-1]))}
        return {**results, **run.logger.finish(results)}
    finally:
        serving.close()
        run.close()


def _leave_cores(cores: str) -> None:
    """Train on as many threads as there are cores besides the serving engine's (where it has its own): on a CPU,
    an update on every core starves the answers to clients."""
    if "-" not in cores and "," not in cores and not cores.isdigit():
        return
    import torch

    if torch.cuda.is_available():
        return
    serving = {c for span in cores.split(",") for c in range(int(span.split("-")[0]), int(span.split("-")[-1]) + 1)}
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0) - serving)))


class Serving:
    """The serving half: the promoted policy's engine, its PolicyServer on the run's event loop, the store."""

    def __init__(self, cfg: Config, run: MainRun) -> None:
        o = cfg.online
        self.cfg, self.run = cfg, run
        self.out = Path(cfg.trainer.output_dir)
        self.store = CallStore(o.store or self.out / "store")
        self.rule = RewardRule(settle_s=o.settle_s, deadline_s=o.deadline_s)
        self.rubric: Rubric | None = load_rubric(o.rubric) if o.rubric else None
        assert o.clients is not None  # the config's check
        try:
            clients = [Client(str(r["name"]), str(r["key"]), bool(r.get("capture", True)))
                       for r in json.loads(Path(o.clients).read_text())]
            config = ServingConfig(clients, sample_rate=o.sample_rate, max_concurrent=o.max_concurrent,
                                   redact=import_ref(o.redact) if o.redact else None, rubric=self.rubric,
                                   admin_key=os.environ.get(ADMIN_KEY_ENV) or None, versions=self.versions)
        except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as e:
            raise ConfigError(f"online: {type(e).__name__}: {e}") from None
        self.engine = make_engine(replace(cfg.inference, cpu_cores=o.serving_cpu_cores), run.model_path,
                                  log_dir=self.out / "serving")
        self.server = PolicyServer(self.engine, run.tokenizer, config, self.store, cfg.generator)
        self.url: str | None = None
        self._serving: Any = None

    @property
    def version(self) -> int:
        """The weight version serving now."""
        return self.engine.weight_version

    def start(self, state: TrainState) -> None:
        """Start the serving engine with the last promoted weights, and take calls."""
        runner = self.run.runner
        assert isinstance(runner, LoopThread)
        runner.run(self.engine.start())
        if state.promoted[-1]:
            runner.run(self.engine.load_weights(self.weights(state.promoted[-1]), state.promoted[-1]))
        def announce(url: str) -> None:
            self.url = url
            log.warning("serving weight version %d at %s/v1 (%s); storing to %s", state.promoted[-1], url,
                        self.weights(state.promoted[-1]), self.store.path)

        self._serving = runner.spawn(self.server.serve(self.cfg.online.host, self.cfg.online.port,
                                                       on_ready=announce, handle_signals=False))
        for _ in range(3000):
            if self.url is not None or self._serving.done():
                break
            time.sleep(0.01)
        if self.url is None:
            self._serving.result()  # raises why it did not start
            raise RuntimeError("the policy server did not start")

    def take_priority(self) -> None:
        """Answering clients comes first: the trainer's threads and the candidate's engine compute 10 nice steps
        below the serving engine and the threads that answer and store calls (:func:`separate`), so an update or a
        gate on the same cores does not stall a client's answer."""
        runner = self.run.runner
        assert isinstance(runner, LoopThread)
        serving = {runner.native_id, self.store.writer_id}
        training = [(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task") if int(t) not in serving]
        answering = [(os.PRIO_PROCESS, t) for t in serving]
        for engine, side in ((self.run.engine, training), (self.engine, answering)):
            server = getattr(getattr(engine, "server", None), "process", None)
            if server is not None:  # a managed server leads a process group of its own
                side.append((os.PRIO_PGRP, server.pid))
        separate(answering, training)

    def next_round(self, state: TrainState) -> tuple[list[Trajectory], list[str], int]:
        """The round's conversations (blocks until enough have their reward), the keys of those dropped (unscored,
        or sampled more than ``trainer.max_staleness`` updates before the trainer's weights), and how many of them
        were stale."""
        o = self.cfg.online
        behind = {version: len(state.lineage) - 1 - i for i, version in enumerate(state.lineage)}
        until = time.monotonic() + o.round_s
        while self.server.rollback_to is None:
            ready, dropped = due(self.store, self.rule)
            fresh = [t for t in ready if behind.get(t.policy_version, 10**9) <= self.cfg.trainer.max_staleness]
            if len(fresh) >= o.round_episodes or (time.monotonic() >= until and len(fresh) >= o.min_episodes):
                break
            time.sleep(0.5)
        else:
            return [], [], 0
        kept = {id(t) for t in fresh}
        stale = [t.task_id for t in ready if id(t) not in kept and t.task_id]
        fresh = fresh[-o.round_episodes:]  # the newest: traffic faster than the rounds leaves the rest for later
        return [replace(t, group_id=f"round-{state.step + 1}") for t in fresh], dropped + stale, len(stale)

    def take(self, trajs: list[Trajectory], dropped: list[str], round_: int) -> None:
        """Mark the round's conversations taken: trained (with their reward) or dropped."""
        taken: dict[str, float | None] = {key: None for key in dropped}
        taken.update({t.task_id: t.reward for t in trajs if t.task_id})
        self.run.runner.run(self.store.take(taken, round_))  # type: ignore[union-attr]

    def versions(self) -> list[int]:
        """The weight versions there are to serve: 0 (the starting model) and each one promoted."""
        promoted = self.out / "promoted"
        found = [int(p.name[1:]) for p in promoted.iterdir() if p.name[1:].isdigit()] if promoted.is_dir() else []
        return [0, *sorted(found)]

    def roll_back(self, state: TrainState) -> TrainBackend:
        """Serve the version an admin asked for again, and a trainer from its weights (a fresh optimizer): the
        rounds after it train from what serves."""
        version = self.server.rollback_to
        assert version is not None
        path = self.weights(version)
        self.run.runner.run(self.engine.load_weights(path, version))  # type: ignore[union-attr]
        state.promoted.append(version)
        state.lineage = [version]
        self.server.rollback_to = None
        self.log({"round": state.step, "candidate": None, "promoted": False, "rollback": version,
                  "reason": f"an admin rolled back to version {version}"})
        return make_backend(self.cfg, str(path))

    def weights(self, version: int) -> Path:
        """Where promoted ``version``'s weights are (0: the starting model)."""
        return self.out / "promoted" / f"v{version}" if version else Path(self.run.model_path)

    def promote(self, policy: Policy, version: int) -> None:
        """Write the candidate's weights and have the serving engine load them: calls in flight are paused and
        resumed, none is dropped."""
        path = self.weights(version)
        policy.backend.export_weights(path)
        self.run.runner.run(self.engine.load_weights(path, version))  # type: ignore[union-attr]

    def log(self, decision: dict[str, Any]) -> None:
        """Append one gate decision to ``OUT/gate.jsonl``."""
        with open(self.out / "gate.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), **decision}) + "\n")
        if "rollback" in decision:
            log.warning("after round %d: rolled back to version %d", decision["round"], decision["rollback"])
            return
        verdict = "promoted" if decision["promoted"] else "refused"
        log.warning("round %d: candidate %s %s (%s)", decision["round"], decision["candidate"], verdict,
                    decision.get("reason", ""))

    def close(self) -> None:
        """Drain the server (calls in flight answered and stored), stop the engine, close the store."""
        runner = self.run.runner
        if self._serving is not None and isinstance(runner, LoopThread):
            runner.run(_stop(self.server))
            self._serving.result(timeout=120)
        if isinstance(runner, LoopThread):
            runner.run(self.engine.stop())
        self.store.close()


async def _stop(server: PolicyServer) -> None:
    server.stop()


@dataclass(frozen=True)
class Paired:
    """One paired comparison of the gate."""

    n: int
    candidate: float
    serving: float
    lower: float
    """The one-sided lower confidence bound of mean(candidate - serving)."""


class Gate:
    """Scores a candidate beside the serving policy and decides (see the module docstring)."""

    def __init__(self, cfg: Config, run: MainRun, serving: Serving) -> None:
        self.cfg, self.run, self.serving = cfg, run, serving
        assert run.engine is not None
        g = cfg.generator
        self.generator = Generator(run.engine, run.tokenizer, g.generator_config(
            samples_per_prompt=cfg.online.gate_samples, seed=None, branch_at=0))
        self.replayer = Gateway(run.engine, run.tokenizer, self.generator.parser, self.generator.tool_prompt,
                                Limits(g.sampling, 1, g.max_total_tokens, check_template=False))

    def held_out(self) -> dict[str, float]:
        """The run engine's policy's mean reward on each held-out task of the env."""
        trajs = self.run.runner.run(self.run.envs.eval_rollouts(  # type: ignore[union-attr]
            self.generator, self.cfg.online.gate_tasks))
        by_task: dict[str, list[float]] = defaultdict(list)
        for t in trajs:
            by_task[f"{t.env_name}/{t.task_id if t.task_id is not None else t.seed}"].append(
                0.0 if t.failed else t.reward)
        return {task: sum(r) / len(r) for task, r in by_task.items()}

    def decide(self, candidate: dict[str, float], serving: dict[str, float]) -> dict[str, Any]:
        """Whether ``candidate`` (held-out scores) may replace the serving policy, with the numbers."""
        o = self.cfg.online
        tasks = sorted(candidate.keys() & serving.keys())
        tests = {"held_out": paired([candidate[t] for t in tasks], [serving[t] for t in tasks], o.gate_confidence)}
        replay = self.replay()
        if replay is not None:
            tests["replay"] = replay
        return verdict(tests, o.gate_margin, o.gate_confidence)

    def replay(self) -> Paired | None:
        """The latest calls the serving version answered, answered again by the candidate; both replies scored by
        the rubric (None without a rubric or calls)."""
        if self.serving.rubric is None or not self.cfg.online.gate_replay:
            return None
        calls = self.serving.store.recent(self.cfg.online.gate_replay, model_version=self.serving.version)
        if not calls:
            return None
        rubric = self.serving.rubric

        async def scores() -> tuple[list[float], list[float]]:
            async def one(call: Any) -> tuple[float, float]:
                request = ChatRequest.model_validate({"messages": call.messages, **(
                    {"tools": call.tools} if call.tools else {})})
                choices, _ = await self.replayer.chat(Episode(call.response_id), request)
                again = openai_message(choices[0].message)
                new, old = await asyncio.gather(*(rubric.score(RubricEpisode(task=None, messages=[*call.messages, m]))
                                                  for m in (again, call.reply)))
                return new.value, old.value

            pairs = await asyncio.gather(*(one(c) for c in calls))
            return [p[0] for p in pairs], [p[1] for p in pairs]

        new, old = self.run.runner.run(scores())  # type: ignore[union-attr]
        return paired(new, old, self.cfg.online.gate_confidence)


def verdict(tests: dict[str, Paired], margin: float, confidence: float) -> dict[str, Any]:
    """Promote only if every test's lower bound is at least ``-margin`` (a test with no pairs fails); the decision
    with its numbers."""
    failed = [name for name, test in tests.items() if test.n == 0 or test.lower < -margin]
    reason = (f"not worse: lower bound >= -{margin:g} on {' and '.join(tests)}" if not failed else
              f"worse on {' and '.join(failed)}: lower bound < -{margin:g}")
    return {"promoted": not failed, "reason": reason,
            "test": f"paired bootstrap, one-sided {confidence:.0%} lower bound of the mean difference",
            **{name: asdict(test) for name, test in tests.items()}}


def paired(candidate: list[float], serving: list[float], confidence: float, *, resamples: int = 2000,
           seed: int = 0) -> Paired:
    """The paired bootstrap of mean(candidate - serving): its one-sided ``confidence`` lower bound."""
    diffs = [c - s for c, s in zip(candidate, serving, strict=True)]
    if not diffs:
        return Paired(0, 0.0, 0.0, float("-inf"))
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(resamples))
    return Paired(len(diffs), _mean(candidate), _mean(serving), means[int((1 - confidence) * resamples)])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
