"""What the model wrote → the assistant message the env sees: tool calls in the model's own format, reasoning apart.

Open models write tool calls in the format their chat template teaches, not as OpenAI ``tool_calls``::

    hermes       <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>          Hermes, Qwen2.5, Qwen3
    llama3_json  {"name": "f", "parameters": {"x": 1}}  (maybe after <|python_tag|>, ; between calls)  Llama 3.x
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]  or  [TOOL_CALLS]f[ARGS]{"x": 1}  Mistral
    qwen3_coder  <tool_call><function=f><parameter=x>1</parameter></function></tool_call>  Qwen3-Coder
    pythonic     [f(x=1), g(y="a")]                                     Llama 3.2 / Llama 4 pythonic templates

Each parser returns ``(calls, errors)`` as :func:`envkit.parse_tool_calls` does: OpenAI ToolCall dicts, and one
readable error per malformed call so the env can tell the model what to fix; no model text makes one raise.
:func:`detect_tool_parser` reads the format off a chat template by the markers it writes. ``<think>...</think>``
reasoning (Qwen3, DeepSeek-R1) is split off into ``reasoning_content`` before calls are read, so a call the model
only thought about is never made. Only text is read here: the trajectory's token ids are never touched.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import envkit
from envkit import Message, ToolCall

ToolSchemas = list[dict[str, Any]] | None
"""The tools offered to the model, as OpenAI ``tools=[...]`` entries (qwen3_coder types parameters by them)."""
ToolCallParser = Callable[[str, ToolSchemas], tuple[list[ToolCall], list[str]]]

_DECODER = json.JSONDecoder()


class _Malformed(ValueError):
    """One call the model wrote cannot be read; the message says why, for the model."""


_UNREADABLE = (_Malformed, RecursionError)  # JSON or literals nested past Python's recursion limit


def _call(index: int, name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    if isinstance(arguments, str):  # some templates render, and so teach, arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise _Malformed("arguments is a string that is not a JSON object") from None
    if not isinstance(arguments, dict):
        raise _Malformed(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return {"id": call_id or f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _from_object(obj: Any, index: int, call_id: str | None = None) -> ToolCall:
    """The call a decoded JSON object describes: ``{"name": ..., "arguments"|"parameters": {...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise _Malformed(f'needs an object with a "name" string, got {json.dumps(obj)[:80]}')
    return _call(index, obj["name"], obj.get("arguments", obj.get("parameters", {})), call_id)


def _decode_json(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value starting at ``pos`` (after any whitespace) and where it ends."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        raise _Malformed(f"not valid JSON ({e.msg} at char {e.pos - pos}): {text[pos:pos + 120]}") from None
    except RecursionError:
        raise _Malformed(f"nested too deeply to read: {text[pos:pos + 120]}") from None


_HERMES_SHAPE = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'


def parse_hermes(text: str, tools: ToolSchemas = None) -> tuple[list[ToolCall], list[str]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3): envkit's own."""
    calls, errors = envkit.parse_tool_calls(text)
    return calls, [f"{error}; write {_HERMES_SHAPE}" for error in errors]


_LLAMA_SHAPE = '{"name": "...", "parameters": {...}}'
_LLAMA_SPECIAL = re.compile(r"<\|python_tag\|>|<\|eom_id\|>|<\|eot_id\|>")
_LLAMA_SEPARATOR = re.compile(r"[\s;]*")


def parse_llama3_json(text: str, tools: ToolSchemas = None) -> tuple[list[ToolCall], list[str]]:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``, several
    separated by ``;``. Text that neither has the tag nor starts as such an object is an answer, not a call."""
    body = _LLAMA_SPECIAL.sub("", text).strip()
    if "<|python_tag|>" not in text and not (body.startswith("{") and '"name"' in body):
        return [], []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while pos < len(body):
        index = len(calls) + len(errors)
        try:
            obj, pos = _decode_json(body, pos)
            calls.append(_from_object(obj, index))
        except _UNREADABLE as e:
            errors.append(f"tool call {index}: {e}; write {_LLAMA_SHAPE}")
            break
        pos = _LLAMA_SEPARATOR.match(body, pos).end()  # type: ignore[union-attr] (matches the empty string too)
        if not body.startswith("{", pos):  # prose after the calls is not another call
            break
    return calls, errors


_MISTRAL_SHAPE = '[TOOL_CALLS]name[ARGS]{...} or [TOOL_CALLS][{"name": "...", "arguments": {...}}]'
_MISTRAL_NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*(\w*)\s*)?\[ARGS\]")


def _mistral_id(given: Any, index: int) -> str:
    # Mistral's templates refuse tool-call ids that are not 9 alphanumerics, and tool results carry the id
    if isinstance(given, str) and len(given) == 9 and given.isalnum():
        return given
    return f"call{index:05d}"


def parse_mistral(text: str, tools: ToolSchemas = None) -> tuple[list[ToolCall], list[str]]:
    """Mistral calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (v0.3, Nemo) or
    ``name[ARGS]{json}``, optionally with ``[CALL_ID]id`` (Small 3.2, Devstral, Magistral), once per call."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for chunk in text.split("[TOOL_CALLS]")[1:]:
        index = len(calls) + len(errors)
        try:
            if chunk.lstrip().startswith(("[", "{")):
                items, _ = _decode_json(chunk, 0)
                for item in items if isinstance(items, list) else [items]:
                    index = len(calls) + len(errors)
                    given = item.get("id") if isinstance(item, dict) else None
                    calls.append(_from_object(item, index, _mistral_id(given, index)))
                continue
            named = _MISTRAL_NAMED.match(chunk)
            if named is None:
                raise _Malformed(f"neither name[ARGS]{{...}} nor a JSON list: {chunk[:120]!r}")
            arguments, _ = _decode_json(chunk, named.end())
            calls.append(_call(index, named.group(1), arguments, _mistral_id(named.group(2), index)))
        except _UNREADABLE as e:
            errors.append(f"tool call {index}: {e}; write {_MISTRAL_SHAPE}")
    return calls, errors


_CODER_SHAPE = "<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n</tool_call>"
_CODER_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_CODER_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def parse_qwen3_coder(text: str, tools: ToolSchemas = None) -> tuple[list[ToolCall], list[str]]:
    """Qwen3-Coder XML calls: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
    </tool_call>``. Values take the type the tool's schema gives them, else JSON if they parse, else text."""
    properties = {
        t.get("function", {}).get("name"): t.get("function", {}).get("parameters", {}).get("properties", {})
        for t in tools or []
    }
    blocks = _CODER_BLOCK.findall(text) or ([text] if "<function=" in text else [])
    calls: list[ToolCall] = []
    errors: list[str] = []
    for block in blocks:
        functions = _CODER_FUNCTION.findall(block)
        if not functions:
            index = len(calls) + len(errors)
            problem = "cut off before </function>" if "<function=" in block else "no <function=NAME> inside"
            errors.append(f"tool call {index}: {problem}; write {_CODER_SHAPE}")
        for name, body in functions:
            index = len(calls) + len(errors)
            schema = properties.get(name.strip(), {})
            try:
                if not name.strip():
                    raise _Malformed("empty function name")
                arguments = {key.strip(): _typed(_unwrap(value), schema.get(key.strip()))
                             for key, value in _CODER_PARAMETER.findall(body)}
                calls.append(_call(index, name.strip(), arguments))
            except _UNREADABLE as e:
                errors.append(f"tool call {index}: {e}; write {_CODER_SHAPE}")
    return calls, errors


def _unwrap(value: str) -> str:
    """A parameter's text without the one newline the template writes on each side of it."""
    return value.removeprefix("\n").removesuffix("\n")


_MISMATCH = object()
"""A converter's answer for text that does not have its type."""


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON type its schema names; text that does not fit stays text (the env's argument
    check then tells the model). Without a type: JSON if it parses, else text."""
    types = schema.get("type") if isinstance(schema, dict) else None
    kinds = [types] if isinstance(types, str) else [k for k in types or [] if isinstance(k, str)]
    for kind in kinds:
        if kind == "string":
            return value
        convert = _JSON_TYPES.get(kind)
        try:
            converted = convert(value.strip()) if convert is not None else _MISMATCH
        except (ValueError, SyntaxError, RecursionError, _Malformed):
            continue
        if converted is not _MISMATCH:
            return converted
    if any(kind in _JSON_TYPES for kind in kinds):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


def _as_number(text: str) -> Any:
    number = json.loads(text)
    return number if isinstance(number, int | float) and not isinstance(number, bool) else _MISMATCH


def _as_container(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:  # models often write Python literals here ({'a': 1}, [True])
            value = _literal(ast.parse(text, mode="eval").body)
        return value if isinstance(value, kind) else _MISMATCH
    return convert


_JSON_TYPES: dict[str, Callable[[str], Any]] = {
    "integer": lambda text: int(text) if re.fullmatch(r"[-+]?\d+", text) else _MISMATCH,
    "number": _as_number,
    "boolean": lambda text: {"true": True, "false": False}.get(text.lower(), _MISMATCH),
    "null": lambda text: None if text.lower() in ("null", "none") else _MISMATCH,
    "object": _as_container(dict),
    "array": _as_container(list),
}

_PYTHONIC_SHAPE = '[get_weather(city="Paris"), add(a=1, b=2)]'
_PYTHONIC_SPECIAL = re.compile(r"<\|python_start\|>|<\|python_end\|>|<\|python_tag\|>|<\|eom_id\|>|<\|eom\|>")
_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse_pythonic(text: str, tools: ToolSchemas = None) -> tuple[list[ToolCall], list[str]]:
    """A Python list of keyword calls, ``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2 / Llama 4 pythonic
    templates). It is read with ``ast`` and only literal values are accepted; nothing the model wrote is evaluated."""
    body = _PYTHONIC_SPECIAL.sub("", text).strip()
    if not _PYTHONIC_START.match(body):
        return [], []
    tree = _call_list(body)
    if isinstance(tree, str):
        return [], [f"tool calls are not a valid Python list ({tree}): {body[:120]}; write {_PYTHONIC_SHAPE}"]
    calls: list[ToolCall] = []
    errors: list[str] = []
    for index, node in enumerate(tree.elts):
        try:
            calls.append(_call(index, *_keyword_call(node)))
        except _UNREADABLE as e:
            errors.append(f"tool call {index}: {e}; write {_PYTHONIC_SHAPE}")
    return calls, errors


def _call_list(source: str) -> ast.List | str:
    """The list of calls ``source`` starts with (text after its ``]`` is prose), or why there is none."""
    ends = [i + 1 for i, c in enumerate(source) if c == "]"][::-1][:64]  # longest first, bounded for long texts
    problem = "no closing ]"
    for end in ends:
        try:
            tree = ast.parse(source[:end], mode="eval").body
        except (SyntaxError, ValueError, RecursionError) as e:
            problem = e.msg if isinstance(e, SyntaxError) else type(e).__name__
            continue
        return tree if isinstance(tree, ast.List) else "not a list"
    return problem


def _keyword_call(node: ast.expr) -> tuple[str, dict[str, Any]]:
    if not isinstance(node, ast.Call):
        raise _Malformed(f"{ast.unparse(node)[:80]} is not a call")
    if not isinstance(node.func, ast.Name):
        raise _Malformed(f"{ast.unparse(node.func)[:80]} is not a plain function name")
    if node.args or any(k.arg is None for k in node.keywords):
        raise _Malformed(f"{node.func.id}: pass every argument by keyword, like {node.func.id}(x=1)")
    return node.func.id, {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}


def _literal(node: ast.expr) -> Any:
    """The JSON value a literal expression writes; names, calls and operators are refused, never run."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | None):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd)
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:  # models trained on JSON write true/false/null
        return _JSON_NAMES[node.id]
    raise _Malformed(f"{ast.unparse(node)[:80]} is not a literal (a string, number, list, dict, true/false/null)")


TOOL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "qwen3_coder": parse_qwen3_coder,
    "pythonic": parse_pythonic,
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)
REASONING_PARSER_CHOICES = ("auto", "think", "none")

