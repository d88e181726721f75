"""Request bodies a hostile client sends, by class, with the status every HTTP surface that takes them must answer
(tests/test_serving.py against the policy server, tests/test_gateway.py against the capture gateway)."""

from __future__ import annotations

import json

CHAT: dict[str, tuple[bytes, int]] = {
    "nested JSON": (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    "nested under the recursion limit": (b'{"messages": [{"role": "user", "content": "x", "extra": '
                                         + b"[" * 500 + b"]" * 500 + b"}]}", 400),
    "tool without function": (json.dumps({"messages": [{"role": "user", "content": "x"}],
                                           "tools": [{"type": "function"}]}).encode(), 400),
    "tool parameters not an object": (json.dumps(
        {"messages": [{"role": "user", "content": "x"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]}).encode(), 400),
    "lone surrogate": (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400),
    "n as a string": (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": "1"}).encode(), 400),
    "body over the limit": (json.dumps({"messages": [{"role": "user", "content": "word " * 1_200_000}]}).encode(),
                            413),
    "prompt past the token budget by its bytes": (json.dumps(
        {"messages": [{"role": "user", "content": "word " * 400_000}]}).encode(), 400),
}
"""Bodies of ``POST /v1/chat/completions``."""

FEEDBACK: dict[str, tuple[bytes, int]] = {
    "score as a string": (b'{"response_id": "x", "score": "0.5"}', 400),
    "score as a boolean": (b'{"response_id": "x", "score": true}', 400),
}
"""Bodies of the policy server's ``POST /v1/feedback``."""
