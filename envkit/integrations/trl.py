"""Any envkit env in TRL's ``GRPOTrainer``: its ``environment_factory``, a reward function and a dataset (no trl
import here: TRL reads the classes by duck typing)::

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    import envkit.integrations.trl

    trainer = GRPOTrainer(
        model=..., args=GRPOConfig(...),
        environment_factory=envkit.integrations.trl.environment_factory("calculator"),
        reward_funcs=envkit.integrations.trl.reward,
        train_dataset=Dataset.from_list(envkit.integrations.trl.dataset("calculator", "train", n=256)),
    )

How the two protocols meet:

- A dataset row carries the env's opening messages as ``prompt`` and the task it came from as ``envkit_task``
  (JSON). TRL calls ``reset(**row)`` on one instance per rollout; the env restarts on that task and must open with
  the row's prompt (an env whose opening drifted from its dataset is an error, not silently other data).
- Each of the env's tools is a method, with the signature and docstring TRL turns back into the same function
  schema. A call TRL parses from the model steps the env with that tool call; the tool's output is the answer.
- TRL ends a rollout when the model writes no tool call and never shows that last reply to an environment, so
  :func:`reward` does: it steps each env with its rollout's final reply and returns what the episode earned (the sum
  of its step rewards). An episode that ran out of turns earned what it had.

Each instance runs its env on a private event loop (:class:`envkit.SyncEnv`), as TRL calls ``reset``, the tools
and the reward function from its own thread; the env is closed when the instance is collected or at exit.
"""

from __future__ import annotations

import inspect
import json
import keyword
import weakref
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from envkit.core import StepResult, Task
from envkit.messages import Message, ToolCall, assistant
from envkit.registry import make
from envkit.sync import SyncEnv
from envkit.tools import Tool

TASK_COLUMN = "envkit_task"
"""The dataset column that holds a row's task, as JSON."""
_PY_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
                              "object": dict}
_RESERVED = {"reset", "get_reward"}  # TRL calls these itself: a tool may not take their names


class TRLEnvironment:
    """One rollout's env, as TRL's ``environment_factory`` hands it out: ``reset`` from a dataset row and one
    method per tool of the env (subclasses made by :func:`environment_factory` add them)."""

    def __init__(self, env: SyncEnv) -> None:
        self._env = env
        self._closer = weakref.finalize(self, env.close)  # TRL never closes what its factory made
        self._calls = 0
        self.episode_return = 0.0
        """What the current episode has earned: the sum of its step rewards."""
        self.done = False
        """Whether the current episode has ended (answered, or out of turns)."""

    def reset(self, prompt: list[dict[str, Any]] | None = None, envkit_task: str | None = None,
              **_columns: Any) -> str | None:
        """Start the row's task. With the row's ``prompt`` as the opening, return None (TRL prompts with the row);
        without one, return the opening's text for TRL to append to its prompt."""
        if envkit_task is None:
            raise ValueError(f"a dataset row for envkit.integrations.trl needs its {TASK_COLUMN!r} column "
                             "(envkit.integrations.trl.dataset writes it)")
        messages, _ = self._env.reset(task=json.loads(envkit_task))
        self._calls, self.episode_return, self.done = 0, 0.0, False
        if prompt is None:
            return "\n\n".join(m["content"] for m in messages if m.get("content"))
        if _turns(prompt) != _turns(messages):
            raise ValueError(f"the env opened task {envkit_task:.120} with {_turns(messages)!r:.300}, not the row's "
                             f"prompt {_turns(prompt)!r:.300}: rebuild the dataset with "
                             "envkit.integrations.trl.dataset")
        return None

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Step the env with one call of ``name`` and return what the env answered."""
        if self.done:
            return "Error: the episode is over; no more tool calls."
        self._calls += 1
        call: ToolCall = {"id": f"call_{self._calls}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments)}}
        result = self._record(self._env.step(assistant(None, [call])))
        text = "\n".join(m["content"] for m in result.observation if m.get("content"))
        return text + ("\n(The episode is over.)" if result.done else "")

    def _finish(self, reply: str) -> float:
        """Step the env with the rollout's final reply unless the episode already ended; the episode's return."""
        if not self.done:
            self._record(self._env.step(assistant(reply)))
        return self.episode_return

    def _record(self, result: StepResult) -> StepResult:
        self.episode_return += result.reward
        self.done = result.done
        return result


def environment_factory(name: str, **kwargs: Any) -> Callable[[], TRLEnvironment]:
    """TRL's ``environment_factory`` for env ``name`` (made with ``kwargs``): each call makes one instance."""
    classes: dict[str, type[TRLEnvironment]] = {}

    def factory() -> TRLEnvironment:
        env = SyncEnv(make(name, **kwargs))
        env.init()  # some envs (MCP, remote) know their tools only once started
        tools = list(env.tools)
        key = json.dumps([t.to_openai() for t in tools], sort_keys=True)
        if key not in classes:
            classes[key] = _with_tools(name, tools)
        return classes[key](env)

    factory.__name__ = factory.__qualname__ = f"environment_factory({name!r})"
    return factory


