"""The ``skyrl`` scheme: ``envkit.make("skyrl:gsm8k", tasks="rows.jsonl")``, any skyrl-gym env (the ``skyrl`` extra).

skyrl-gym makes an env per episode from a dataset row: ``prompt`` (chat messages), ``reward_spec`` (with
``ground_truth``) and ``extra_info``; ``init(prompt)`` opens it, and ``step(text)`` answers ``observations``, a
``reward`` and one ``done``. Here a task is such a row (or an envkit-style ``question``/``answer`` row), and two
joins are made right:

- a numeric ground truth is written as a string: skyrl's scorers compare the answer they extract (a string) with
  it, so ``42`` from a JSON or Parquet dataset would score every answer 0, the right one included;
- ``done`` becomes ``truncated`` when the env's turn budget (``max_turns``) ran out before a full reward (1.0), and
  ``terminated`` otherwise.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import skyrl_gym

from envkit.core import Env, StepResult, Task
from envkit.integrations import build
from envkit.messages import Message, user

SOLVED = 1.0
"""The reward skyrl-gym's envs give a solved task."""


def ground_truth(value: Any) -> Any:
    """``value`` as skyrl's string comparison needs it: a number as its shortest text (``42.0`` -> ``"42"``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def read_rows(source: str | list[Task] | None) -> list[Task]:
    """Task rows from a list, or a JSONL (one row per line), JSON (a list) or Parquet file."""
    if source is None:
        return []
    if isinstance(source, list):
        rows = source
    elif source.endswith(".parquet"):
        import pandas as pd

        rows = pd.read_parquet(source).to_dict("records")
    else:
        text = Path(source).read_text()
        rows = json.loads(text) if source.endswith(".json") else [json.loads(line) for line in text.splitlines()
                                                                   if line.strip()]
    return [{"id": str(row.get("id", f"row-{i}")), **row} for i, row in enumerate(rows)]


class SkyRLEnv(Env):
    """A skyrl-gym env: each episode makes it from a task row and plays its text protocol."""

    reward_range = (-math.inf, math.inf)  # skyrl-gym's envs declare none

    def __init__(self, env_id: str, *, tasks: str | list[Task] | None = None,
                 test_tasks: str | list[Task] | None = None,
                 env_config: dict[str, Any] | None = None, max_turns: int | None = None) -> None:
        if env_id not in skyrl_gym.registry:
            raise ValueError(f"skyrl-gym has no env {env_id!r}; it has {sorted(skyrl_gym.registry)}")
        self.env_id, self.env_config, self.max_turns = env_id, dict(env_config or {}), max_turns
        self._rows = {"train": read_rows(tasks), "test": read_rows(test_tasks)}
        self._env: Any = None
        self._rng = random.Random()

    def tasks(self, split: str = "train") -> list[Task] | None:
        """The rows given as ``tasks`` (train) and ``test_tasks`` (test); None when none were given."""
        if split not in self._rows:
            raise ValueError(f"skyrl:{self.env_id} has splits train and test, not {split!r}")
        return self._rows[split] or None

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Make the skyrl env for ``task`` (else train row ``seed % len``, else a random one) and open it."""
        if task is None:
            rows = self._rows["train"]
            if not rows:
                raise ValueError(f"skyrl:{self.env_id} plays dataset rows: give reset(task=row), or the env "
                                 "tasks=... (a JSONL, JSON or Parquet file, or a list of rows)")
            task = rows[self._rng.randrange(len(rows)) if seed is None else seed % len(rows)]
        prompt = task.get("prompt") or ([user(task["question"])] if "question" in task else None)
        spec = dict(task.get("reward_spec") or {})
        if "ground_truth" not in spec and "answer" in task:
            spec["ground_truth"] = task["answer"]
        if not prompt or "ground_truth" not in spec:
            raise ValueError("a skyrl task is a row with prompt (chat messages) and reward_spec.ground_truth, or with "
                             f"question and answer; got {task!r:.200}")
        spec["ground_truth"] = ground_truth(spec["ground_truth"])
        extras = {**{k: v for k, v in task.items() if k not in ("id", "prompt", "question", "answer")},
                  "reward_spec": spec, "extra_info": task.get("extra_info") or {}}
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        await self.close()
        self._env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=extras)
        messages, metadata = await asyncio.to_thread(self._env.init, [dict(m) for m in prompt])
        return list(messages), {"metadata": metadata or {}}

    async def step(self, action: Message) -> StepResult:
        """Send the reply's text; skyrl's one ``done`` is split into terminated and truncated."""
        out = await asyncio.to_thread(self._env.step, action.get("content") or "")
        reward, done = float(out["reward"]), bool(out["done"])
        budget_spent = getattr(self._env, "turns", 0) >= getattr(self._env, "max_turns", math.inf)
        truncated = done and budget_spent and reward < SOLVED
        return StepResult(list(out.get("observations") or []), reward=reward, terminated=done and not truncated,
                          truncated=truncated, info={"metadata": out.get("metadata") or {}})

    async def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            await asyncio.to_thread(env.close)

    def spaces(self) -> dict[str, Any]:
        return {"observation": f"skyrl-gym {self.env_id}: the row's prompt, then the env's observations",
                "action": "the reply's text"}


def make_skyrl(name: str, **kwargs: Any) -> SkyRLEnv:
    """The ``skyrl`` scheme of ``envkit.make``: ``skyrl:<skyrl-gym env id>``."""
    return build(name, SkyRLEnv, kwargs)
