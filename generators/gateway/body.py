"""What a request body must be before any handler reads it, on every route of the gateway and the policy server: at
most :attr:`BodyLimits.max_bytes` (413, from ``content-length`` first, else counted as it arrives), and JSON within
:class:`~envkit.json_limits.JsonLimits` (its nesting, its strings, valid Unicode): a 400 that names where the bad
value is."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from envkit.json_limits import JsonLimits, json_problem
from generators.gateway.types import GatewayError

_OFF_LOOP = 1 << 16
"""Bodies past this many bytes are parsed and checked in a worker thread."""


@dataclass(frozen=True)
class BodyLimits:
    """The most a request body may hold."""

    max_bytes: int = 4 << 20
    values: JsonLimits = field(default_factory=JsonLimits)
    """What the parsed body may hold: its nesting, its strings."""


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
    if size > _OFF_LOOP:  # parsing and checking grow with the body: the other clients' calls go on meanwhile
        return await asyncio.to_thread(_parsed, body, limits)
    return _parsed(body, limits)


def _parsed(body: bytes, limits: BodyLimits) -> Any:
    """``body``'s JSON, within ``limits``."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise GatewayError(400, "invalid_request", f"the body nests deeper than {limits.values.max_depth}") from None
    except ValueError:
        raise GatewayError(400, "invalid_request", "the body is not JSON") from None
    if problem := json_problem(value, limits.values):
        raise GatewayError(400, "invalid_request", problem)
    return value
