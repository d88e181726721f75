"""Where a run's episodes come from: the run's envs (one, or a weighted mixture), each with its episode starts per
split, drawn in a resumable order.

    starts      the episode starts of one split: an env's own task list, a seed range, or the rows of a dataset
    EnvStream   one env of the run: how to make it (in-process, ``ws://``, ``openenv:``, ``gym:``, or sandboxed
                from a warm pool), its train and eval starts, and its data position
    Mixture     the run's envs: exact per-step quotas by weight, rollouts, held-out rollouts, the resumable state

Where an env runs changes only what :meth:`EnvStream.make` hands its ``EnvRef`` to; the loop never asks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envkit import Env, Task
from envkit.errors import ResetNeededError
from envkit.ref import EnvRef, WarmPool
from generators import Generator, Trajectory
from trainer.config import ConfigError, CurriculumConfig, EnvConfig, TaskSourceConfig
from trainer.curriculum import Sampler, Start, make_sampler

log = logging.getLogger(__name__)

_DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class SeedStarts(Sequence[Start]):
    """The seeds ``start .. stop - 1``, for envs that do not list tasks: each seed is one reproducible episode."""

    def __init__(self, start: int, stop: int) -> None:
        self.range = range(start, stop)

    def __len__(self) -> int:
        return len(self.range)

    def __getitem__(self, i: int) -> Start:  # type: ignore[override]
        return None, self.range[i]


class TaskStarts(Sequence[Start]):
    """Explicit tasks (an env's list or dataset rows), each reset with ``task=``."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Start:  # type: ignore[override]
        return self.tasks[i], None


def dataset_tasks(path: str, columns: dict[str, str], *, split: str | None = None) -> list[Task]:
    """The rows of a JSONL/JSON/Parquet/CSV file or a ``save_to_disk`` dir as tasks (``columns`` renames)."""
    import datasets

    p = Path(path)
    if p.is_dir():
        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"{p} has splits {sorted(loaded)}, not {split!r}: set env.train_split/eval_split")
            loaded = loaded[split]
        rows = loaded
    elif p.suffix in _DATASET_FORMATS:
        rows = datasets.load_dataset(_DATASET_FORMATS[p.suffix], data_files=str(p), split="train")
    elif not p.exists():
        raise ConfigError(f"env.tasks.dataset: {p} does not exist")
    else:
        raise ConfigError(f"env.tasks.dataset: {p} is not a {'/'.join(_DATASET_FORMATS)} file or a save_to_disk dir")
    return rows_to_tasks(list(rows), columns, prefix=p.stem)


def rows_to_tasks(rows: list[dict[str, Any]], columns: dict[str, str], *, prefix: str) -> list[Task]:
    """Rename ``columns`` (task field -> column) in each row; rows without an ``id`` get ``PREFIX-i``."""
    missing = sorted({c for c in columns.values() if rows and c not in rows[0]})
    if missing:
        raise ConfigError(f"env.tasks.columns names columns the dataset lacks: {missing}; it has "
                          f"{sorted(rows[0])}")
    renamed = set(columns.values())
    tasks: list[Task] = []
    for i, row in enumerate(rows):
        task = {k: v for k, v in row.items() if k not in renamed}
        task.update({field_: row[column] for field_, column in columns.items()})
        task["id"] = str(task.get("id") if task.get("id") is not None else f"{prefix}-{i}")
        tasks.append(task)
    return tasks