def reward(completions: list[Any], environments: list[TRLEnvironment] | None = None, **_: Any) -> list[float]:
    """TRL reward function: each rollout's episode return, its final reply stepped into its env first."""
    if environments is None:
        raise ValueError("envkit.integrations.trl.reward scores envs: pass "
                         "environment_factory=envkit.integrations.trl.environment_factory(...) to GRPOTrainer")
    out = []
    for completion, env in zip(completions, environments, strict=True):
        if not isinstance(env, TRLEnvironment):
            raise TypeError("envkit.integrations.trl.reward scores envkit.integrations.trl environments, got "
                            f"{type(env).__name__}")
        out.append(env._finish(_final_reply(completion)))
    return out


def dataset(name: str, split: str = "train", *, n: int | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Rows for TRL (``datasets.Dataset.from_list``): the first ``n`` tasks of ``split``, each as its opening
    messages (``prompt``) and the task (``envkit_task``, JSON)."""
    env = SyncEnv(make(name, **kwargs))
    try:
        tasks = env.tasks(split)
        if tasks is None:
            raise ValueError(f"{name} does not list its tasks (Env.tasks returns None), so it has no dataset; "
                             f"write rows {{'prompt': ..., {TASK_COLUMN!r}: json.dumps(task)}} yourself")
        rows = []
        for task in _limited(tasks, n):
            messages, _ = env.reset(task=task)
            rows.append({"prompt": _turns(messages), TASK_COLUMN: json.dumps(task)})
        return rows
    finally:
        env.close()


def _limited(tasks: Any, n: int | None) -> Iterator[Task]:
    return iter(tasks) if n is None else islice(tasks, n)


def _turns(messages: list[Message] | list[dict[str, Any]]) -> list[dict[str, str]]:
    """Role and text of each message (a dataset round trip adds empty fields to the rows' messages)."""
    return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]


def _final_reply(completion: Any) -> str:
    """The text of a rollout's last assistant message (TRL passes messages for chat prompts, text otherwise)."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "") if replies else ""


def _with_tools(name: str, tools: list[Tool]) -> type[TRLEnvironment]:
    """A :class:`TRLEnvironment` subclass with one method per tool."""
    methods = {}
    for spec in tools:
        if spec.name in _RESERVED or not spec.name.isidentifier() or keyword.iskeyword(spec.name):
            raise ValueError(f"{name}'s tool {spec.name!r} cannot be a TRL environment method: TRL calls tools by "
                             "method name, which must be an identifier other than reset and get_reward")
        methods[spec.name] = _method(spec)
    return type(f"TRLEnvironment[{name}]", (TRLEnvironment,), methods)


def _method(spec: Tool) -> Callable[..., str]:
    """A method that TRL (``transformers.utils.get_json_schema``) reads back as ``spec``'s function schema."""
    properties: dict[str, Any] = spec.parameters.get("properties", {})
    required = set(spec.parameters.get("required", []))
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    documented = []
    for arg, schema in properties.items():
        if not arg.isidentifier() or keyword.iskeyword(arg):
            raise ValueError(f"tool {spec.name!r}'s argument {arg!r} is not a Python identifier, which TRL needs")
        annotations[arg] = _PY_TYPES.get(schema.get("type"), Any)
        default = inspect.Parameter.empty if arg in required else None
        parameters.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotations[arg]))
        choices = f" (choices: {json.dumps(schema['enum'])})" if "enum" in schema else ""
        documented.append(f"    {arg}: {' '.join((schema.get('description') or arg).split())}{choices}")

    def call(self: TRLEnvironment, **arguments: Any) -> str:
        return self._call_tool(spec.name, {k: v for k, v in arguments.items() if v is not None or k in required})

    call.__name__ = call.__qualname__ = spec.name
    call.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    call.__annotations__ = {**annotations, "return": str}
    description = " ".join((spec.description or spec.name).split())
    call.__doc__ = description + ("\n\nArgs:\n" + "\n".join(documented) if documented else "")
    return call
