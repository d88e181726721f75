"""Tool prompts: the tools and how to call them, written into the system message where the chat template has none.

A model learns to call tools from its chat template. The templates of Qwen, Llama, Mistral and Hermes render
``tools=`` into the prompt; SmolLM2's, DeepSeek-R1's and many others drop it, so the model is never told what it may
call. For those the generator writes the tool schemas, and how to call them in the format the configured tool parser
reads, at the end of the system message (``generator.tool_prompt``):

    auto      write them when the template drops tools=, else leave them to the template (the default)
    template  always pass tools= to the template, whatever it does with them
    inject    always write them into the system message (tools= is then not passed to the template)
    none      neither: the env's own prompt must say what to call

The prompt and the parser are one choice: each format's example call is written by :func:`write_calls` and read back
by the parser of the same name (tested), and :func:`write_calls` also writes a demonstration's or a chat dataset's
``tool_calls`` as the model is taught to write them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envkit import Message, ToolCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # `envkit eval --help` must not pay for transformers

TOOL_PROMPT_CHOICES = ("auto", "template", "inject", "none")
ToolSchemas = list[dict[str, Any]]

_PROBE = "envkit_tool_probe_7f3a"


def template_renders_tools(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> bool:
    """Whether the chat template (the tokenizer's, or ``chat_template``) writes ``tools=`` into the prompt: a probe
    tool's name appears in a rendered chat. A template that refuses ``tools=`` does not render them."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        text = tokenizer.apply_chat_template(chat, tools=probe, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # jinja raising on tools it does not expect: they cannot go through this template
        return False
    return _PROBE in str(text)


def _arguments(call: ToolCall) -> dict[str, Any]:
    arguments = json.loads(call["function"].get("arguments") or "{}")
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {call['function'].get('arguments')!r:.80}")
    return arguments


def _hermes(calls: list[ToolCall]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                     + "\n</tool_call>" for c in calls)


def _llama3_json(calls: list[ToolCall]) -> str:
    return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": _arguments(c)}) for c in calls)


def _mistral(calls: list[ToolCall]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls])


def _qwen3_coder(calls: list[ToolCall]) -> str:
    def parameter(key: str, value: Any) -> str:
        return f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"

    return "\n".join(f"<tool_call>\n<function={c['function']['name']}>\n"
                     + "".join(parameter(k, v) for k, v in _arguments(c).items())
                     + "</function>\n</tool_call>" for c in calls)


def _pythonic(calls: list[ToolCall]) -> str:
    # JSON literals are Python literals but for true/false/null, which the pythonic parser reads as such
    return "[" + ", ".join(f"{c['function']['name']}("
                           + ", ".join(f"{k}={json.dumps(v)}" for k, v in _arguments(c).items()) + ")"
                           for c in calls) + "]"


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model writes tool calls in one format: the instruction and the writer."""

    how: str
    """One sentence on writing a call; an example call written by ``write`` follows it in the prompt."""
    write: Callable[[list[ToolCall]], str]


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat("To call a function, write a JSON object with its name and arguments within "
                         "<tool_call></tool_call> tags, one block per call:", _hermes),
    "llama3_json": CallFormat('To call a function, reply with only a JSON object {"name": function name, "parameters": '
                              "its arguments}; separate several calls with ;:", _llama3_json),
    "mistral": CallFormat('To call functions, write [TOOL_CALLS] and then a JSON list of {"name", "arguments"} '
                          "objects:", _mistral),
    "qwen3_coder": CallFormat("To call a function, write <tool_call>, then <function=NAME> with one "
                              "<parameter=NAME>value</parameter> per argument, then </function></tool_call>:",
                              _qwen3_coder),
    "pythonic": CallFormat("To call functions, write a Python list of calls with keyword arguments only:", _pythonic),
}
"""Keyed like :data:`generators.parsers.TOOL_PARSERS`: the format each parser reads."""


def write_calls(calls: list[ToolCall], fmt: str) -> str:
    """``calls`` written as text in format ``fmt``, as a model taught by :func:`tool_prompt` writes them."""
    return FORMATS[fmt].write(calls)


def written_text(message: Message, fmt: str) -> str:
    """An assistant message as the model writes it: its content, then its ``tool_calls`` written in format ``fmt``."""
    content, calls = message.get("content") or "", message.get("tool_calls")
    if not calls:
        return content
    return f"{content}\n{write_calls(calls, fmt)}" if content else write_calls(calls, fmt)


def _example_call(tool: dict[str, Any]) -> ToolCall:
    """A call of ``tool`` with a placeholder for each required argument (``...`` for text, 0 for numbers)."""
    function = tool["function"]
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    placeholders = {"integer": 0, "number": 0, "boolean": True, "array": [], "object": {}}
    arguments = {name: placeholders.get((properties.get(name) or {}).get("type"), "...")
                 for name in parameters.get("required") or []}
    return {"id": "call_0", "type": "function", "function": {"name": function["name"],
                                                             "arguments": json.dumps(arguments)}}


def tool_prompt(tools: ToolSchemas, fmt: str) -> str:
    """The text that tells a model ``tools`` exist and how to call them in format ``fmt``."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    form = FORMATS[fmt]
    return (f"# Tools\n\nYou may call these functions, described as JSON schemas within <tools></tools> tags:\n"
            f"<tools>\n{schemas}\n</tools>\n\n{form.how}\n{form.write([_example_call(tools[0])])}\n"
            "Their results come back in the next message. When you need no function, answer in plain text.")


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """Where a chat's tools go: into the chat template (``tools=``), into the system message (``inject``), or
    nowhere. :meth:`resolve` picks it from ``generator.tool_prompt`` and the template."""

    inject: bool = False
    """Write the tools into the system message instead of passing them to the template."""
    to_template: bool = True
    """Pass the tools to the template as ``tools=``."""
    fmt: str = "hermes"
    """The call format injected prompts teach (the tool parser's)."""

    @classmethod
    def resolve(cls, setting: str, fmt: str, tokenizer: PreTrainedTokenizerBase | None) -> ToolPrompt:
        """The placement ``setting`` (auto, template, inject, none) means for a model with ``tokenizer`` (None: an
        endpoint in chat mode, which takes ``tools=`` itself)."""
        if setting not in TOOL_PROMPT_CHOICES:
            raise ValueError(f"tool_prompt must be one of {', '.join(TOOL_PROMPT_CHOICES)}, got {setting!r}")
        if setting == "auto":
            setting = "template" if tokenizer is None or template_renders_tools(tokenizer) else "inject"
        return cls(inject=setting == "inject", to_template=setting == "template", fmt=fmt)

    def apply(self, messages: list[Message], tools: ToolSchemas | None) -> tuple[list[Message], ToolSchemas | None]:
        """The opening messages as the model sees them, and the tools to pass the template."""
        if not tools:
            return list(messages), None
        if not self.inject:
            return list(messages), tools if self.to_template else None
        prompt = tool_prompt(tools, self.fmt)
        if messages and messages[0]["role"] == "system":
            head = messages[0]["content"] or ""
            return [{**messages[0], "content": f"{head}\n\n{prompt}" if head else prompt}, *messages[1:]], None
        return [{"role": "system", "content": prompt}, *messages], None

    def as_written(self, message: Message) -> Message:
        """An assistant message with its ``tool_calls`` written into its content in the taught format, where the
        template is not given the tools (and so is not trusted to render calls); other messages unchanged."""
        if self.to_template or message["role"] != "assistant" or not message.get("tool_calls"):
            return message
        return {"role": "assistant", "content": written_text(message, self.fmt)}