@dataclass
class EnvStream:
    """One env of the run and where its next episodes come from: its sampler (trainer/curriculum.py) and
    ``drawn`` are its data position (in the checkpoint)."""

    cfg: EnvConfig
    label: str
    train: Sequence[Start] = ()
    eval: Sequence[Start] = ()
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    seed: int = 0
    """Seeds the sampler's draws."""
    sampler: Sampler | None = None
    """Which train starts come next (made once they are loaded)."""
    drawn: int = 0
    """Prompts drawn so far (what the mixture's quotas balance)."""
    pool: WarmPool | None = None
    """The warm SandboxPool of a sandboxed env whose episodes run in this process."""
    tools: bool = False
    """Whether the env offers the model tools: known once opened where its task lists are read from an env."""
    make_env: Callable[[EnvRef], Env] = EnvRef.make
    """``EnvRef.make`` or the placement's (an env in an env worker)."""

    def make(self, *, here: bool = False) -> Env:
        """A fresh env for one rollout (``here``: in this process, wherever the placement runs envs)."""
        ref = self.cfg.ref.with_pool(self.pool)
        return ref.make() if here else self.make_env(ref)

    async def open(self, *, pool_size: int) -> None:
        """Start the sandbox pool (if any, and ``pool_size`` > 0: the run's episodes run in this process) and load the
        train and eval starts."""
        if self.cfg.sandbox is not None and pool_size:
            from sandboxes.env import open_pool_for

            self.pool = await open_pool_for(self.cfg.ref, size=self.cfg.pool_size or pool_size)
        if pool_size and self.cfg.sandbox is None:
            await self._warm_code_sandboxes()
        self.train, self.eval = await self._load_starts()
        if not self.train:
            raise ConfigError(f"env {self.label!r} has no training episodes ({self.cfg.train_split} split is empty)")
        self.sampler = make_sampler(self.curriculum, self.train, self.seed,
                                    shuffle=self.cfg.tasks.shuffle and not isinstance(self.train, SeedStarts))
        log.info("env %s: %d train and %d eval starts (%s)", self.label, len(self.train), len(self.eval),
                 type(self.train).__name__)

    async def close(self) -> None:
        """Drain the sandbox pool; idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()

    async def _warm_code_sandboxes(self) -> None:
        """The run's episodes share this loop's code-tool pool, if the env has code tools: its sandboxes start now,
        while the inference server starts, not when the first episode calls code."""
        from sandboxes.tools import CodeSandboxEnv

        env = self.make(here=True)
        try:
            if isinstance(env.unwrapped, CodeSandboxEnv):
                await env.unwrapped.warm()
        finally:
            await env.close()

    async def _load_starts(self) -> tuple[Sequence[Start], Sequence[Start]]:
        """The train and eval starts from the configured source: one env asked for both lists, or one dataset
        read."""
        t: TaskSourceConfig = self.cfg.tasks
        if t.source == "seeds":
            return SeedStarts(*t.train_seeds), SeedStarts(*t.eval_seeds)
        if t.source == "dataset":
            train, held_out = await asyncio.to_thread(self._dataset_rows)
            return TaskStarts(train), TaskStarts(held_out)
        train_list, eval_list = await self._env_tasks((self.cfg.train_split, self.cfg.eval_split))
        return self._listed(train_list, t.train_seeds), self._listed(eval_list, t.eval_seeds)

    def _listed(self, tasks: list[Task] | None, seeds: list[int]) -> Sequence[Start]:
        """An env's list as starts; seeds when it lists none (unless the config insists on lists)."""
        if tasks is not None:
            return TaskStarts(tasks)
        if self.cfg.tasks.source == "env":
            raise ConfigError(f"env {self.label!r} does not list its tasks: use env.tasks.source=seeds (or auto)")
        return SeedStarts(*seeds)

    def _dataset_rows(self) -> tuple[list[Task], list[Task]]:
        """Train rows: the dataset less ``eval_rows`` held out. Eval rows: ``eval_dataset``, else the held-out rows,
        else a saved DatasetDict's eval split, else none."""
        t = self.cfg.tasks
        assert t.dataset is not None
        rows = dataset_tasks(t.dataset, t.columns, split=self.cfg.train_split)
        held_out: list[Task] = []
        if t.eval_rows:
            if t.eval_rows >= len(rows):
                raise ConfigError(f"env.tasks.eval_rows={t.eval_rows} holds out all {len(rows)} rows of {t.dataset}")
            held = set(random.Random(0).sample(range(len(rows)), t.eval_rows))  # a fixed split, the same every run
            held_out = [r for i, r in enumerate(rows) if i in held]
            rows = [r for i, r in enumerate(rows) if i not in held]
        if t.eval_dataset:
            held_out = dataset_tasks(t.eval_dataset, t.columns, split=self.cfg.eval_split)
        elif not t.eval_rows and (Path(t.dataset) / "dataset_dict.json").is_file():  # a saved DatasetDict
            held_out = dataset_tasks(t.dataset, t.columns, split=self.cfg.eval_split)
        return rows, held_out

    async def _env_tasks(self, splits: tuple[str, ...]) -> list[list[Task] | None]:
        """The env's own list for each split (None where it lists none), from one env; a sandboxed env is asked
        from inside its sandbox."""
        env = self.make(here=True)
        try:
            try:
                lists = [await asyncio.to_thread(_listed_tasks, env, split) for split in splits]
            except ResetNeededError:  # sandboxed: the lists live in the sandbox, which init brings up
                await env.init()
                lists = [await asyncio.to_thread(_listed_tasks, env, split) for split in splits]
            self.tools = bool(env.tools)
            return lists
        except ValueError as e:  # no such split
            raise ConfigError(f"env {self.label!r}: {e}") from e
        finally:
            await env.close()

    def next_starts(self, k: int) -> list[Start]:
        """The next ``k`` train starts, as the sampler draws them."""
        assert self.sampler is not None, "open() the stream first"
        chosen = [self.train[i] for i in self.sampler.draw(k)]
        self.drawn += k
        return chosen

    def observe(self, start: Start, group: list[Trajectory]) -> None:
        """A completed group of a train start: its finished rollouts' outcomes go to the sampler's pass rates."""
        if self.sampler is not None:
            self.sampler.observe(start, [t.reward for t in group if not t.failed])

    def state(self) -> dict[str, Any]:
        """The data position (the sampler's state and the prompts drawn), for the checkpoint."""
        assert self.sampler is not None
        return {"drawn": self.drawn, **self.sampler.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's data position."""
        assert self.sampler is not None
        self.drawn = state["drawn"]
        self.sampler.load_state(state)


class Mixture:
    """The envs of a run (``env`` or ``env.mixture``), each step's prompts split among them by weight."""

    def __init__(self, cfg: EnvConfig, *, seed: int, make_env: Callable[[EnvRef], Env] = EnvRef.make,
                 curriculum: CurriculumConfig | None = None) -> None:
        self.streams = [EnvStream(c, c.display_name, make_env=make_env, curriculum=curriculum or CurriculumConfig(),
                                  seed=seed) for c in cfg.members]
        self.weights = [c.weight for c in cfg.members]
        self.seed = seed
        self.refilled = 0
        """Prompts drawn again for flat groups (``rollouts(refill=...)``), since the last :meth:`metrics`."""

    @property
    def labels(self) -> list[str]:
        """The envs' labels, in config order."""
        return [s.label for s in self.streams]

    async def open(self, *, pool_size: int) -> None:
        """Bring every env up (pools, task lists); on failure, what started is closed again."""
        try:
            for stream in self.streams:
                await stream.open(pool_size=pool_size)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Drain every sandbox pool."""
        await asyncio.gather(*(s.close() for s in self.streams), return_exceptions=True)

    def quotas(self, k: int) -> list[int]:
        """How many of the next ``k`` prompts each env gets: each goes to the env furthest below its weight's share
        of all prompts drawn so far, so every env stays within one prompt of its share at every step."""
        total = sum(self.weights)
        drawn = [s.drawn for s in self.streams]
        n = sum(drawn)
        quotas = [0] * len(self.streams)
        for j in range(1, k + 1):
            deficit = [w / total * (n + j) - (d + q) for w, d, q in zip(self.weights, drawn, quotas, strict=True)]
            quotas[deficit.index(max(deficit))] += 1
        return quotas

    def draw(self, k: int) -> list[tuple[EnvStream, list[Start]]]:
        """The next ``k`` prompts split among the envs by quota: each env that gets some, with its starts."""
        return [(stream, stream.next_starts(quota))
                for stream, quota in zip(self.streams, self.quotas(k), strict=True) if quota]

    async def rollouts(self, generator: Generator, k: int, *, refill: int = 0) -> list[Trajectory]:
        """The generator's ``samples_per_prompt`` rollouts for each of the next ``k`` prompts, split among the envs
        by quota; each group's outcomes go to its env's pass rates. ``refill`` rounds draw one more prompt for each
        flat group (rewards all equal: it teaches nothing) of the round before (dynamic sampling; counted in
        :attr:`refilled`)."""
        trajs, drawn = await refilled(lambda n: self._generate(generator, n), k, refill)
        self.refilled += drawn
        return trajs

    async def _generate(self, generator: Generator, k: int) -> list[Trajectory]:
        jobs = [generate_starts(generator, stream, starts, _observer(stream, starts))
                for stream, starts in self.draw(k)]
        return [t for group in await asyncio.gather(*jobs) for t in group]

    def metrics(self) -> dict[str, float]:
        """Each env's sampler's view of its tasks (``curriculum/LABEL/...``): pass rates' spread, set-aside tasks;
        and the prompts drawn again for flat groups since the last call (``curriculum/refilled``)."""
        refilled, self.refilled = self.refilled, 0
        return {"curriculum/refilled": refilled, **{f"curriculum/{s.label}/{k}": v for s in self.streams
                                                    if s.sampler is not None for k, v in s.sampler.metrics().items()}}

    async def eval_rollouts(self, generator: Generator, limit: int) -> list[Trajectory]:
        """The generator's ``samples_per_prompt`` rollouts of each env's first ``limit`` held-out starts."""
        jobs = [generate_starts(generator, s, [s.eval[i] for i in range(min(limit, len(s.eval)))])
                for s in self.streams]
        return [t for trajs in await asyncio.gather(*jobs) for t in trajs]

    def state(self) -> dict[str, dict[str, Any]]:
        """Every env's data position, by label."""
        return {s.label: s.state() for s in self.streams}

    def load_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore the data positions of a checkpoint (of a run with the same envs)."""
        if sorted(state) != sorted(self.labels):
            raise ConfigError(f"the checkpoint was written by a run of envs {sorted(state)}, this one trains "
                              f"{sorted(self.labels)}: resume with the same env config")
        for stream in self.streams:
            stream.load_state(state[stream.label])


def flat_groups(trajs: list[Trajectory]) -> set[str]:
    """The groups whose finished rollouts all got the same reward, or that have none: they teach GRPO nothing."""
    groups: dict[str, list[float]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).extend(() if t.failed else (t.reward,))
    return {g for g, rewards in groups.items() if not rewards or max(rewards) == min(rewards)}


async def refilled(generate: Callable[[int], Awaitable[list[Trajectory]]], k: int, rounds: int, *,
                   flat: Callable[[list[Trajectory]], set[str]] = flat_groups) -> tuple[list[Trajectory], int]:
    """``generate(k)``'s rollouts of ``k`` starts, then ``rounds`` rounds that each draw one more start for
    every flat one of the round before (``flat``: the flat starts' group ids, :func:`flat_groups` by default), its
    groups tagged ``#refill-N``: every rollout, and how many starts were drawn again."""
    trajs = await generate(k)
    drawn, again = 0, len(flat(trajs))
    for round_ in range(1, rounds + 1):
        if not again:
            break
        more = await generate(again)
        for t in more:  # a start drawn again is a group of its own
            t.group_id += f"#refill-{round_}"
        drawn += again
        trajs += more
        again = len(flat(more))
    return trajs, drawn


def _observer(stream: EnvStream, starts: list[Start]) -> Callable[[int, list[Trajectory]], None]:
    """An ``on_group`` that tells ``stream`` each group of ``starts`` as it completes."""
    return lambda i, group: stream.observe(starts[i], group)


def _listed_tasks(env: Env, split: str) -> list[Task] | None:
    """``env.tasks(split)`` read whole (blocking: a served list is fetched over HTTP)."""
    tasks = env.tasks(split)
    return None if tasks is None else list(tasks)


async def generate_starts(generator: Generator, stream: EnvStream, starts: list[Start],
                          on_group: Callable[[int, list[Trajectory]], None] | None = None, *,
                          demonstrate: bool = False) -> list[Trajectory]:
    """Rollouts of ``starts`` in ``stream``'s env (with ``demonstrate``, the env's demonstrations of them); group ids
    carry the env's label, so mixtures never merge groups. ``on_group(i, rollouts)`` is called as the group of
    ``starts[i]`` completes."""
    if not starts:
        return []

    def labelled(i: int, trajs: list[Trajectory]) -> None:
        for t in trajs:
            t.group_id = f"{stream.label}/{t.group_id}"
        if on_group is not None:
            on_group(i, trajs)

    play = generator.demonstrate if demonstrate else generator.generate
    if starts[0][0] is not None:
        return await play(stream.make, tasks=[t for t, _ in starts if t is not None], env_name=stream.label,
                          on_group=labelled)
    return await play(stream.make, seeds=[s for _, s in starts if s is not None], env_name=stream.label,
                      on_group=labelled)
