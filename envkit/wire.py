"""JSON on the wire between ``envkit serve`` and its clients: orjson, with the standard library as the fallback.

orjson encodes and decodes a step's frames about five times faster than the ``json`` module, which is a tenth of
a remote step's CPU on each side. Where orjson refuses a value the standard library takes (integers beyond 64
bits), the standard library encodes it. Non-finite floats, which JSON cannot carry, are sent as ``null``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS  # int, float, bool and None keys become strings, as with json.dumps


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as compact UTF-8 JSON; ``default`` turns what JSON lacks into something it has.

    Raises ValueError for what no encoder can carry (a circular reference), TypeError for an unsupported type
    when there is no ``default``.
    """
    try:
        return orjson.dumps(value, default=default, option=_OPTIONS)
    except orjson.JSONEncodeError:
        return json.dumps(value, default=default, allow_nan=False, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """The value of a JSON document; raises ValueError when it is not one."""
    return orjson.loads(data)
