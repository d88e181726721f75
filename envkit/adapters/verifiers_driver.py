"""Serves one verifiers environment over stdin/stdout, run by ``envkit.adapters.verifiers`` with the Python of a venv
that has verifiers (its pins clash with envkit's, so it is never imported into envkit's process).

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
import json
import math
import sys
import traceback
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


class Server:
    """Answers the requests on stdin; ``run`` requests concurrently."""

    def __init__(self, env: Any, holdout: float, out: Any) -> None:
        self.env, self.holdout, self.out = env, holdout, out
        self.running: dict[Any, asyncio.Task] = {}

    def answer(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()

    async def handle(self, request: dict[str, Any]) -> None:
        rid = request.get("id")
        try:
            if request["op"] == "tasks":
                result: Any = tasks(self.env, self.holdout)
            elif request["op"] == "run":
                result = await run(self.env, request["task"], request["client"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            self.answer({"id": rid, "result": result})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the env's failure is this request's answer; the server goes on
            traceback.print_exc(file=sys.stderr)
            self.answer({"id": rid, "error": f"{type(e).__name__}: {e}"})
        finally:
            self.running.pop(rid, None)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            request = json.loads(line)
            if request.get("op") == "cancel":
                if (task := self.running.get(request.get("id"))) is not None:
                    task.cancel()
                continue
            self.running[request.get("id")] = asyncio.ensure_future(self.handle(request))
        for task in list(self.running.values()):
            task.cancel()


def main() -> None:
    env_id, env_args, holdout = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    out, sys.stdout = sys.stdout, sys.stderr  # what the env prints must not corrupt the answers
    import verifiers as vf

    server = Server(vf.load_environment(env_id, **env_args), holdout, out)
    server.answer({"id": None, "result": {"ready": type(server.env).__name__}})
    asyncio.run(server.serve())


if __name__ == "__main__":
    main()
