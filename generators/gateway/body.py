"""What a request body must be before any handler reads it, on every route of the gateway and the policy server: at
most :attr:`BodyLimits.max_bytes` (413, from ``content-length`` first, else counted as it arrives), JSON nested at
most :attr:`BodyLimits.max_depth` deep, no string longer than :attr:`BodyLimits.max_string`, and only text that is
valid Unicode (JSON may escape a lone surrogate, which no tokenizer takes). A refusal names where the bad value is.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from generators.gateway.types import GatewayError

_PARSE_OFF_LOOP = 1 << 16
"""Bodies past this many bytes are parsed in a worker thread: the event loop keeps answering the other clients."""


@dataclass(frozen=True)
class BodyLimits:
    """The most a request body may hold."""

    max_bytes: int = 4 << 20
    max_depth: int = 64
    """Arrays and objects within each other (a chat request needs about 8)."""
    max_string: int = 2 << 20
    """Characters in one string (a message's text, say)."""


async def read_json(request: Request, limits: BodyLimits = BodyLimits()) -> Any:
    """The request's JSON body, within ``limits``; a :class:`GatewayError` (400, 413) naming what is wrong."""
    too_large = GatewayError(413, "payload_too_large", f"the body is over {limits.max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_bytes:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        value = await asyncio.to_thread(json.loads, body) if size > _PARSE_OFF_LOOP else json.loads(body)
    except RecursionError:
        raise GatewayError(400, "invalid_request", f"the body nests deeper than {limits.max_depth}") from None
    except ValueError:
        raise GatewayError(400, "invalid_request", "the body is not JSON") from None
    check_value(value, limits)
    return value


def check_value(value: Any, limits: BodyLimits) -> None:
    """Refuse (400) a parsed body nested past ``limits``, with a string too long or one that is not valid Unicode;
    iterative, so no depth of nesting can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, "body", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, where, limits)
        elif isinstance(item, dict | list):
            if depth >= limits.max_depth:
                raise GatewayError(400, "invalid_request", f"{where}: nested deeper than {limits.max_depth}")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, inner in pairs:
                if isinstance(key, str):
                    _check_text(key, f"{where} (a key)", limits)
                stack.append((inner, f"{where}.{key}", depth + 1))


def _check_text(text: str, where: str, limits: BodyLimits) -> None:
    if len(text) > limits.max_string:
        raise GatewayError(400, "invalid_request", f"{where}: a string of {len(text)} characters, over "
                                                   f"{limits.max_string}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GatewayError(400, "invalid_request", f"{where}: not valid Unicode (a lone surrogate at character "
                                                   f"{e.start})") from None
