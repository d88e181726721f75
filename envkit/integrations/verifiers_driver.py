"""Serves one verifiers environment over stdin/stdout, run by ``envkit.integrations.verifiers`` with the Python of a
venv that has verifiers (its pins clash with envkit's, so it is never imported into envkit's process).

``python verifiers_driver.py ENV_ID ENV_ARGS_JSON HOLDOUT``, then one JSON request a line on stdin and one JSON
answer a line on stdout (anything else the env prints goes to stderr):

- ``{"id": 1, "op": "tasks"}`` -> ``{"id": 1, "result": {"train": [...], "test": [...]}}``: the env's dataset and eval
  dataset as envkit tasks (``id``, ``prompt``, ``answer``, ``info``, ``example_id``); an env without an eval dataset
  keeps the last ``HOLDOUT`` of its rows for the test split, out of the train split;
- ``{"id": 2, "op": "run", "task": {...}, "client": {"base_url", "api_key", "model"}}`` -> ``{"id": 2, "result":
  {"reward", "metrics", "stop_condition", "is_truncated", "error"}}``: one rollout of the env's own loop (single-turn,
  multi-turn, tools) against that OpenAI endpoint, scored by its rubric; requests run concurrently;
- ``{"id": 2, "op": "cancel"}`` stops request 2 (no answer).

A request that fails answers ``{"id": N, "error": "..."}``. Works with verifiers' classic API (``load_environment``
returning a ``vf.Environment``, ``run_rollout``): 0.2.x.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

TASK_FIELDS = ("prompt", "answer", "info", "task")


def _rows(dataset: Any, split: str) -> list[dict[str, Any]]:
    rows = []
    for i, row in enumerate(dataset):
        example_id = row.get("example_id", i)
        task = {"id": f"{split}-{example_id}", "example_id": example_id}
        task.update({k: row[k] for k in TASK_FIELDS if row.get(k) is not None})
        rows.append(task)
    return rows


def tasks(env: Any, holdout: float) -> dict[str, list[dict[str, Any]]]:
    """The env's rows as task lists; without an eval dataset, the last ``holdout`` of its rows are the test split."""
    train = _rows(env.get_dataset(), "train")
    if env.build_eval_dataset() is not None:
        return {"train": train, "test": _rows(env.get_eval_dataset(), "test")}
    cut = len(train) - math.ceil(len(train) * holdout) if holdout > 0 else len(train)
    return {"train": train[:cut], "test": [{**t, "id": "test-" + t["id"].removeprefix("train-")} for t in train[cut:]]}


async def run(env: Any, task: dict[str, Any], client: dict[str, str]) -> dict[str, Any]:
    """One rollout of ``task`` against ``client``, scored by the env's rubric."""
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    rollout_input = {"prompt": task["prompt"], "example_id": task["example_id"]}
    rollout_input.update({k: task[k] for k in ("answer", "info", "task") if k in task})
    llm = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    try:
        output = await env.run_rollout(rollout_input, OpenAIChatCompletionsClient(llm), client["model"], {})
    finally:
        await llm.close()
    error = output.get("error")
    return {"reward": float(output.get("reward") or 0.0), "metrics": dict(output.get("metrics") or {}),
            "stop_condition": output.get("stop_condition"), "is_truncated": bool(output.get("is_truncated")),
            "error": None if error is None else str(error)}


def line_server() -> Any:
    """envkit's :mod:`envkit.agents.line_server`, loaded by its path: this Python has no envkit."""
    path = Path(__file__).resolve().parent.parent / "agents" / "line_server.py"
    spec = importlib.util.spec_from_file_location("envkit_line_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    env_id, env_args, holdout = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    serving = line_server()
    out = serving.stdout_for_answers()
    import verifiers as vf

    env = vf.load_environment(env_id, **env_args)

    async def list_tasks(request: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        return tasks(env, holdout)

    async def rollout(request: dict[str, Any]) -> dict[str, Any]:
        return await run(env, request["task"], request["client"])

    server = serving.Server({"tasks": list_tasks, "run": rollout}, out)
    server.answer({"id": None, "result": {"ready": type(env).__name__}})
    asyncio.run(server.serve())


if __name__ == "__main__":
    main()
