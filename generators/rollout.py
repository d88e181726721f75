"""The rollout scheduler: (env, model) → Trajectory, one failed rollout never failing the batch.

:class:`Generator` runs ``samples_per_prompt`` rollouts per task or seed, ``concurrency`` at a time, each within its
wall-clock ``timeout`` and its env's lifetime; an ``error`` raised by the env or the engine ends that rollout only
(recorded on the trajectory), except :class:`PartLost`, which ends the batch. How an episode is played is its
runner's (generators/episodes/): a chat episode the generator steps turn by turn, an agent env's episode through
the capture gateway, or a demonstration (:meth:`Generator.demonstrate`) with the env's own turns in the model's
place.

With ``branch_at=k`` a group's rollouts share their first k turns: the first plays them and snapshots its env
(``Env.snapshot``), and the others continue from there in envs restored from the snapshot, so that they differ only
in what they do after turn k (see :class:`_Branch`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import envkit
from envkit import Env, Snapshot, Task, tracing
from envkit.errors import RubricError
from envkit.rewards.rubrics import Episode, GroupRubric, load_group_rubric
from generators.config import GeneratorConfig
from generators.engines.base import InferenceEngine
from generators.engines.replicas import Session, rollout_session
from generators.episodes.agent import AgentEpisodes
from generators.episodes.base import AtTurn, EpisodeRunner, Rollout
from generators.episodes.chat import ChatEpisodes, ModelTurns
from generators.episodes.demonstration import DemoTurns
from generators.parsers import OutputParser
from generators.tool_prompt import ToolPrompt
from generators.trajectory import StopReason, Trajectory

if TYPE_CHECKING:
    from generators.chat import ChatTokenizer  # transformers: `envkit eval --help` must not pay for it

log = logging.getLogger(__name__)

EnvFactory = Callable[[], Env]


class PartLost(RuntimeError):
    """A part the run needs is gone for good (an env worker that no live node can host again): raised through
    :meth:`Generator.generate` rather than failing one rollout, since every later one would fail the same way."""


@dataclass
class _BranchPoint:
    """Where a group's rollouts part: the first rollout's env snapshot and its rollout state at that turn."""

    snapshot: Snapshot
    state: Rollout


class _Branch:
    """One group's branching (``branch_at``): its first rollout, the trunk, snapshots its env and copies its state
    at the start of each of its first ``at`` + 1 turns; the branch point is the one at turn ``at``, or, where the
    trunk's episode ended sooner, the last one it took. The other rollouts wait for it."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.point: asyncio.Future[_BranchPoint] = asyncio.get_running_loop().create_future()
        self._latest: _BranchPoint | None = None

    async def at_turn(self, env: Env, state: Rollout) -> None:
        """The trunk's hook before each model turn."""
        if self.point.done() or state.traj.num_turns > self.at:
            return
        self._latest = _BranchPoint(await env.snapshot(), copy.deepcopy(state))
        if state.traj.num_turns == self.at:
            self.point.set_result(self._latest)

    def trunk_ended(self, trunk: Trajectory) -> None:
        """Settle the branch point when the trunk ended sooner, and mask the shared turns out of the trunk too."""
        if not self.point.done():
            if self._latest is None:
                self.point.set_exception(RuntimeError(f"the group's first rollout failed before it could branch: "
                                                      f"{trunk.error}"))
                return
            self.point.set_result(self._latest)
        if not self.point.exception():
            shared = self.point.result().state.traj
            trunk.loss_mask[:len(shared.loss_mask)] = [0] * len(shared.loss_mask)
            trunk.branch_turn = shared.num_turns


def env_factory(name: str, **kwargs: Any) -> EnvFactory:
    """A factory making ``envkit.make(name, **kwargs)``: one fresh env per rollout."""
    return lambda: envkit.make(name, **kwargs)


@dataclass(frozen=True)
class _Play:
    """What a set of rollouts is: who plays their episodes, how many per start, and whether the policy samples them
    (stamped with the engine's weight version, scored by the group rubric) or the env demonstrates them."""

    runners: tuple[EpisodeRunner, ...]
    samples: int
    sampled: bool


