"""envkit.tracing without a backend: off by default it costs a lookup (no OpenTelemetry import, one shared no-op
context manager), and an actor method made traceable declares ``trace``, where Ray checks a call's arguments.
What a traced run exports, across nodes, is checked in tests/test_cluster.py against a real Phoenix."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import ray

from envkit import tracing


def test_tracing_is_off_by_default_and_never_imports_opentelemetry(monkeypatch):
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert not tracing.enabled() and tracing.carrier() == {}
    assert tracing.span("rollout", root=True, env="x") is tracing.span("generate")  # the shared no-op
    with tracing.attached({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}):
        assert tracing.carrier() == {}
    probe = ("import sys, envkit.tracing, generators.rollout, generators.gateway; "
             "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    env = {k: v for k, v in os.environ.items() if k != tracing.ENDPOINT_ENV}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_traced_actor_method_declares_trace_before_its_keyword_arguments():
    class Worker:
        @tracing.remote_side
        async def step(self, key: int, action: dict, **options: object) -> int:
            return key

    params = inspect.signature(Worker.step).parameters
    assert list(params) == ["self", "key", "action", "trace", "options"]
    assert params["trace"].kind is inspect.Parameter.KEYWORD_ONLY and params["trace"].default is None
    # what Ray checks a call against: it reads the signature at the end of the method's __wrapped__ chain
    ray_sees = ray.remote(Worker).__ray_metadata__.method_meta.signatures["step"]
    assert [p.name for p in ray_sees] == ["key", "action", "trace", "_ray_trace_ctx", "options"]
