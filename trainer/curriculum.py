"""Which train tasks each step draws (``curriculum.sampler``), and each task's pass rate as the run sees it.

    PassRates   per task, its latest outcomes (passed: reward >= curriculum.pass_threshold), at most
                curriculum.window of them; seeded from files ``envkit eval --pass-rates`` wrote, kept live from
                the run's own rollouts
    Sampler     one class: ``draw(k)`` gives indices into the env's train starts, ``observe`` takes a group's
                rewards, ``state``/``load_state`` go into the checkpoint (resume draws what the run would have)
    uniform     every task once per epoch, in an order shuffled per epoch (seed, epoch): the default
    band        tasks whose pass rate is inside curriculum.band, and tasks not yet tried curriculum.min_tries times;
                a task solved (above the band) or hopeless (below it) is set aside, and each draw retries a set-aside
                task with probability curriculum.retry, so one that became learnable comes back; while fewer than
                curriculum.min_active tasks are in the band, set-aside tasks rejoin, the hopeless nearest it first (a
                band that its policy emptied would otherwise train on the same few tasks again and again); with
                curriculum.group_by (task fields such as a level), the hopeless of the group whose hopeless tasks
                passed most when drawn again rejoin first
    bandit      the band's tasks in cells (per group: those in the band drawn in the last few steps, the rest of
                the band, the solved, the hopeless); each draw goes to the cell whose groups varied most lately
                (Thompson sampling): no fixed retry rate or floor, the draws follow where the variance is

A group whose rewards are all equal teaches GRPO nothing: the band keeps drawing the tasks whose groups vary. A
sampler of your own is ``curriculum.sampler=package.module:Class``, a :class:`Sampler` subclass.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envkit import Task
from envkit.imports import import_ref
from trainer.config import ConfigError, CurriculumConfig

Start = tuple[Task | None, int | None]
"""One episode start: ``(task, None)`` or ``(None, seed)`` (trainer/sources.py draws them, a sampler orders them)."""


def start_key(start: Start, index: int) -> str:
    """A train start's name in pass rates: its task's id (what ``envkit eval`` names it by), ``seed-N``, or
    ``task-I`` by its place in the train list."""
    task, seed = start
    if task is not None:
        return str(task.get("id", f"task-{index}"))
    return f"seed-{seed}"


class PassRates:
    """Each task's latest outcomes (1 passed, 0 not), at most ``window`` of them."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.outcomes: dict[str, deque[int]] = {}

    def add(self, key: str, passed: Sequence[bool]) -> None:
        """Record one group's outcomes for ``key``."""
        self.outcomes.setdefault(key, deque(maxlen=self.window)).extend(int(p) for p in passed)

    def tried(self, key: str) -> int:
        """Outcomes known for ``key`` (up to the window)."""
        return len(self.outcomes.get(key, ()))

    def rate(self, key: str) -> float | None:
        """The share passed of ``key``'s latest outcomes; None before any."""
        seen = self.outcomes.get(key)
        return sum(seen) / len(seen) if seen else None

    def seed_from(self, path: str | Path) -> int:
        """Start from a pass-rates file (``envkit eval --pass-rates``): each task's rate as that many passes of its
        tries (up to the window); returns how many tasks it named."""
        try:
            tasks = json.loads(Path(path).read_text())["tasks"]
            for key, row in tasks.items():
                tried = min(int(row["tried"]), self.window)
                passed = round(int(row["passed"]) / int(row["tried"]) * tried) if tried else 0
                self.outcomes[key] = deque([1] * passed + [0] * (tried - passed), maxlen=self.window)
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise ConfigError(f"curriculum.pass_rates: cannot read {path}: {type(e).__name__}: {e}") from None
        return len(tasks)

    def state(self) -> dict[str, list[int]]:
        """The outcomes, for the checkpoint."""
        return {key: list(seen) for key, seen in self.outcomes.items()}

    def load_state(self, state: dict[str, list[int]]) -> None:
        """Continue from a checkpoint's outcomes."""
        self.outcomes = {key: deque(seen, maxlen=self.window) for key, seen in state.items()}


