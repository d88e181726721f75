"""OpenTelemetry traces of rollouts: one trace per rollout, whichever processes and nodes it touched. Off by default.

On when ``ENVKIT_TRACES`` names an OTLP/HTTP traces endpoint (``python -m trainer logging.traces=URL`` sets it for
the run, its Ray actors and the processes they start), e.g. a Phoenix server's ``http://HOST:6006/v1/traces``
(``make traces``). Each process exports its own spans; the trace they belong to crosses:

- Ray calls (env workers, inference replicas, reward actors) as a ``trace`` argument: :func:`carrier` on the
  caller's side, :func:`attached` on the actor's;
- HTTP to judges as the W3C ``traceparent`` header; the capture gateway parents an agent's calls to the episode
  that opened its key (never to a header the agent sends: it is policy-driven);
- agent processes as the ``TRACEPARENT`` variable (what OpenTelemetry's own instrumentations read).

Spans carry ``rl.*`` attributes (run, step, env, task_id, seed, weight_version, staleness, tokens, reward,
stop_reason, node). Sandboxes export nothing: they reach no network, by design; what runs in them is a span on the
caller's side (``sandbox.exec``). With tracing off, :func:`span` is a shared no-op context manager.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")

ENDPOINT_ENV = "ENVKIT_TRACES"
"""An OTLP/HTTP traces endpoint (``http://host:4318/v1/traces``, Phoenix's ``http://host:6006/v1/traces``): tracing
is on in every process that has it."""
TRACEPARENT_ENV = "TRACEPARENT"
"""The W3C trace context an agent process is started in."""
RUN_ENV = "ENVKIT_RUN"
"""The run's name (a Ray run's namespace, ``envkit-<driver pid>``), in the environment of the driver, of the run's
actors and of the processes they start (a vLLM server, an agent): each span's ``rl.run``."""
_tags: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("envkit_trace_tags",
                                                                         default=MappingProxyType({}))
_OFF = contextlib.nullcontext()
_provider: Any = None
_tracer: Any = None
_endpoint: str | None = None


def enabled() -> bool:
    """Whether this process exports spans (``ENVKIT_TRACES`` is set)."""
    return bool(os.environ.get(ENDPOINT_ENV))


def _get_tracer() -> Any:
    """This process's tracer, made at the first span (and again if the endpoint changed)."""
    global _provider, _tracer, _endpoint
    endpoint = os.environ[ENDPOINT_ENV]
    if _tracer is None or endpoint != _endpoint:
        if _provider is not None:
            _provider.shutdown()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Phoenix files a trace under the project its resource names: one per run
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "envkit"),
                                    "host.name": socket.gethostname(),
                                    "openinference.project.name": os.environ.get(RUN_ENV, "envkit")})
        provider = TracerProvider(resource=resource)
        # Exported every half second: a Ray actor killed with its node never runs the exit hook that flushes.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=500))
        _provider, _tracer, _endpoint = provider, provider.get_tracer("envkit"), endpoint
    return _tracer


def _attributes(values: dict[str, Any]) -> dict[str, Any]:
    return {f"rl.{k}": v for k, v in values.items() if v is not None}


def span(name: str, *, root: bool = False, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` around a block, child of the current one (``root``: the first of a new trace), with
    ``attributes`` as ``rl.*`` (None left out) and ``rl.node``; a no-op when tracing is off."""
    if not enabled():
        return _OFF
    from opentelemetry.context import Context

    return _get_tracer().start_as_current_span(
        name, context=Context() if root else None, attributes=_attributes(
            {"run": os.environ.get(RUN_ENV), "node": socket.gethostname(), **_tags.get(), **attributes}))


async def within(work: Awaitable[T], **attributes: Any) -> T:
    """Await ``work``: every span it begins (and the tasks it starts) carries ``attributes`` too (the step a rollout
    is generated for, say). A coroutine, so that it holds on whichever loop runs it."""
    token = _tags.set({**_tags.get(), **attributes})
    try:
        return await work
    finally:
        _tags.reset(token)


def annotate(**attributes: Any) -> None:
    """Set ``rl.*`` attributes on the current span (learned inside it: tokens, reward, stop reason)."""
    if enabled():
        from opentelemetry import trace

        trace.get_current_span().set_attributes(_attributes(attributes))


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``), to send along; empty when off or outside a span."""
    if not enabled():
        return {}
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers)
    return headers


@contextlib.contextmanager
def attached(headers: dict[str, str] | None) -> Iterator[None]:
    """Run the block in the trace context ``headers`` carry (from :func:`carrier`, or an HTTP request's)."""
    if not enabled() or not headers or "traceparent" not in headers:
        yield
        return
    from opentelemetry import context
    from opentelemetry.propagate import extract

    token = context.attach(extract(dict(headers)))
    try:
        yield
    finally:
        context.detach(token)


def remote_side(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """An actor's async method, run in the trace its caller sent as ``trace=`` (:func:`carrier`) and as a span of
    its own (``Class.method``): what joins a Ray call to the rollout that made it. The signature gains ``trace``,
    which Ray checks calls against."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def call(self: Any, *args: Any, trace: dict[str, str] | None = None, **kwargs: Any) -> T:
        if not trace:
            return await method(self, *args, **kwargs)
        with attached(trace), span(f"{type(self).__name__}.{method.__name__}"):
            return await method(self, *args, **kwargs)

    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("trace", inspect.Parameter.KEYWORD_ONLY, default=None))
    call.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    del call.__wrapped__  # Ray reads an actor method's signature at the end of its __wrapped__ chain: this one
    return call


def flush() -> None:
    """Export the spans this process still holds (before it ends)."""
    if _provider is not None:
        _provider.force_flush()
