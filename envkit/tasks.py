"""Helpers for envs with procedurally generated task sets: stable splits, lazy task lists, task checks."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

from envkit.core import Env, Task
from envkit.errors import InvalidTaskError

SPLITS = ("train", "test")


def stable_split(key: str, test_share: float = 0.2) -> str:
    """The split ("train" or "test") that owns the problem ``key``.

    Uses sha256, not the per-process salted ``hash()``, so every process and machine agrees and train/test
    never share a problem.
    """
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if digest < test_share * 2**64 else "train"


def split_problems(name: str, split: str, draw: Callable[[random.Random], tuple[str, Task]],
                   test_share: float = 0.2) -> Iterator[Task]:
    """Seeded, repeat-free problems owned by ``split``: ``draw(rng)`` makes one as ``(key, task)``, and a key drawn
    before or owned by the other split (``stable_split``) is drawn again. The i-th depends only on ``name`` and
    ``split``."""
    rng = random.Random(f"{name}:{split}")
    seen: set[str] = set()
    while True:
        key, task = draw(rng)
        if key not in seen and stable_split(key, test_share) == split:
            seen.add(key)
            yield task


def check_split(split: str) -> str:
    """Return ``split`` if it is a known split, else raise ValueError listing the valid ones."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; valid splits: {', '.join(map(repr, SPLITS))}")
    return split


class LazyTasks(Sequence[Task]):
    """A fixed-length task sequence whose task ``i`` is made on access by ``_task(i)`` (0 <= i < len); subclasses
    set ``_len`` and ``_name`` (for error messages). Slices and negative indices work as on a list."""

    _len: int
    _name: str

    def _task(self, i: int) -> Task:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> Task: ...
    @overload
    def __getitem__(self, i: slice) -> list[Task]: ...
    def __getitem__(self, i: int | slice) -> Task | list[Task]:
        if isinstance(i, slice):
            return [self[k] for k in range(self._len)[i]]
        if not -self._len <= i < self._len:
            raise IndexError(f"task index {i} out of range for {self._name} ({self._len} tasks)")
        return self._task(i % self._len)


class TaskList(LazyTasks):
    """A fixed-length task sequence generated on first access and cached.

    Task ``i`` is the ``i``-th item of ``source`` with ``"id": f"{prefix}-{i}"`` added, so it depends only on
    how ``source`` was seeded, never on access order.
    """

    def __init__(self, source: Iterator[Task], length: int, *, prefix: str) -> None:
        self._source, self._len, self._prefix = source, length, prefix
        self._name = repr(prefix)
        self._tasks: list[Task] = []

    def _task(self, i: int) -> Task:
        while len(self._tasks) <= i:
            self._tasks.append(next(self._source))
        return {"id": f"{self._prefix}-{i}", **self._tasks[i]}


class Splits:
    """The train and test task lists of an env whose problems are generated: ``generate(split)`` yields the
    split's problems, and each list is made on first use, ``num_train``/``num_test`` long (checked here)."""

    def __init__(self, generate: Callable[[str], Iterator[Task]], *, num_train: int, num_test: int,
                 max_size: int = 100_000) -> None:
        for name, size, low in (("num_train", num_train, 1), ("num_test", num_test, 0)):
            if not low <= size <= max_size:
                raise ValueError(f"{name} must be between {low} and {max_size}, got {size!r}")
        self._generate = generate
        self._sizes = {"train": num_train, "test": num_test}
        self._lists: dict[str, TaskList] = {}

    def __getstate__(self) -> dict[str, Any]:
        # An env's snapshot holds its Splits: the lists are remade on use, the same, rather than pickled.
        return {**vars(self), "_lists": {}}

    def __call__(self, split: str) -> TaskList:
        """The tasks of ``split`` ("train" or "test"), generated lazily and cached."""
        if check_split(split) not in self._lists:
            self._lists[split] = TaskList(self._generate(split), self._sizes[split], prefix=split)
        return self._lists[split]


def pick_task(tasks: Sequence[Task], seed: int | None, rng: random.Random) -> Task:
    """Task ``seed % len(tasks)`` (same seed, same task), or a random one when ``seed`` is None."""
    if not tasks:
        raise ValueError("cannot pick a task from an empty task list")
    return tasks[rng.randrange(len(tasks)) if seed is None else seed % len(tasks)]


def check_task(task: Any, **fields: type | tuple[type, ...]) -> Mapping[str, Any]:
    """Return ``task`` if it is a mapping whose ``fields`` have the given types, else raise InvalidTaskError.

    InvalidTaskError is a ValueError; an env server answers it with 422 ``invalid_task`` rather than an env crash.
    """
    if not isinstance(task, Mapping):
        raise InvalidTaskError(f"task must be a dict, got {type(task).__name__}: {task!r:.120}")
    for name, kind in fields.items():
        value = task.get(name)
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            value = None  # bool is an int subclass, but True is no answer
        if not isinstance(value, kind):
            raise InvalidTaskError(f"task must have a {name!r} of type {_type_names(kind)}, got {task.get(name)!r:.80}")
    return task


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def task_counts(env: Env) -> dict[str, int | None]:
    """Tasks per split (None for an unsized split); {} for an env without task lists."""
    counts: dict[str, int | None] = {}
    for split in SPLITS:
        try:
            tasks = env.tasks(split)
        except ValueError:
            continue
        if tasks is None:
            return {}
        counts[split] = len(tasks) if hasattr(tasks, "__len__") else None
    return counts