class Sampler:
    """Draws an env's train starts for each step, told each group's outcome as it completes."""

    def __init__(self, starts: Sequence[Start], cfg: CurriculumConfig, seed: int) -> None:
        self.starts, self.cfg, self.seed = starts, cfg, seed
        self.rates = PassRates(cfg.window)
        for path in cfg.pass_rates:
            self.rates.seed_from(path)

    def draw(self, k: int) -> list[int]:
        """The indices of the next ``k`` train starts."""
        raise NotImplementedError

    def key(self, i: int) -> str:
        """Train start ``i``'s name in the pass rates."""
        return start_key(self.starts[i], i)

    def observe(self, start: Start, rewards: Sequence[float]) -> str | None:
        """One completed group of ``start`` (a train start): its finished rollouts' rewards; returns the task's
        key (None for a start not in the list)."""
        task, _ = start
        if task is not None and "id" not in task:  # named by its place in the list
            key = next((self.key(i) for i, (listed, _) in enumerate(self.starts) if listed is task), None)
        else:
            key = start_key(start, -1)
        if key is not None:
            self.rates.add(key, [r >= self.cfg.pass_threshold for r in rewards])
        return key

    def state(self) -> dict[str, Any]:
        """Everything the next draws depend on, for the checkpoint (JSON)."""
        return {"rates": self.rates.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.rates.load_state(state.get("rates", {}))

    def metrics(self) -> dict[str, float]:
        """The pass rates' spread over the tasks tried: how many are at 0, in between and at 1, and how many are
        untried."""
        rates = [r for key in self.rates.outcomes if (r := self.rates.rate(key)) is not None]
        return {"tasks_at_0": sum(r == 0 for r in rates), "tasks_between": sum(0 < r < 1 for r in rates),
                "tasks_at_1": sum(r == 1 for r in rates), "tasks_untried": max(0, len(self.starts) - len(rates))}


class Uniform(Sampler):
    """Every task once per epoch, in an order shuffled per epoch (``seed``, epoch); seeds in order."""

    def __init__(self, starts: Sequence[Start], cfg: CurriculumConfig, seed: int, *, shuffle: bool = True) -> None:
        super().__init__(starts, cfg, seed)
        self.shuffle = shuffle
        self.epoch = self.pos = 0
        self._order: tuple[int, list[int]] | None = None

    def draw(self, k: int) -> list[int]:
        chosen: list[int] = []
        while len(chosen) < k:
            order = self._epoch_order()
            take = order[self.pos:self.pos + k - len(chosen)]
            chosen.extend(take)
            self.pos += len(take)
            if self.pos >= len(self.starts):
                self.epoch, self.pos = self.epoch + 1, 0
        return chosen

    def _epoch_order(self) -> Sequence[int]:
        if not self.shuffle:
            return range(len(self.starts))
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(len(self.starts)))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def state(self) -> dict[str, Any]:
        return {**super().state(), "epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.epoch, self.pos = state["epoch"], state["pos"]


BAND_LIMIT = 100_000
"""The most train tasks the band sampler weighs."""
PRIOR_TRIES = 2
"""The band's floor reads a task's rate as if it had this many more tries, passed at the pool's rate (or its
group's comeback rate)."""
COMEBACK_WINDOW = 64
"""With curriculum.group_by: a group's comeback rate is over its hopeless tasks' latest this-many outcomes when
drawn again."""
ORIGINS = ("band", "rejoined", "retried")
"""Why the band drew a task: in the band (or untried), brought back by the floor, or a set-aside task retried."""
GROUPS_LOGGED = 16
"""The most groups whose comeback rates are logged (a field of one value per task would flood the metrics)."""


class Band(Sampler):
    """The tasks whose pass rate gives a group variance; the solved and the hopeless set aside, retried now and
    then."""

    def __init__(self, starts: Sequence[Start], cfg: CurriculumConfig, seed: int) -> None:
        super().__init__(starts, cfg, seed)
        if len(starts) > BAND_LIMIT:
            raise ConfigError(f"curriculum.sampler=band weighs every train task at each draw: {len(starts)} is too "
                              f"many (at most {BAND_LIMIT}; for a seeded env, narrow env.tasks.train_seeds)")
        self.keys = [self.key(i) for i in range(len(starts))]
        if cfg.pass_rates and not any(key in self.rates.outcomes for key in self.keys):
            raise ConfigError(f"curriculum.pass_rates {list(cfg.pass_rates)} name none of this env's {len(starts)} "
                              "train tasks: profile the split it trains on (envkit eval NAME --split train "
                              "--pass-rates FILE)")
        self.rng = random.Random(seed)
        self.groups: dict[str, str] = {}
        """Each task's group (its ``curriculum.group_by`` fields' values, joined by commas), when grouped."""
        if cfg.group_by:
            self.groups = {key: ",".join(str(task[f]) for f in cfg.group_by)
                           for key, (task, _) in zip(self.keys, starts, strict=True)
                           if task is not None and all(f in task for f in cfg.group_by)}
            if not self.groups:
                raise ConfigError(f"curriculum.group_by={list(cfg.group_by)}: none of this env's {len(starts)} train "
                                  "tasks has those fields")
        self.log_groups = len(set(self.groups.values())) <= GROUPS_LOGGED
        self.comebacks: dict[str, deque[int]] = {}
        """Per group, the latest outcomes of its tasks drawn while set aside as hopeless: how likely its hopeless
        tasks are to have come within reach. Only those count: the band's own draws were picked for being in reach,
        and a solved task retried passes again."""
        self.pending: set[str] = set()
        """Tasks drawn while set aside as hopeless whose outcomes are still to come."""
        self.retried = 0
        """Draws of a set-aside task, since the last metrics."""
        self.joined = 0
        """Set-aside tasks the last draw made active again, to keep curriculum.min_active."""
        self.drawn_as: dict[str, deque[str]] = {}
        """Per task, why each of its groups still to come was drawn (ORIGINS), oldest first."""
        self.groups_from = dict.fromkeys(ORIGINS, 0)
        self.flat_from = dict.fromkeys(ORIGINS, 0)
        self.passed_from = dict.fromkeys(ORIGINS, 0)
        """Groups observed, the flat ones among them, and the flat ones that all passed, by why they were drawn,
        since the last metrics."""

    def set_aside(self, key: str) -> str | None:
        """Why ``key`` is set aside (solved or hopeless), or None while it is drawn."""
        rate = self.rates.rate(key)
        if rate is None or self.rates.tried(key) < self.cfg.min_tries:
            return None
        low, high = self.cfg.band
        return "solved" if rate > high else "hopeless" if rate < low else None

    def _pool_rate(self) -> float:
        """The share passed of every task's latest outcomes (0 before any)."""
        tried = [outcome for outcomes in self.rates.outcomes.values() for outcome in outcomes]
        return sum(tried) / max(1, len(tried))

    def _distance(self, i: int, priors: dict[str, float], pool_rate: float) -> float:
        """How far set-aside task ``i``'s pass rate is outside the band, its rate pulled by PRIOR_TRIES tries
        toward its group's comeback rate in ``priors`` (the pool's, ungrouped or before any comeback): of two
        hopeless tasks, one that passed once is nearer than one that never did, and of two that never did, the one
        tried less or the one of a group whose hopeless tasks came back passing."""
        key = self.keys[i]
        outcomes = self.rates.outcomes[key]
        prior = priors.get(self.groups.get(key, ""), pool_rate)
        rate = (sum(outcomes) + PRIOR_TRIES * prior) / (len(outcomes) + PRIOR_TRIES)
        low, high = self.cfg.band
        return max(low - rate, rate - high)

    def draw(self, k: int) -> list[int]:
        reasons = [self.set_aside(key) for key in self.keys]
        active = [i for i, reason in enumerate(reasons) if reason is None]
        aside = [i for i, reason in enumerate(reasons) if reason is not None]
        self.joined = 0
        if len(active) < self.cfg.min_active and aside:  # too few left in the band: the nearest set-aside rejoin
            pool_rate = self._pool_rate()
            self.rng.shuffle(aside)  # ties in random order
            # the hopeless first: a policy that learns is likelier to have come within reach of what it failed
            priors = self._comeback_rates()
            aside.sort(key=lambda i: (reasons[i] == "solved", self._distance(i, priors, pool_rate)))
            self.joined = min(len(aside), self.cfg.min_active - len(active))
            active, aside = active + aside[:self.joined], aside[self.joined:]
        every = active or list(aside)  # with every task set aside, all of them are retried
        chosen: list[int] = []
        pool: list[int] = []
        for _ in range(k):
            if aside and (not active or self.rng.random() < self.cfg.retry):
                chosen.append(aside.pop(self.rng.randrange(len(aside))))
                self.retried += 1
                self._drawn(chosen[-1], "retried")
                continue
            if not pool:  # each task once before any twice
                pool = [i for i in every if i not in chosen] or list(every)
                self.rng.shuffle(pool)
            chosen.append(pool.pop())
            self.retried += not active
            self._drawn(chosen[-1], "band" if reasons[chosen[-1]] is None else "rejoined" if active else "retried")
        # only the hopeless: a solved task retried says nothing of whether its group's hopeless came within reach
        self.pending.update(key for i in chosen if reasons[i] == "hopeless" and (key := self.keys[i]) in self.groups)
        return chosen

    def _drawn(self, i: int, origin: str) -> None:
        self.drawn_as.setdefault(self.keys[i], deque()).append(origin)

    def _comeback_rates(self) -> dict[str, float]:
        """Each group's comeback rate, for the groups with comebacks."""
        return {group: sum(seen) / len(seen) for group, seen in sorted(self.comebacks.items()) if seen}

    def observe(self, start: Start, rewards: Sequence[float]) -> str | None:
        key = super().observe(start, rewards)
        if (origin := _oldest(self.drawn_as, key)) is not None:
            self.groups_from[origin] += 1
            self.flat_from[origin] += len(set(rewards)) <= 1  # none finished: flat too (flat_groups)
            self.passed_from[origin] += bool(rewards) and min(rewards) >= self.cfg.pass_threshold
        if key in self.pending:
            self.pending.discard(key)
            self.comebacks.setdefault(self.groups[key], deque(maxlen=COMEBACK_WINDOW)).extend(
                int(r >= self.cfg.pass_threshold) for r in rewards)
        return key

    def state(self) -> dict[str, Any]:
        rng = self.rng.getstate()
        # not the per-step counts (retried, groups_from, ...): the checkpoint is taken before its step's metrics
        # read them out, and the step after a resume counts its own
        return {**super().state(), "rng": [rng[0], list(rng[1]), rng[2]],
                "comebacks": {group: list(seen) for group, seen in self.comebacks.items()},
                "pending": sorted(self.pending), "drawn_as": {key: list(o) for key, o in self.drawn_as.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        version, inner, gauss = state["rng"]
        self.rng.setstate((version, tuple(inner), gauss))
        self.comebacks = {group: deque(seen, maxlen=COMEBACK_WINDOW)
                          for group, seen in state.get("comebacks", {}).items()}
        self.pending = set(state.get("pending", ()))
        self.drawn_as = {key: deque(origins) for key, origins in state.get("drawn_as", {}).items()}

    def metrics(self) -> dict[str, float]:
        rates = [self.rates.rate(key) for key in self.keys]
        reasons = [self.set_aside(key) for key in self.keys]
        retried, self.retried = self.retried, 0
        origins = {f"{name}_from_{origin}": n for name, counts in
                   (("groups", self.groups_from), ("flat", self.flat_from), ("passed", self.passed_from))
                   for origin, n in counts.items()}
        self.groups_from, self.flat_from, self.passed_from = (dict.fromkeys(ORIGINS, 0) for _ in range(3))
        return {"tasks_at_0": rates.count(0.0), "tasks_between": sum(r is not None and 0 < r < 1 for r in rates),
                "tasks_at_1": rates.count(1.0), "tasks_untried": rates.count(None),
                "solved_aside": reasons.count("solved"), "hopeless_aside": reasons.count("hopeless"),
                "retried": retried, "rejoined": self.joined, **origins,
                **({f"comeback_rate/{group}": rate for group, rate in self._comeback_rates().items()}
                   if self.log_groups else {})}


CELL_DECAY = 0.9
"""bandit: each step multiplies every cell's counts by this, so a cell not drawn lately grows uncertain again and
is tried again (the policy has moved since)."""
RECENT_STEPS = 3
"""bandit: a task in the band whose latest group came at most this many steps ago is in its own cell. Drawn again
soon, such a task mostly varies again; drawn much later, the policy has mostly solved it meanwhile."""
ASIDE_PRIOR = (1.0, 3.0)
"""bandit: the (varied, flat) groups a set-aside cell starts with, as if 3 of its first 4 were flat: its tasks were
set aside for a reason. A band cell starts at (1, 1)."""


class Bandit(Band):
    """The band's tasks in cells (per group: those in the band whose latest group came in the last RECENT_STEPS
    steps, the rest of the band, the solved and the hopeless), each draw going to the cell whose groups varied most
    lately (Thompson sampling on decayed counts): a band whose tasks the policy solves between two draws is left
    for a set-aside cell whose groups came to vary."""

    def __init__(self, starts: Sequence[Start], cfg: CurriculumConfig, seed: int) -> None:
        super().__init__(starts, cfg, seed)
        self.cells: dict[str, list[float]] = {}
        """Per cell, its groups that varied and that were flat (priors included), decayed by CELL_DECAY a step."""
        self.cell_of: dict[str, deque[str]] = {}
        """Per task, the cell each of its groups still to come was drawn from, oldest first."""
        self.step = 0
        """Draws so far (one a step)."""
        self.seen_at: dict[str, int] = {}
        """Per task, the draw its latest group came in."""

    def _cell(self, key: str, reason: str | None) -> str:
        state = reason or ("recent" if self.step - self.seen_at.get(key, -RECENT_STEPS - 1) <= RECENT_STEPS
                           else "band")
        return f"{self.groups[key]}/{state}" if key in self.groups else state

    def draw(self, k: int) -> list[int]:
        self.step += 1
        reasons = [self.set_aside(key) for key in self.keys]
        for counts in self.cells.values():
            counts[0], counts[1] = counts[0] * CELL_DECAY, counts[1] * CELL_DECAY
        pool_rate = self._pool_rate()
        members: dict[str, list[int]] = {}
        chosen: list[int] = []
        for _ in range(k):
            if not any(members.values()):  # each task once before any twice
                members = self._members(reasons, pool_rate)
            open_cells = sorted(cell for cell, ids in members.items() if ids)
            cell = max(open_cells, key=lambda c: self.rng.betavariate(*self._counts(c, members[c][-1], reasons)))
            i = members[cell].pop()
            chosen.append(i)
            self.cell_of.setdefault(self.keys[i], deque()).append(cell)
            self.retried += reasons[i] is not None
            self._drawn(i, "band" if reasons[i] is None else "retried")
        return chosen

    def _members(self, reasons: list[str | None], pool_rate: float) -> dict[str, list[int]]:
        """Each cell's tasks in the order its draws take them (from the end): a band cell's latest rate nearest
        even first (untried ones as even: a group drawn again after 2-5 passes of 8 came back flat 5-19% of the
        time, after 7 of 8 60%), a set-aside cell's nearest the band first; ties in random order."""
        members: dict[str, list[int]] = {}
        for i, reason in enumerate(reasons):
            members.setdefault(self._cell(self.keys[i], reason), []).append(i)
        for ids in members.values():
            self.rng.shuffle(ids)
            if reasons[ids[0]] is not None:
                ids.sort(key=lambda i: -self._distance(i, {}, pool_rate))
            else:
                ids.sort(key=lambda i: -abs(self._rate_or_even(i) - 0.5))
        return members

    def _rate_or_even(self, i: int) -> float:
        """Task ``i``'s pass rate, 0.5 while untried."""
        rate = self.rates.rate(self.keys[i])
        return 0.5 if rate is None else rate

    def _counts(self, cell: str, i: int, reasons: list[str | None]) -> list[float]:
        """``cell``'s (varied, flat) counts, its prior included (``i``, one of its tasks, says which prior)."""
        counts = self.cells.setdefault(cell, list(ASIDE_PRIOR) if reasons[i] is not None else [1.0, 1.0])
        return [counts[0], counts[1]]

    def observe(self, start: Start, rewards: Sequence[float]) -> str | None:
        key = super().observe(start, rewards)
        if (cell := _oldest(self.cell_of, key)) is not None:
            self.cells[cell][len(set(rewards)) <= 1] += 1
        if key is not None:
            self.seen_at[key] = self.step
        return key

    def state(self) -> dict[str, Any]:
        return {**super().state(), "cells": self.cells, "step": self.step, "seen_at": self.seen_at,
                "cell_of": {key: list(cells) for key, cells in self.cell_of.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.cells = {cell: list(counts) for cell, counts in state["cells"].items()}
        self.cell_of = {key: deque(cells) for key, cells in state["cell_of"].items()}
        self.step, self.seen_at = state["step"], dict(state["seen_at"])

    def metrics(self) -> dict[str, float]:
        varied = {f"cell_varied/{cell}": round(v / (v + f), 3) for cell, (v, f) in sorted(self.cells.items())}
        return {**super().metrics(), **(varied if len(varied) <= GROUPS_LOGGED else {})}


def _oldest(pending: dict[str, deque[str]], key: str | None) -> str | None:
    """``key``'s oldest entry in ``pending``, taken out (None if it has none)."""
    if key is None or not (entries := pending.get(key)):
        return None
    entry = entries.popleft()
    if not entries:
        del pending[key]
    return entry


SAMPLERS: dict[str, type[Sampler]] = {"uniform": Uniform, "band": Band, "bandit": Bandit}
"""The built-in samplers, by their ``curriculum.sampler`` name."""


def make_sampler(cfg: CurriculumConfig, starts: Sequence[Start], seed: int, *, shuffle: bool = True) -> Sampler:
    """The configured sampler over ``starts`` (built-in by name, or ``module:Class``); ``shuffle`` is uniform's
    (``env.tasks.shuffle``; seeds are drawn in order)."""
    if cfg.sampler == "uniform":
        return Uniform(starts, cfg, seed, shuffle=shuffle)
    if cfg.sampler in SAMPLERS:
        return SAMPLERS[cfg.sampler](starts, cfg, seed)
    try:
        cls = import_ref(cfg.sampler)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"curriculum.sampler={cfg.sampler!r}: {type(e).__name__}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ConfigError(f"curriculum.sampler={cfg.sampler!r} is not a trainer.curriculum.Sampler subclass")
    return cls(starts, cfg, seed)