_PYTHONIC_TEMPLATE = re.compile(r"\[func(?:_name)?1\(")


def detect_tool_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model, by the markers it writes; hermes when none is found.

    Order matters: Qwen3-Coder's template also writes ``<tool_call>``, and the Llama pythonic ones also ``ipython``.
    """
    template = chat_template or ""
    if "<function=" in template:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if _PYTHONIC_TEMPLATE.search(template):  # "[func_name1(params_name1=...)]" instructions
        return "pythonic"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


_THINK_TAG = re.compile(r"</?think>")


def split_reasoning(text: str, *, opened: bool = False) -> tuple[str | None, str]:
    """``(reasoning, content)`` of one model turn: everything up to the last ``</think>`` is reasoning.

    A turn cut off inside ``<think>`` is reasoning from the tag on; with ``opened`` (the generation prompt already
    wrote ``<think>``, as DeepSeek-R1's template does) a turn with no ``</think>`` is all reasoning. No tags: no
    reasoning.
    """
    head, end, tail = text.rpartition("</think>")
    if end:
        return _THINK_TAG.sub("", head).strip(), tail.lstrip()
    before, start, after = text.partition("<think>")
    if start:
        return after.strip(), before.strip()
    return (text.strip(), "") if opened else (None, text)


@dataclass(frozen=True, slots=True)
class OutputParser:
    """How one model turn's text becomes the assistant message the env sees."""

    tool_parser: str = "hermes"
    """The format of the model's tool calls: a key of ``TOOL_PARSERS``."""
    think: bool = False
    """Split ``<think>...</think>`` reasoning off the content into ``reasoning_content``."""
    think_opened: bool = False
    """The generation prompt already opens ``<think>``: text before ``</think>`` is reasoning without the tag."""

    def __post_init__(self) -> None:
        if self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}")

    @classmethod
    def for_template(cls, chat_template: str | None, generation_prompt: str = "", *, tool_parser: str = "auto",
                     reasoning_parser: str = "auto") -> OutputParser:
        """The parser for a model with this chat template (None: an endpoint in chat mode, no template known).

        ``auto`` reads the tool-call format off the template (hermes without one) and splits reasoning when the
        template writes ``<think>`` (always without a template: only tagged text is moved).
        """
        if reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, "
                             f"got {reasoning_parser!r}")
        name = detect_tool_parser(chat_template) if tool_parser == "auto" else tool_parser
        if reasoning_parser == "auto":
            think = chat_template is None or "think>" in chat_template
        else:
            think = reasoning_parser == "think"
        return cls(name, think, think and generation_prompt.rstrip().endswith("<think>"))

    def parse(self, text: str, tools: ToolSchemas = None, *, native_calls: list[ToolCall] | None = None,
              reasoning: str | None = None) -> Message:
        """The assistant message for ``text``: reasoning in ``reasoning_content``, the calls read in this format
        (or ``native_calls``, an endpoint's own) in ``tool_calls``, malformed ones in ``tool_call_errors``.

        ``reasoning`` is what an endpoint already split off itself.
        """
        thought, content = split_reasoning(text, opened=self.think_opened) if self.think else (None, text)
        calls, errors = (native_calls, []) if native_calls else TOOL_PARSERS[self.tool_parser](content, tools)
        message = envkit.assistant(content, calls or None)
        if reasoning or thought:
            message["reasoning_content"] = reasoning or thought or ""
        if errors:
            message["tool_call_errors"] = errors
        return message
