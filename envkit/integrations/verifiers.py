"""The ``verifiers`` scheme: ``envkit.make("verifiers:ENV_ID", env_args={...})``, a verifiers environment package.

verifiers (Prime Intellect's env library) pins versions envkit's venv cannot take (``openai<3``, ``mcp<2``), so the
env runs in a Python of its own: ``python=``, else ``$ENVKIT_VERIFIERS_PYTHON``, else this interpreter if it has
verifiers (``make verifiers`` builds ``.venv-verifiers`` with verifiers 0.2.1). One driver process there
(:mod:`envkit.integrations.verifiers_driver`) serves every episode of the env in this event loop:

- the env's dataset is the train split and its eval dataset the test split (an env without one keeps the last
  ``holdout`` of its rows for the test split, out of the train split, so the two are disjoint);
- each episode is the env's own rollout loop (single-turn, multi-turn or tools, as the env defines it), calling the
  policy through the generator's capture gateway, which records the exact tokens; its rubric's reward is the
  episode's reward.

Works with verifiers' classic API (``load_environment(**env_args)`` returning a ``vf.Environment``): 0.2.x.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from envkit.agents.agent import AgentClient, AgentEnv
from envkit.agents.process import HostProcess, host_process
from envkit.core import Env, Task
from envkit.errors import AgentProcessError, EnvLoadError
from envkit.integrations import build
from envkit.messages import Message

DRIVER = Path(__file__).with_name("verifiers_driver.py")
PYTHON_ENV = "ENVKIT_VERIFIERS_PYTHON"
"""The variable naming the interpreter that has verifiers installed."""
LOAD_TIMEOUT_S = 300.0
"""Importing verifiers and building a dataset: seconds."""
_tasks: dict[tuple, dict[str, list[Task]]] = {}
"""Task lists by driver key: every env instance of one spec shares one listing."""


def verifiers_python(python: str | None = None) -> str:
    """The interpreter that runs verifiers: ``python``, ``$ENVKIT_VERIFIERS_PYTHON``, or this one if it has it."""
    if python or (python := os.environ.get(PYTHON_ENV)):
        if not Path(python).exists():
            raise EnvLoadError(f"the verifiers Python {python!r} does not exist (`make verifiers` builds "
                               ".venv-verifiers/bin/python)")
        return python
    if importlib.util.find_spec("verifiers") is not None:
        return sys.executable
    raise EnvLoadError(f"verifiers:ENV_ID runs verifiers in a Python of its own (its pins clash with envkit's): "
                       f"`make verifiers` builds .venv-verifiers; point ${PYTHON_ENV} (or python=) at its "
                       "bin/python, with the env package installed there")


def _driver(argv: list[str]) -> HostProcess:
    """This event loop's driver process for the env spec ``argv``."""
    return host_process(argv, "the verifiers driver")


class VerifiersEnv(AgentEnv):
    """A verifiers environment: its own rollout loop plays each episode through the capture gateway; its rubric
    scores it."""

    def __init__(self, env_id: str, *, env_args: dict[str, Any] | None = None, python: str | None = None,
                 holdout: float = 0.2, timeout_s: float = 600.0) -> None:
        super().__init__()
        if not 0 <= holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {holdout}")
        self.env_id = env_id
        self.timeout_s = timeout_s
        env_args = dict(env_args or {})
        self._argv = [verifiers_python(python), "-P", str(DRIVER), env_id, json.dumps(env_args, sort_keys=True),
                      repr(holdout)]
        self._key = tuple(self._argv)

    def tasks(self, split: str = "train") -> list[Task] | None:
        """The env's rows for ``split`` (``train`` or ``test``), listed once per env spec."""
        if self._key not in _tasks:
            _tasks[self._key] = self._list_tasks()
        return _tasks[self._key].get(split)

    def _list_tasks(self) -> dict[str, list[Task]]:
        try:
            done = subprocess.run(self._argv, input=b'{"id": 1, "op": "tasks"}\n', capture_output=True,
                                  timeout=LOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise EnvLoadError(f"verifiers:{self.env_id} did not list its tasks in {LOAD_TIMEOUT_S:g} s") from e
        answers = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        listing = [a for a in answers if a.get("id") == 1]
        if done.returncode != 0 or not listing or "error" in listing[0]:
            why = listing[0]["error"] if listing and "error" in listing[0] else done.stderr.decode(errors="replace")
            raise EnvLoadError(f"verifiers:{self.env_id} failed to load: {why.strip()[-1500:]}")
        return listing[0]["result"]

    async def init(self) -> None:
        """List the tasks (once per env spec) before the first episode."""
        if self._key not in _tasks:  # from the driver the episodes use: the env loads once in this process
            try:
                _tasks[self._key] = await _driver(self._argv).request({"op": "tasks"}, LOAD_TIMEOUT_S,
                                                                       "listing its tasks")
            except AgentProcessError as e:
                raise EnvLoadError(f"verifiers:{self.env_id} failed to load: {e}") from e
        self._tasks = _tasks[self._key]

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """Pick the episode's task; its prompt (the env's chat messages) is the opening observation."""
        await self.init()
        _, info = await super().reset(seed=seed, task=task)
        prompt = info["task"].get("prompt")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return messages, info

    async def run(self, client: AgentClient) -> dict[str, Any]:
        """One rollout of the env's own loop against ``client``; its result carries the rubric's reward."""
        task = self._current()
        failed = f"verifiers:{self.env_id} rollout of task {task.get('id')!r} failed"
        result = await _driver(self._argv).request(
            {"op": "run", "task": task, "client": {"base_url": client.base_url, "api_key": client.api_key,
                                                   "model": client.model}}, self.timeout_s, failed)
        if result["error"]:
            raise AgentProcessError(f"{failed}: {result['error']}")
        return result

    async def grade(self, result: dict[str, Any]) -> float:
        """The env's rubric's reward for the episode."""
        return float(result["reward"])


def make_verifiers(name: str, **kwargs: Any) -> Env:
    """``verifiers:ENV_ID``: the verifiers environment package ENV_ID (``env_args=`` go to its
    ``load_environment``)."""
    return build(name, VerifiersEnv, kwargs)
