"""ToolEnv: the multi-turn pattern "call tools until you answer", so a tool env is only its tools and its grader.

Each assistant turn either calls tools (native ``tool_calls``, or ``<tool_call>`` text; a generator that read
calls in another format passes them as ``tool_calls`` and ``tool_call_errors``) and gets ``tool`` messages back,
or gives a final answer that ``grade`` scores and that ends the episode. ``max_turns`` bounds the episode
(``truncated=True``, reward 0 when it runs out). A tool-calling step reports each call in
``info["tool_results"]``: ``{"name", "status": "ok"|"error"|"timeout", ...}`` plus what the tool added through
:class:`envkit.ToolOutput`, which is what the generator counts in a rollout's tool metrics.
"""

from __future__ import annotations

import abc
import inspect
import json
import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from envkit.core import Env, StepResult, Task
from envkit.errors import EnvkitError, ResetNeededError, ToolCallError, ToolTimeoutError
from envkit.messages import Message, ToolCall, system, tool_result, user
from envkit.parsing import grade_number
from envkit.tasks import check_task, pick_task
from envkit.tools import Tool, ToolOutput, tool_calls_of


class ToolEnv(Env):
    """Base class for tool-using envs. Subclasses mark methods with ``@envkit.tool`` and implement
    ``start_episode`` and ``grade``."""

    max_turns: int = 8
    tools: ClassVar[list[Tool]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, Tool] = {}
        for klass in reversed(cls.__mro__):  # subclasses override inherited tools of the same name
            for attr in vars(klass).values():
                spec = getattr(attr, "__envkit_tool__", None)
                if spec is not None:
                    found[spec.name] = spec
        cls.tools = list(found.values())

    def __init__(self, *, max_turns: int | None = None) -> None:
        if max_turns is not None:
            if max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {max_turns}")
            self.max_turns = max_turns
        self.turn = 0

    @abc.abstractmethod
    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[Message], dict]:
        """Return the opening messages and info for a new episode (same seed/task ⇒ same start)."""

    @abc.abstractmethod
    async def grade(self, answer: str) -> tuple[float, dict[str, Any]]:
        """Score the model's final answer: ``(reward, info)``."""

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        self.turn = 0
        return await self.start_episode(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        self.turn += 1
        calls, errors = tool_calls_of(action)
        if not calls and not errors:
            reward, info = await self.grade(action.get("content") or "")
            return StepResult([], reward=reward, terminated=True, info={"turn": self.turn, **info})
        answered = [await self._answer(c) for c in calls]
        observation = [message for message, _ in answered]
        if errors:
            # errors read in the model's own format (tool_call_errors) say what that format wants; our own reading
            # of the text is the <tool_call> form
            fix = "" if action.get("tool_call_errors") else (
                ' Write tool calls as <tool_call>{"name": "...", "arguments": {...}}</tool_call>.')
            observation.append(user("Malformed tool call: " + "; ".join(errors) + fix))
        truncated = self.turn >= self.max_turns
        info = {"turn": self.turn, "tool_calls": len(calls), "tool_call_errors": len(errors),
                "tool_results": [result for _, result in answered]}
        return StepResult(observation, truncated=truncated, info=info)

    async def call_tool(self, call: ToolCall) -> Message:
        """Run one tool call and return its ``tool`` message; model mistakes become error text, not exceptions
        (an :class:`EnvkitError`, a failure of the env's own machinery, propagates and fails the rollout)."""
        message, _ = await self._answer(call)
        return message

    async def _answer(self, call: ToolCall) -> tuple[Message, dict[str, Any]]:
        """The ``tool`` message answering ``call`` and its entry in ``info["tool_results"]``."""
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"].get("arguments") or "{}")
        except json.JSONDecodeError as e:
            out = ToolOutput(f"Error: arguments are not valid JSON: {e.msg}", "error")
        else:
            out = await self._output(name, args)
        return tool_result(out.text, call["id"], name), {"name": name, "status": out.status, **out.info}

    async def _output(self, name: str, arguments: Any) -> ToolOutput:
        try:
            out = await self.run_tool(name, arguments)
        except ToolTimeoutError as e:
            return ToolOutput(f"Error: {e}", "timeout")
        except ToolCallError as e:
            return ToolOutput(f"Error: {e}", "error")
        return out if isinstance(out, ToolOutput) else ToolOutput(out)

    async def run_tool(self, name: str, arguments: Any) -> str | ToolOutput:
        """Run tool ``name`` with ``arguments`` (decoded JSON) and return its text (JSON for results that are neither
        text nor a :class:`ToolOutput`).

        Raises :class:`ToolCallError` for the model's mistakes: an unknown tool, arguments that do not fit its
        schema, a tool that raised (:class:`ToolTimeoutError` for one that ran out of time). Override it to run
        tools elsewhere (an MCP server, a sandbox).
        """
        by_name = {t.name: t for t in self.tools}
        if name not in by_name:
            raise ToolCallError(f"unknown tool {name!r}. Available: {', '.join(by_name)}.")
        spec = by_name[name]
        problem = spec.validate_arguments(arguments)
        if problem:
            raise ToolCallError(problem)
        assert spec.fn is not None  # every ToolEnv tool comes from @tool, which sets fn
        try:
            out = spec.fn(self, **arguments)
            if inspect.isawaitable(out):
                out = await out
        except EnvkitError:  # infrastructure (a sandbox, a server) failed, not the model: the rollout fails
            raise
        except Exception as e:  # the tool's failure is the model's feedback, not the env's crash
            raise ToolCallError(f"{type(e).__name__}: {e}") from e
        return out if isinstance(out, str | ToolOutput) else json.dumps(out)


class NumberQuestions:
    """Episodes of a :class:`ToolEnv` whose tasks ask a ``question`` with a number for ``answer``: the episode opens
    with the env's ``system_prompt`` and the question (a task of :meth:`tasks`' train split, by seed, where none is
    given), and the final answer is graded as a number (:func:`~envkit.parsing.grade_number`). Mix in before
    ``ToolEnv``; set ``answer_types`` to the numbers a given task's answer may be."""

    answer_types: ClassVar[type | tuple[type, ...]] = (int, float)
    system_prompt: str
    tasks: Callable[[str], Sequence[Task] | None]
    _rng: random.Random
    _task: Task | None

    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[Message], dict]:
        """Open the episode on ``task``, else on a train task picked by ``seed``."""
        if task is not None:
            check_task(task, question=str, answer=self.answer_types)
        else:
            task = pick_task(self.tasks("train") or [], seed, self._rng)
        self._task = task
        return [system(self.system_prompt), user(task["question"])], {"task": task}

    async def grade(self, answer: str) -> tuple[float, dict[str, Any]]:
        """1.0 when ``answer``'s final number is the task's, with what was read."""
        if self._task is None:
            raise ResetNeededError("step() needs an active episode; call reset() first.")
        info = grade_number(answer, self._task["answer"])
        info.pop("explicit")
        return float(info["correct"]), info
