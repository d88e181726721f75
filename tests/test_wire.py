"""envkit.wire: the JSON both ends of `envkit serve` speak (orjson, the standard library where orjson refuses)."""

from __future__ import annotations

import json
import math

import pytest

from envkit import wire


def test_round_trips_what_a_step_carries():
    body = {"observation": [{"role": "user", "content": "héllo \u2603 \"quoted\"\n"}], "reward": 0.1,
            "terminated": False, "truncated": True, "info": {"nested": [1, 2.5, None, {"k": "v"}]}}
    encoded = wire.dumps(body)
    assert encoded == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert wire.loads(encoded) == wire.loads(encoded.decode()) == body


def test_keys_and_values_json_lacks():
    keys = {1: "a", 2.5: "b", False: "c", None: "d"}
    assert wire.loads(wire.dumps(keys)) == {"1": "a", "2.5": "b", "false": "c", "null": "d"}
    assert wire.dumps({"x": math.nan, "y": -math.inf}) == b'{"x":null,"y":null}'
    assert wire.dumps({"s": {3}}, default=str) == b'{"s":"{3}"}'
    with pytest.raises(TypeError):
        wire.dumps({"s": {3}})


def test_integers_beyond_64_bits_fall_back_to_the_standard_library():
    assert wire.loads(wire.dumps({"big": 2**70, 5: "int key"})) == {"big": 2**70, "5": "int key"}
    with pytest.raises(ValueError):
        wire.dumps({"big": 2**70, "x": math.nan})  # the fallback refuses what JSON cannot carry


def test_circular_values_and_bad_documents_raise_value_error():
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError):
        wire.dumps(loop)
    for bad in (b"{nope", b"", b"[1,]", "NaN"):
        with pytest.raises(ValueError):
            wire.loads(bad)
