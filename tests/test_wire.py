"""envkit.remote.wire: the JSON both ends of `envkit serve` speak (orjson, the standard library where orjson
refuses)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from envkit.remote import wire


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
    assert wire.dumps({"s": {3, 1}, "mixed": {None}}) == b'{"s":[1,3],"mixed":[null]}'
    with pytest.raises(TypeError, match=r"^\['s'\]\[0\]: builtins.bytes is not JSON$"):
        wire.dumps({"s": {b"raw"}})
    with pytest.raises(TypeError, match=r"^\[1\]\['when'\]: builtins.object is not JSON$"):
        wire.dumps([2**70, {"when": object()}])  # found on the standard library's path too


def test_numpy_and_torch_values_become_json_numbers_and_lists():
    strided = np.arange(12).reshape(3, 4)[:, ::2]  # not C-contiguous: orjson leaves it to the fallback
    body = {"i": np.int64(-3), "u": np.uint8(200), "f": np.float64(0.1), "b": np.bool_(True), "strided": strided,
            "objects": np.array([1, "x"], dtype=object), "tensor": torch.tensor([[1.5, 2.0]]), "nan": np.float64("nan"),
            "empty": np.zeros((2, 0)), "big": np.arange(100_000)}
    decoded = wire.loads(wire.dumps(body))
    assert decoded.pop("big") == list(range(100_000))
    assert decoded == {"i": -3, "u": 200, "f": 0.1, "b": True, "strided": [[0, 2], [4, 6], [8, 10]],
                       "objects": [1, "x"], "tensor": [[1.5, 2.0]], "nan": None, "empty": [[], []]}
    assert type(decoded["b"]) is bool and type(decoded["i"]) is int


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