class Generator:
    """Runs rollouts of ``engine`` in envs. ``tokenizer`` is required for token-in/token-out engines; with no engine
    the generator only plays demonstrations (:meth:`demonstrate`)."""

    def __init__(self, engine: InferenceEngine | None, tokenizer: ChatTokenizer | None,
                 config: GeneratorConfig | None = None, *, group_rubric: GroupRubric | None = None) -> None:
        if (engine is None or engine.supports_token_ids) and tokenizer is None:
            what = "demonstrations are token ids" if engine is None else f"{type(engine).__name__} generates from ids"
            raise ValueError(f"{what}: pass the model's ChatTokenizer")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or GeneratorConfig()
        self.group_rubric = group_rubric or (load_group_rubric(self.config.group_rubric)
                                             if self.config.group_rubric else None)
        """Scores each group's finished rollouts together (``group_rubric=``, else the config's): their reward
        becomes its score, its breakdown joins theirs; if it fails, so do they."""
        self.parser = OutputParser.for_template(
            tokenizer.template if tokenizer else None, tokenizer.generation_prompt if tokenizer else "",
            tool_parser=self.config.tool_parser, reasoning_parser=self.config.reasoning_parser)
        self.tool_prompt = ToolPrompt.resolve(self.config.tool_prompt, self.parser.tool_parser,
                                              tokenizer.tokenizer if tokenizer else None)
        self._agents = AgentEpisodes(engine, tokenizer, self.config, self.parser, self.tool_prompt)
        sampled = () if engine is None else (self._agents, ChatEpisodes(
            tokenizer, self.config, self.tool_prompt, ModelTurns(engine, tokenizer, self.config, self.parser)))
        demonstrated = () if tokenizer is None else (ChatEpisodes(
            tokenizer, self.config, self.tool_prompt, DemoTurns(tokenizer, self.parser)),)
        self._sampled = _Play(sampled, self.config.samples_per_prompt, sampled=True)
        self._demonstrated = _Play(demonstrated, 1, sampled=False)
        log.info("tool calls read as %s, reasoning %s, tools %s", self.parser.tool_parser,
                 "split off" if self.parser.think else "left in the content",
                 "written into the system message" if self.tool_prompt.inject
                 else "given to the chat template" if self.tool_prompt.to_template else "left out of the prompt")

    async def generate(
        self,
        make_env: EnvFactory,
        *,
        tasks: Sequence[Task] | None = None,
        seeds: Sequence[int] | None = None,
        env_name: str = "",
        on_done: Callable[[Trajectory], None] | None = None,
        on_group: Callable[[int, list[Trajectory]], None] | None = None,
    ) -> list[Trajectory]:
        """``samples_per_prompt`` rollouts for each task (or seed), ``concurrency`` at a time, in request order.

        Samples of one task/seed share a ``group_id`` and the same episode start. ``on_done`` is called as each
        rollout finishes (progress bars), ``on_group(i, rollouts)`` as the last sample of the i-th start finishes
        (an async trainer takes groups as they complete). Failed rollouts come back with ``stop_reason``
        error/timeout.
        """
        if self.engine is None:
            raise ValueError("this generator has no engine: it can only play demonstrations (demonstrate())")
        return await self._run(make_env, self._sampled, tasks=tasks, seeds=seeds, env_name=env_name,
                               on_done=on_done, on_group=on_group)

    async def demonstrate(self, make_env: EnvFactory, *, tasks: Sequence[Task] | None = None,
                          seeds: Sequence[int] | None = None, env_name: str = "",
                          on_done: Callable[[Trajectory], None] | None = None,
                          on_group: Callable[[int, list[Trajectory]], None] | None = None) -> list[Trajectory]:
        """One episode per task (or seed) in which the env's :meth:`~envkit.Env.demonstrate` writes every assistant
        turn in the model's place: supervised data laid out exactly as the model's rollouts are.

        Each demonstrated turn is written as text the way the model is taught to write it (tool calls in the tool
        parser's format), tokenized, given loss_mask 1 (logprobs 0.0), read back by the parser and stepped in the
        env for real, so tool outputs and rewards are genuine. ``policy_version`` is -1: no policy sampled it. An env
        without demonstrations fails every rollout with a NotImplementedError in ``error``.
        """
        if not self._demonstrated.runners:
            raise ValueError("demonstrations are token ids: this generator has no tokenizer")
        return await self._run(make_env, self._demonstrated, tasks=tasks, seeds=seeds, env_name=env_name,
                               on_done=on_done, on_group=on_group)

    async def _run(self, make_env: EnvFactory, play: _Play, *, tasks: Sequence[Task] | None,
                   seeds: Sequence[int] | None, env_name: str, on_done: Callable[[Trajectory], None] | None = None,
                   on_group: Callable[[int, list[Trajectory]], None] | None = None) -> list[Trajectory]:
        if (tasks is None) == (seeds is None):
            raise ValueError("pass exactly one of tasks= or seeds=")
        starts: list[tuple[Task | None, int | None]] = (
            [(t, None) for t in tasks] if tasks is not None else [(None, s) for s in seeds or ()]
        )
        limit = asyncio.Semaphore(self.config.concurrency)

        async def one(task: Task | None, seed: int | None, group: str, k: int, branch: _Branch | None) -> Trajectory:
            point = None
            if branch is not None and k > 0:
                try:
                    point = await branch.point  # before taking a slot: the trunks must get theirs
                except RuntimeError as e:
                    return self._failed(group, k, seed, task, env_name, str(e))
            async with limit:
                traj = await self._rollout(make_env, play, task=task, seed=seed, group_id=group, sample_index=k,
                                           env_name=env_name, at_turn=branch.at_turn if branch and k == 0 else None,
                                           resume=point)
            if branch is not None and k == 0:
                branch.trunk_ended(traj)
            if on_done is not None:
                on_done(traj)
            return traj

        async def group(i: int, task: Task | None, seed: int | None) -> list[Trajectory]:
            branch = _Branch(self.config.branch_at) if self.config.branch_at and play.samples > 1 else None
            rollouts = await asyncio.gather(*(one(task, seed, _group_id(task, seed, i), k, branch)
                                              for k in range(play.samples)))
            if self.group_rubric is not None and play.sampled:
                await self._score_group(self.group_rubric, task, rollouts, self.config.timeout_s)
            if on_group is not None:
                on_group(i, rollouts)
            return rollouts

        async with self._agents.serving():
            groups = await asyncio.gather(*(group(i, task, seed) for i, (task, seed) in enumerate(starts)))
        return [t for samples in groups for t in samples]

    @staticmethod
    async def _score_group(rubric: GroupRubric, task: Task | None, rollouts: list[Trajectory],
                           timeout_s: float) -> None:
        finished = [t for t in rollouts if not t.failed]
        timer = asyncio.timeout(timeout_s)  # a judge that stops answering must not hold the step
        try:
            async with timer:
                scores = await rubric.score_group([Episode(task, t.messages, t.reward) for t in finished])
        except Exception as e:
            judge = getattr(getattr(rubric, "endpoint", None), "base_url", None)
            error = RubricError(f"group rubric {rubric.name!r} did not score within {timeout_s:g} s"
                                + (f" (its judge: {judge})" if judge else "")) if timer.expired() else e
            for t in finished:
                t.stop_reason, t.error = "error", _describe(error if isinstance(error, RubricError) else RubricError(
                    f"group rubric {rubric.name!r} failed: {type(error).__name__}: {error}"))
            return
        for t, score in zip(finished, scores, strict=True):
            t.reward, t.scores = score.value, {"env": t.reward, **t.scores, **score.breakdown}

    async def rollout(self, make_env: EnvFactory, *, task: Task | None = None, seed: int | None = None,
                      group_id: str = "", sample_index: int = 0, env_name: str = "") -> Trajectory:
        """One episode. Never raises for env or engine faults: they end up in ``stop_reason``/``error``."""
        async with self._agents.serving():
            return await self._rollout(make_env, self._sampled, task=task, seed=seed, group_id=group_id,
                                       sample_index=sample_index, env_name=env_name)

    def _failed(self, group_id: str, sample_index: int, seed: int | None, task: Task | None, env_name: str,
                error: str) -> Trajectory:
        return Trajectory(group_id=group_id, sample_index=sample_index, seed=seed, env_name=env_name,
                          task_id=(task or {}).get("id"), stop_reason="error", error=error,
                          tokenizer=self.tokenizer.fingerprint if self.tokenizer else "")

    async def _rollout(self, make_env: EnvFactory, play: _Play, *, task: Task | None, seed: int | None,
                       group_id: str, sample_index: int, env_name: str, at_turn: AtTurn | None = None,
                       resume: _BranchPoint | None = None) -> Trajectory:
        if resume is None:
            version = (self.engine.weight_version if self.engine else 0) if play.sampled else -1
            traj = Trajectory(group_id=group_id, sample_index=sample_index, seed=seed, env_name=env_name,
                              task_id=(task or {}).get("id"), policy_version=version,
                              tokenizer=self.tokenizer.fingerprint if self.tokenizer else "")
            state = Rollout(traj)
        else:  # a branch: the trunk's rollout up to the branch point, none of it this rollout's to train on
            state = copy.deepcopy(resume.state)
            state.generate_s = state.env_s = 0.0
            traj = state.traj
            traj.sample_index, traj.branch_turn = sample_index, traj.num_turns
            traj.loss_mask = [0] * len(traj.loss_mask)
        with tracing.span("rollout", root=True, env=env_name, task_id=traj.task_id, seed=seed, group=group_id,
                          sample=sample_index, weight_version=traj.policy_version):
            await self._play(make_env, play, state, task, seed, at_turn, resume)
            tracing.annotate(tokens=len(traj.response_ids), reward=traj.reward, stop_reason=traj.stop_reason,
                             error=traj.error, turns=traj.num_turns, staleness=self._staleness(traj))
        return traj

    def _staleness(self, traj: Trajectory) -> int | None:
        """How many weight versions the engine moved on while the rollout was generated."""
        return self.engine.weight_version - traj.policy_version if self.engine and traj.policy_version >= 0 else None

    async def _play(self, make_env: EnvFactory, play: _Play, state: Rollout, task: Task | None, seed: int | None,
                    at_turn: AtTurn | None, resume: _BranchPoint | None) -> None:
        traj = state.traj
        start = time.perf_counter()
        env: Env | None = None
        session = rollout_session.set(Session())  # a replicated engine sends all of this rollout's turns to one
        try:
            async with asyncio.timeout(self.config.timeout_s):
                env = make_env()
                if resume is not None:
                    await env.init()
                    await env.restore(resume.snapshot)
                traj.stop_reason = await self._episode(env, state, task, seed, play, at_turn=at_turn,
                                                       resumed=resume is not None)
        except TimeoutError:
            traj.stop_reason, traj.error = "timeout", f"rollout exceeded {self.config.timeout_s:g} s"
        except PartLost:
            raise
        except Exception as e:
            traj.stop_reason, traj.error = "error", _describe(e)
            log.debug("rollout failed", exc_info=True)
        finally:
            rollout_session.reset(session)
            if env is not None:
                await self._close(env, traj)
            traj.timings = {"generate": state.generate_s, "env": state.env_s, "total": time.perf_counter() - start}

    async def _episode(self, env: Env, state: Rollout, task: Task | None, seed: int | None, play: _Play, *,
                       at_turn: AtTurn | None = None, resumed: bool = False) -> StopReason:
        """Play the episode with the first of ``play``'s runners that takes this env."""
        t0 = time.perf_counter()
        await env.init()  # first: an env in an env worker knows only then whether it is an agent env
        state.env_s += time.perf_counter() - t0
        runner = next((r for r in play.runners if r.accepts(env)), None)
        if runner is None:
            how = "sampled" if play.sampled else "demonstrated (an agent env's agent plays it: no demonstrations)"
            raise NotImplementedError(f"{type(env.unwrapped).__name__}'s episodes cannot be {how}")
        return await runner.play(env, state, task, seed, at_turn=at_turn, resumed=resumed)

    async def _close(self, env: Env, traj: Trajectory) -> None:
        try:
            async with asyncio.timeout(self.config.close_timeout_s):
                await env.close()
        except Exception as e:  # a failing close must not turn a finished rollout into a failed one
            log.warning("env.close() failed for %s (task %s): %s: %s", traj.env_name, traj.task_id,
                        type(e).__name__, e)


def _describe(error: BaseException) -> str:
    """``error`` and what caused it, as one line: a client library's "Connection error." names its cause only in
    ``__cause__``."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    return f"{text} (from {type(cause).__name__}: {cause})" if cause is not None and str(cause) not in text else text


def _group_id(task: Task | None, seed: int | None, index: int) -> str:
    if task is not None:
        return str(task.get("id", f"task-{index}"))
    return f"seed-{seed}"
