"""What JSON from a client may hold before a server hands it on, whatever the server (``envkit serve``, the capture
gateway, the policy server): nesting at most :attr:`JsonLimits.max_depth` deep, no string over
:attr:`JsonLimits.max_string` characters, and only text that is valid Unicode. JSON may escape a lone surrogate
(``"\\ud800"``), which parses into a Python string that no encoder, tokenizer or file takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JsonLimits:
    """The most a parsed JSON value may hold."""

    max_depth: int = 64
    """Arrays and objects within each other (a chat request needs about 8)."""
    max_string: int = 2 << 20
    """Characters in one string (a message's text, say)."""


def json_problem(value: Any, limits: JsonLimits = JsonLimits(), where: str = "body") -> str | None:
    """What is wrong with ``value`` under ``limits``, naming where (``body.messages.0.content: ...``); None if
    nothing. Iterative, so no depth of nesting can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, at, depth = stack.pop()
        if isinstance(item, str):
            if problem := _text_problem(item, at, limits):
                return problem
        elif isinstance(item, dict | list):
            if depth >= limits.max_depth:
                return f"{at}: nested deeper than {limits.max_depth}"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, inner in pairs:
                if isinstance(key, str) and (problem := _text_problem(key, f"{at} (a key)", limits)):
                    return problem
                stack.append((inner, f"{at}.{key}", depth + 1))
    return None


def _text_problem(text: str, where: str, limits: JsonLimits) -> str | None:
    if len(text) > limits.max_string:
        return f"{where}: a string of {len(text)} characters, over {limits.max_string}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{where}: not valid Unicode (a lone surrogate at character {e.start})"
    return None
