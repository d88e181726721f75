"""Request bodies a hostile client sends, by class, with the status every HTTP surface that takes them must answer
(tests/test_serving.py against the policy server, tests/test_gateway.py against the capture gateway)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

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
    "user message without content": (json.dumps({"messages": [{"role": "user"}], "max_tokens": 1}).encode(), 400),
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


def chat_bodies() -> Any:
    """A hypothesis strategy of bodies for every dialect's route: near-valid requests whose fields take hostile values
    (roles, text with lone surrogates, tool schemas of every shape, numbers as strings, NaN), as JSON bytes; a valid
    one asks for one token, so the server's answers stay cheap."""
    from hypothesis import strategies as st

    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3),
                               max_leaves=8)
    text = st.text(max_size=24) | st.sampled_from(["a\ud800b", "\udfff", "\x00", "<|im_start|>", "é" * 40])
    parameters = json_values | st.fixed_dictionaries({"type": st.sampled_from(["object", "array", 3])}, optional={
        "properties": st.dictionaries(st.text(max_size=6), json_values, max_size=3), "required": json_values})
    tool = json_values | st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", None])}, optional={
        "function": json_values | st.fixed_dictionaries({"name": text}, optional={
            "description": text | json_values, "parameters": parameters}),
        "name": text, "input_schema": parameters, "parameters": parameters})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer",
                                                              "robot"]) | json_values}, optional={
        "content": text | json_values | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "input_text", "image_url"])}, optional={"text": text | json_values}),
            max_size=2),
        "tool_calls": json_values, "tool_call_id": json_values})
    body = st.fixed_dictionaries({"max_tokens": st.just(1) | json_values}, optional={
        "messages": st.lists(message, max_size=3) | json_values, "input": text | st.lists(message, max_size=2),
        "tools": st.lists(tool, max_size=2) | json_values, "n": st.sampled_from([1, 2, "1", True, 0, 17]),
        "stream": st.booleans() | json_values, "stop": text | st.lists(text, max_size=5) | json_values,
        "temperature": st.floats() | json_values, "system": text | json_values,
        "max_output_tokens": st.just(1) | json_values, "previous_response_id": text})
    plausible = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=24)})
    honest = st.fixed_dictionaries({"messages": st.lists(plausible, min_size=1, max_size=2), "max_tokens": st.just(1),
                                    "input": st.text(max_size=24)}, optional={"stream": st.booleans()})
    return (honest | body).map(lambda b: json.dumps(b, allow_nan=True).encode())


DIALECT_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
EXAMPLES = int(os.environ.get("ENVKIT_FUZZ_EXAMPLES", "60"))
"""Generated bodies per fuzzed server: 60 under ``make test``, more under ``make fuzz``."""


def fuzz(url: str, key: str, examples: int) -> Counter[tuple[str, int]]:
    """Post :func:`chat_bodies` to each dialect's route of the server at ``url`` with ``key``, ``examples`` times
    (derandomized: the same cases each run); fails on a 5xx or an unstructured refusal. Blocking: call it off the
    server's event loop. Returns the statuses seen, by route."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {key}",
                                                         "content-type": "application/json"}) as http:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(route=st.sampled_from(DIALECT_ROUTES), body=chat_bodies())
        def one(route: str, body: bytes) -> None:
            r = http.post(route, content=body)
            seen[route, r.status_code] += 1
            assert r.status_code < 500, (route, body[:300], r.text[:300])
            if r.status_code >= 400:
                error = r.json()["error"]
                assert error["message"] and (error.get("type") or error.get("code")), r.text

        one()
    return seen
