"""Chat messages in OpenAI format: the observations and actions of every envkit env.

A message is a plain dict (JSON round-trips for free): ``{"role": ..., "content": ...}`` plus ``tool_calls`` on
assistant messages and ``tool_call_id``/``name`` on tool results. An assistant message read from a model's text may
also carry its reasoning (``reasoning_content``) and the errors of tool calls it wrote malformed
(``tool_call_errors``). The TypedDicts below document the shape; the constructors build well-formed ones.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from envkit.errors import InvalidActionError

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(TypedDict):
    """The function part of a tool call; ``arguments`` is a JSON-encoded string as in the OpenAI API."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One tool call made by the assistant."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(TypedDict):
    """One chat message."""

    role: Role
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]
    reasoning_content: NotRequired[str]
    """The model's reasoning (its ``<think>`` text), kept out of ``content``; the key vLLM's OpenAI server uses."""
    tool_call_errors: NotRequired[list[str]]
    """Set by whoever read tool calls from the model's text (a generator, in the model's own format): one readable
    error per malformed call, for the env to report to the model (``ToolEnv`` does)."""


def system(content: str) -> Message:
    """A system message."""
    return {"role": "system", "content": content}


def user(content: str) -> Message:
    """A user message (what most envs use for observations)."""
    return {"role": "user", "content": content}


def assistant(content: str | None, tool_calls: list[ToolCall] | None = None) -> Message:
    """An assistant message (the action type), optionally carrying tool calls."""
    msg: Message = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def tool_result(content: str, tool_call_id: str, name: str | None = None) -> Message:
    """A tool message answering the tool call ``tool_call_id``."""
    msg: Message = {"role": "tool", "content": content, "tool_call_id": tool_call_id}
    if name is not None:
        msg["name"] = name
    return msg


def validate_action(action: Any) -> Message:
    """Return ``action`` if it is a well-formed assistant message, else raise InvalidActionError."""
    if not isinstance(action, dict):
        raise InvalidActionError(
            f"An action must be an assistant message dict like {{'role': 'assistant', 'content': '...'}}, "
            f"got {type(action).__name__}: {action!r:.80}"
        )
    role = action.get("role")
    if role != "assistant":
        raise InvalidActionError(f"An action must have role 'assistant', got role={role!r}.")
    content = action.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidActionError(f"Action content must be a string or None, got {type(content).__name__}.")
    tool_calls = action.get("tool_calls")
    if tool_calls is not None:
        _validate_tool_calls(tool_calls)
    reasoning = action.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise InvalidActionError(f"Action reasoning_content must be a string, got {type(reasoning).__name__}.")
    errors = action.get("tool_call_errors")
    if errors is not None and not (isinstance(errors, list) and all(isinstance(e, str) for e in errors)):
        raise InvalidActionError(f"Action tool_call_errors must be a list of strings, got {errors!r:.120}")
    if content is None and not tool_calls:
        raise InvalidActionError("An assistant action needs content or tool_calls; both are empty.")
    return action  # type: ignore[return-value]


def _validate_tool_calls(tool_calls: Any) -> None:
    """Raise InvalidActionError unless ``tool_calls`` is a list of function calls, each with a string name."""
    if not isinstance(tool_calls, list):
        raise InvalidActionError(f"Action tool_calls must be a list, got {type(tool_calls).__name__}.")
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidActionError(
                f"tool_calls[{i}] must look like {{'id': ..., 'type': 'function', "
                f"'function': {{'name': str, 'arguments': str}}}}, got {call!r:.120}"
            )


def is_message(obj: Any) -> bool:
    """True when ``obj`` looks like a chat message (a dict with a known role and string-or-None content)."""
    return (
        isinstance(obj, dict)
        and obj.get("role") in ("system", "user", "assistant", "tool")
        and (obj.get("content") is None or isinstance(obj.get("content"), str))
    )
