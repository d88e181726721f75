"""The policy served to real clients (:class:`PolicyServer`): the capture gateway's dialects behind client keys, each
call linked into its conversation and, with consent, kept in a :class:`~generators.serving.store.CallStore` before
its response is sent; late feedback on a response from the client that got it; load shed with 429s; ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import random
import secrets
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from envkit import Message
from envkit.errors import RubricError
from envkit.rewards.rubrics import Episode as RubricEpisode
from envkit.rewards.rubrics import Rubric
from generators.chat import ChatTokenizer
from generators.engines.base import EngineError, InferenceEngine
from generators.gateway.app import DIALECTS, dialect_error
from generators.gateway.chat import ChatRequest, openai_error, openai_message
from generators.gateway.contained import Contained, contain
from generators.gateway.dialect import Dialect, GatewayError, json_body, models_list, parse, read_json, request_key
from generators.gateway.server import KEEP_ALIVE_S, Choice, Episode, Gateway, Limits
from generators.rollout import Generator, GeneratorConfig
from generators.serving.store import CallStore, StoredCall

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

CAPTURE_HEADER = "x-envkit-capture"
"""A request with ``x-envkit-capture: off`` is not stored, nor is any later call of its conversation."""
VERSION_HEADER = "x-envkit-model-version"
"""On every response: the weight version that answered."""
RESPONSE_HEADER = "x-envkit-response-id"
"""On every response: its id, what feedback names (also the body's ``id``)."""

Redactor = Callable[[list[Message]], list[Message]]
"""A redaction hook: a call's messages, the reply last, in; the same messages with what must not be kept removed,
out. It runs before anything of the call is stored."""

_OFF = frozenset({"off", "0", "false", "no"})
_RESPONSES_KEPT = 1024
"""Responses API chats kept per client for ``previous_response_id``."""


@dataclass(frozen=True)
class Client:
    """Who may call the served policy, under which key, and whether its calls may be kept."""

    name: str
    key: str
    capture: bool = True
    """False: none of this client's calls is stored (it has not consented)."""


@dataclass
class ServingConfig:
    """How the policy is served and its traffic captured."""

    clients: list[Client]
    admin_key: str | None = None
    """Authorizes the admin routes (deleting a client's data); none: they are off."""
    sample_rate: float = 1.0
    """The share of consenting conversations stored (drawn per conversation, so each is kept whole or not at all)."""
    redact: Redactor | None = None
    max_concurrent: int = 64
    """Calls served at once; the next one gets 429 (with ``retry-after``) rather than a queue without end."""
    conversations_per_client: int = 256
    """Open conversations per client that a call may continue (the least recent is let go past it)."""
    conversation_idle_s: float = 1800.0
    """A conversation untouched this long is let go: a later call starts a new one."""
    rubric: Rubric | None = None
    """Scores stored calls in the background (the chat as stored, the reply last): the reward of a conversation no
    client scored in time (:class:`~generators.serving.episodes.RewardRule`). An LLM judge is the usual one."""
    rubric_rate: float = 1.0
    """The share of stored calls the rubric scores."""
    versions: Callable[[], list[int]] | None = None
    """The weight versions an admin may roll back to (``POST /v1/admin/rollback``); None: no rollback here. The
    owner of the engine carries a request out (:attr:`PolicyServer.rollback_to`)."""

    def __post_init__(self) -> None:
        for name in ("sample_rate", "rubric_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        keys = [c.key for c in self.clients]
        if len(set(keys)) != len(keys) or len({c.name for c in self.clients}) != len(keys):
            raise ValueError("each client needs a name and a key of its own")
        if self.admin_key is not None and self.admin_key in keys:
            raise ValueError("the admin key must not be a client's key")


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: a score for one response, as a number in [0, 1] or thumbs up/down."""

    model_config = ConfigDict(extra="forbid", strict=True)
    response_id: str = Field(min_length=1, max_length=200)
    score: float | None = Field(default=None, ge=0.0, le=1.0)
    thumbs: Literal["up", "down"] | None = None
    text: str | None = Field(default=None, max_length=10_000)

    def value(self) -> float:
        """The score given: ``score``, or thumbs up as 1 and down as 0."""
        if (self.score is None) == (self.thumbs is None):
            raise GatewayError(400, "invalid_request", "give one of score (a number in [0, 1]) or thumbs (up, down)")
        if self.score is not None:
            if not math.isfinite(self.score):
                raise GatewayError(400, "invalid_request", "score must be a finite number in [0, 1]")
            return self.score
        return 1.0 if self.thumbs == "up" else 0.0


class RollbackRequest(BaseModel):
    """``POST /v1/admin/rollback``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=0)


@dataclass
class _Conversation:
    episode: Episode
    captured: bool
    last: float = field(default_factory=time.monotonic)


@dataclass
class _ClientState:
    client: Client
    history: Episode
    """Holds the client's Responses API chats (by response id): a chained call may continue any of them."""
    conversations: OrderedDict[str, _Conversation] = field(default_factory=OrderedDict)


class PolicyServer:
    """Serves ``engine``'s policy to ``config.clients`` and keeps their consenting calls in ``store``. Build the app
    with :meth:`app`, or :meth:`serve` it until SIGTERM or SIGINT, which drains: calls in flight finish and are
    stored before it returns."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, config: ServingConfig,
                 store: CallStore, generator: GeneratorConfig | None = None) -> None:
        generator = generator or GeneratorConfig()
        sampler = Generator(engine, tokenizer, generator)
        # a conversation has no turn limit: its calls are bounded by the context alone
        limits = Limits(generator.sampling, 1 << 30, generator.max_total_tokens, generator.check_template)
        self.gateway = Gateway(engine, tokenizer, sampler.parser, sampler.tool_prompt, limits)
        self.engine, self.tokenizer, self.config, self.store = engine, tokenizer, config, store
        self._clients = {c.key: _ClientState(c, Episode(f"history-{c.name}")) for c in config.clients}
        self.active = 0
        self.drained = 0
        """How many calls were in flight when the server was told to stop: :meth:`serve` answered them first."""
        self.rollback_to: int | None = None
        """The version an admin asked to serve again, until the engine's owner carries it out."""
        self._scoring: set[asyncio.Task[None]] = set()
        self._server: uvicorn.Server | None = None
        self.metrics = _Metrics(self)

    @property
    def model_version(self) -> int:
        """The weight version answering now."""
        return self.engine.weight_version

    def app(self) -> Contained:
        """The routes: each dialect's, ``/v1/models``, ``/v1/feedback``, the admin routes, ``/metrics``; every
        response counted by route and status, an exception none of them caught a structured 500."""
        app = FastAPI(title="envkit policy server", docs_url=None, redoc_url=None)  # its schema: /openapi.json
        for dialect in DIALECTS:
            app.add_api_route(dialect.route, self._handler(dialect), methods=["POST"],
                              openapi_extra=json_body(dialect.body))
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/feedback", self._feedback, methods=["POST"], openapi_extra=json_body(FeedbackRequest))
        app.add_api_route("/v1/admin/clients/{name}/data", self._forget, methods=["DELETE"])
        app.add_api_route("/v1/admin/rollback", self._rollback, methods=["POST"],
                          openapi_extra=json_body(RollbackRequest))
        app.add_api_route("/metrics", self.metrics.endpoint, methods=["GET"])
        return contain(app, dialect_error, self.metrics.done)

    async def serve(self, host: str = "127.0.0.1", port: int = 0, *, drain_s: float = 60.0,
                    on_ready: Callable[[str], None] | None = None, prune_every_s: float = 300.0,
                    handle_signals: bool = True) -> None:
        """Serve until :meth:`stop`, or SIGTERM or SIGINT (``handle_signals``, in the main thread); then let the calls
        in flight (up to ``drain_s``) finish and be stored, and return. ``on_ready`` gets the base URL once the
        socket listens."""
        import uvicorn

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=int(drain_s))
        self._server = uvicorn.Server(config)
        # uvicorn re-raises the signal it drained for once it is done, which would end this process before the
        # store and the engine close: the signals are this method's to handle instead.
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        main = threading.current_thread() is threading.main_thread()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals and main else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.stop)
        pruning = asyncio.create_task(self._prune_every(prune_every_s))
        serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        try:
            while not self._server.started:
                if serving.done():
                    await serving
                    raise RuntimeError("the policy server stopped while starting")
                await asyncio.sleep(0.01)
            if on_ready is not None:
                on_ready(f"http://{host}:{sock.getsockname()[1]}")
            await serving
            if self._scoring:  # the rubric's scores of the last calls, within what is left of the drain
                await asyncio.wait(self._scoring, timeout=drain_s)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            pruning.cancel()
            for task in self._scoring:
                task.cancel()

    def stop(self) -> None:
        """Stop taking calls; :meth:`serve` returns once those in flight are answered."""
        if self._server is not None and not self._server.should_exit:
            self.drained = self.active
            self._server.should_exit = True

    async def _prune_every(self, seconds: float) -> None:
        while True:
            deleted = await self.store.prune()
            if deleted:
                log.info("retention deleted %d stored calls", deleted)
            await asyncio.sleep(seconds)

    def _client(self, request: Request) -> _ClientState:
        """The client whose key the request carries (bearer token or ``x-api-key``); 401 for any other."""
        key = request_key(request)
        state = self._clients.get(key or "")
        if state is None:
            raise GatewayError(401, "invalid_api_key", "unknown API key")
        return state

    def _handler(self, dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                state = self._client(request)
                if self.active >= self.config.max_concurrent:
                    raise GatewayError(429, "overloaded", f"the server is answering {self.active} calls, its "
                                                          "limit; retry shortly")
                self.active += 1
                try:
                    body, call = await self._answer(dialect, state, request)
                finally:
                    self.active -= 1
            except GatewayError as e:
                refusal = dialect.error(e.status, e.code, str(e))
                if e.status == 429:  # shed load: a client should come back, after a pause
                    refusal.headers.update({"retry-after": "1", "x-should-retry": "true"})
                return refusal
            except EngineError as e:
                return dialect.error(502, "engine_error", f"the inference engine failed: {e}")
            headers = {VERSION_HEADER: str(body.pop("_version")), RESPONSE_HEADER: body["id"]}
            if call.stream:
                return StreamingResponse(dialect.events(call, body), media_type="text/event-stream", headers=headers)
            return JSONResponse(body, headers=headers)

        return handle

    async def _answer(self, dialect: Dialect, state: _ClientState, request: Request) -> tuple[dict[str, Any], Any]:
        """Sample the call in its conversation, store it where consented, and write the reply."""
        call = dialect.read(await read_json(request), state.history)
        if call.chat.n != 1:
            raise GatewayError(400, "invalid_request", "the served policy answers one choice per call (n=1)")
        conversation = self._conversation(state, call.chat)
        if request.headers.get(CAPTURE_HEADER, "").strip().lower() in _OFF:
            conversation.captured = False  # its later calls carry this one's text: none of them is kept
            self.metrics.not_captured.labels("opted_out").inc()
        choices, prompt_tokens = await self.gateway.chat(conversation.episode, call.chat)
        spans = choices[0].spans
        version = spans[0][1] if spans else self.model_version  # the weights that sampled it (a swap may follow)
        body = dialect.answer(call, choices, prompt_tokens, self.engine.model_name, state.history)
        _trim(state.history.responses)
        if conversation.captured:
            await self._capture(state.client, conversation.episode, dialect, call.chat, choices[0], body["id"],
                                version)
        return {**body, "_version": version}, call

    def _conversation(self, state: _ClientState, request: ChatRequest) -> _Conversation:
        """The client's conversation this call continues (it sends one of its replies back), else a new one."""
        now = time.monotonic()
        for key, conversation in list(state.conversations.items()):
            if now - conversation.last > self.config.conversation_idle_s:
                del state.conversations[key]
        for key, conversation in reversed(state.conversations.items()):
            if self.gateway.continues(conversation.episode, request):
                conversation.last = now
                state.conversations.move_to_end(key)
                return conversation
        client = state.client
        captured = client.capture and random.random() < self.config.sample_rate
        if not client.capture:
            self.metrics.not_captured.labels("client").inc()
        elif not captured:
            self.metrics.not_captured.labels("sampled_out").inc()
        conversation = _Conversation(Episode(secrets.token_urlsafe(12)), captured)
        state.conversations[conversation.episode.key] = conversation
        while len(state.conversations) > self.config.conversations_per_client:
            state.conversations.popitem(last=False)
        return conversation

    async def _capture(self, client: Client, episode: Episode, dialect: Dialect, request: ChatRequest,
                       choice: Choice, response_id: str, version: int) -> None:
        """Store the call (redacted first, where a hook is set); it is durable when this returns."""
        segment = next(i for i, s in enumerate(episode.segments) if s.pending and s.pending[0] is choice)
        context_ids = list(episode.segments[segment].ids)
        messages, reply = request.chat(), openai_message(choice.message)
        reply_ids, logprobs, spans, redacted = choice.ids, choice.logprobs, choice.spans, False
        if self.config.redact is not None:
            try:
                kept = self.config.redact(copy.deepcopy([*messages, reply]))
                if not isinstance(kept, list) or len(kept) != len(messages) + 1:
                    raise TypeError(f"it returned {type(kept).__name__}, not the {len(messages) + 1} messages given")
            except Exception as e:  # fail closed: a call the hook could not clean is not kept
                log.error("the redaction hook failed (%s: %s): the call is not stored", type(e).__name__, e)
                self.metrics.not_captured.labels("redaction_failed").inc()
                return
            if kept != [*messages, reply]:
                redacted = True
                shown, template_tools = self.gateway.tool_prompt.apply(kept[:-1], request.tools)
                context_ids = self.tokenizer.prompt_ids([self.gateway.tool_prompt.as_written(m) for m in shown],
                                                        template_tools)
                if kept[-1] != reply:  # the reply's own tokens held what was removed: only its text is kept
                    reply_ids, logprobs, spans = [], [], []
                messages, reply = kept[:-1], kept[-1]
        route = dialect.route.rsplit("/", 1)[-1]
        await self.store.put(StoredCall(
            response_id=response_id, client=client.name, episode=episode.key, segment=segment,
            model_version=version, dialect=route, messages=messages, tools=request.tools, reply=reply,
            finish=choice.finish, context_ids=context_ids, reply_ids=list(reply_ids), logprobs=list(logprobs),
            version_spans=[list(s) for s in spans], redacted=redacted))
        self.metrics.captured.inc()
        if self.config.rubric is not None and random.random() < self.config.rubric_rate:
            task = asyncio.create_task(self._score(response_id, [*messages, reply]))
            self._scoring.add(task)
            task.add_done_callback(self._scoring.discard)

    async def _score(self, response_id: str, chat: list[Message]) -> None:
        """The rubric's score of a stored call, stored beside it; a rubric that fails leaves the call unscored."""
        assert self.config.rubric is not None  # scoring is started only with one
        try:
            score = await self.config.rubric.score(RubricEpisode(task=None, messages=chat))
        except RubricError as e:
            log.warning("the rubric could not score %s: %s", response_id, e)
            self.metrics.rubric.labels("failed").inc()
            return
        await self.store.rubric_score(response_id, score.value)
        self.metrics.rubric.labels("scored").inc()

    async def _models(self, request: Request) -> Response:
        try:
            self._client(request)
        except GatewayError as e:
            return openai_error(e.status, e.code, str(e))
        return models_list(self.engine.model_name)

    async def _feedback(self, request: Request) -> Response:
        """A client's score for one of its own responses; any other response id is unknown to it (404)."""
        try:
            state = self._client(request)
            feedback = parse(FeedbackRequest, await read_json(request))
            score = feedback.value()
            if not await self.store.feedback(feedback.response_id, state.client.name, score, feedback.text):
                raise GatewayError(404, "response_not_found", "no stored response with this id was served to this "
                                                              "key (calls not stored take no feedback)")
        except GatewayError as e:
            self.metrics.feedback.labels("refused").inc()
            return openai_error(e.status, e.code, str(e))
        self.metrics.feedback.labels("accepted").inc()
        return JSONResponse({"response_id": feedback.response_id, "score": score})

    def _admin(self, request: Request) -> bool:
        given = request_key(request) or ""
        return self.config.admin_key is not None and secrets.compare_digest(given, self.config.admin_key)

    async def _rollback(self, request: Request) -> Response:
        """Ask for an earlier weight version to serve again (admin key only): ``{"version": N}``, answered 202; the
        engine's owner swaps it in (a training run, between its rounds)."""
        if not self._admin(request):
            return openai_error(403, "forbidden", "a rollback needs the admin key")
        try:
            version = parse(RollbackRequest, await read_json(request)).version
        except GatewayError as e:
            return openai_error(e.status, e.code, str(e))
        known = self.config.versions() if self.config.versions is not None else []
        if version not in known:
            return openai_error(404, "version_not_found", f"no weight version {version} to roll back to; known: "
                                                          f"{known}")
        self.rollback_to = version
        return JSONResponse({"version": version, "status": "scheduled"}, status_code=202)

    async def _forget(self, name: str, request: Request) -> Response:
        """Delete one client's stored calls and feedback (admin key only)."""
        if not self._admin(request):
            return openai_error(403, "forbidden", "deleting a client's data needs the admin key")
        return JSONResponse({"client": name, "deleted": await self.store.forget(name)})


def _trim(responses: dict[str, Any]) -> None:
    while len(responses) > _RESPONSES_KEPT:
        del responses[next(iter(responses))]


class _Metrics:
    """What ``/metrics`` reports, in Prometheus's text format."""

    def __init__(self, server: PolicyServer) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("envkit_serving_requests", "Calls answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("envkit_serving_request_seconds", "Time to answer a call", ["route"],
                                 registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120))
        self.captured = Counter("envkit_serving_captured", "Calls stored", registry=self.registry)
        self.not_captured = Counter("envkit_serving_not_captured", "Calls or conversations not stored, and why",
                                    ["reason"], registry=self.registry)
        self.feedback = Counter("envkit_serving_feedback", "Feedback received", ["outcome"], registry=self.registry)
        self.rubric = Counter("envkit_serving_rubric", "Stored calls the rubric scored", ["outcome"],
                              registry=self.registry)
        Gauge("envkit_serving_inflight", "Calls being answered", registry=self.registry).set_function(
            lambda: server.active)
        Gauge("envkit_serving_model_version", "The weight version answering", registry=self.registry).set_function(
            lambda: server.model_version)

    def done(self, route: str, status: int, seconds: float) -> None:
        """Count one response the server sent."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    async def endpoint(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
