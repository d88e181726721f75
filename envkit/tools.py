"""Tools as OpenAI function schemas, and tool calls parsed from model text.

A :class:`Tool` is a name, a description and a JSON-schema ``parameters`` object; ``to_openai()`` gives the
``{"type": "function", "function": {...}}`` dict that chat APIs and chat templates take. ``Tool.from_function``
builds one from a typed Python function. Models that do not emit native ``tool_calls`` write
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in their text; ``parse_tool_calls`` reads that.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from envkit.messages import Message, ToolCall

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


ToolStatus = Literal["ok", "error", "timeout"]
"""How a tool call went: it ran, it failed (the model's mistake or the tool's), or it ran out of time."""


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """What a tool may return instead of plain text: the text the model reads, how the call went, and details for
    the run's metrics (``{"sandbox": "docker"}``). :class:`envkit.ToolEnv` reports ``status`` and ``info`` in
    ``StepResult.info["tool_results"]``; ``envkit serve --mcp`` answers a status other than ok with ``isError``."""

    text: str
    status: ToolStatus = "ok"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: ``parameters`` is a JSON-schema object describing its arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools=[...]`` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @classmethod
    def from_openai(cls, schema: dict[str, Any]) -> Tool:
        """The tool an OpenAI ``tools=[...]`` entry describes (no ``fn``: it runs where the env does)."""
        function = schema["function"]
        return cls(name=function["name"], description=function.get("description", ""),
                   parameters=function.get("parameters", {}))

    def validate_arguments(self, arguments: Any) -> str | None:
        """Return an error message if ``arguments`` do not fit the schema's top level, else None."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        props: dict[str, Any] = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing required argument(s): {', '.join(missing)}"
        unknown = [k for k in arguments if k not in props]
        if unknown and self.parameters.get("additionalProperties", False) is False:
            return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props) or 'none'}"
        for key, value in arguments.items():
            expected = props.get(key, {}).get("type")
            if expected and not _matches_json_type(value, expected):
                return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
        return None

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """Build a Tool from a typed function; its docstring's first line is the description.

        Parameters documented in a Google-style ``Args:`` section get those descriptions in the schema.
        """
        doc = inspect.getdoc(fn) or ""
        arg_docs = _documented_args(doc)
        hints = typing.get_type_hints(fn)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for pname, param in inspect.signature(fn).parameters.items():
            if pname in ("self", "cls"):
                continue
            schema = _schema_for(hints.get(pname, str))
            if pname in arg_docs:
                schema["description"] = arg_docs[pname].strip()
            properties[pname] = schema
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return cls(name=name or fn.__name__, description=doc.split("\n", 1)[0], parameters=parameters, fn=fn)


def tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method of a :class:`envkit.ToolEnv` subclass as a tool the model may call."""
    fn.__envkit_tool__ = Tool.from_function(fn)  # type: ignore[attr-defined]
    return fn


def _documented_args(doc: str) -> dict[str, str]:
    if "Args:" not in doc:
        return {}
    section = doc.split("Args:", 1)[1]
    return dict(re.findall(r"^\s*(\w+)(?:\s*\(.*?\))?:\s*(.+)$", section, re.MULTILINE))


def _schema_for(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        return {"type": "array", "items": _schema_for(args[0])} if args else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _schema_for(options[0]) if len(options) == 1 else {"anyOf": [_schema_for(a) for a in options]}
    return {"type": "string"}


def _matches_json_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    checks: dict[str, type | tuple[type, ...]] = {
        "string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)
    }
    return expected not in checks or isinstance(value, checks[expected])


def parse_tool_calls(text: str | None) -> tuple[list[ToolCall], list[str]]:
    """Read ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks from model text.

    Returns ``(calls, errors)``: well-formed calls as OpenAI ToolCall dicts (ids ``call_0``, ``call_1``, ...),
    and one readable error per malformed block, so an env can tell the model what to fix.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, raw in enumerate(_TOOL_CALL_RE.findall(text or "")):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {i} is not valid JSON ({e.msg} at char {e.pos}): {raw[:120]}")
            continue
        except RecursionError:
            errors.append(f"tool call {i} is nested too deeply to read: {raw[:120]}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f'tool call {i} must be an object like {{"name": "...", "arguments": {{...}}}}')
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                errors.append(f"tool call {i}: arguments is a string that is not a JSON object")
                continue
        calls.append(
            {"id": f"call_{i}", "type": "function", "function": {"name": obj["name"], "arguments": json.dumps(args)}}
        )
    return calls, errors


def tool_calls_of(message: Message) -> tuple[list[ToolCall], list[str]]:
    """The tool calls of an assistant message and the errors of malformed ones: its ``tool_calls`` and
    ``tool_call_errors`` when it has either (the reader of the model's text already parsed it), else the
    ``<tool_call>`` blocks of its text."""
    native = message.get("tool_calls")
    errors = message.get("tool_call_errors")
    if native or errors:
        return list(native or []), list(errors or [])
    return parse_tool_calls(message.get("content"))
