"""The capture gateway: an OpenAI-compatible server in front of the run's engine, recording exactly what the policy
sampled for agents that run their own loop (:class:`envkit.agent.AgentEnv`).

Each episode gets its own API key (also usable in the path: ``/e/KEY/v1``). A ``/v1/chat/completions`` call is
rendered by the model's chat template, with the tools written into the system message where the template drops them
(as the rollout loop does), sampled token-in/token-out on the engine, and recorded: prompt ids, sampled ids and their
logprobs, finish reason, tool calls, weight version. Sampling uses the run's settings, not the request's temperature
or seed: a training run must sample from the policy it trains. ``max_tokens`` (capped by the run's) and ``stop``
are honoured; as in OpenAI's API, a reply leaves out the stop string that ended it (its tokens stay in the
sequence: they were sampled).

``/v1/responses`` (:mod:`generators.responses_api`) and Anthropic's ``/v1/messages``
(:mod:`generators.anthropic_api`) are read as the chat completions call they describe, and answered in their own
shape.

**Segments.** A call whose messages are an earlier call's messages, then the reply the gateway gave, then new
messages continues that call's segment: the reply's sampled ids go in with loss mask 1, and the new messages as
observation tokens with loss mask 0, exactly as the rollout loop appends an env's turn, so nothing the model sampled
is ever re-tokenized. Any other call (a compressed context, a sub-agent, an edited history) starts a new segment of
the episode, and so does each choice of an ``n > 1`` call that the agent did not continue. Every segment trains as
a sequence of its own with the episode's reward and advantage (advantages are computed over a group's episodes; an
episode's segments share its advantage).

**Skew.** After each linked call, the whole chat is also rendered from scratch; where that differs from the linked
ids the call counts as skewed (``Trajectory.template_mismatches``). It is measured, never fixed up.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from envkit import Message
from envkit.agent import AgentClient
from generators.anthropic_api import MessagesRequest, message_body
from generators.anthropic_api import stream as anthropic_stream
from generators.engines.base import EngineError, InferenceEngine, SamplingParams, generate_turn, request_seed
from generators.engines.replicas import Session, rollout_session
from generators.parsers import OutputParser
from generators.responses_api import ResponsesRequest, UnsupportedInput, response_body
from generators.responses_api import stream as responses_stream
from generators.tool_prompt import ToolPrompt, ToolSchemas
from generators.trajectory import StopReason, mark_version

if TYPE_CHECKING:
    import uvicorn

    from generators.chat import ChatTokenizer

log = logging.getLogger(__name__)

_ROLES = ("system", "developer", "user", "assistant", "tool")
_Body = TypeVar("_Body", bound=BaseModel)
KEEP_ALIVE_S = 120
"""How long the gateway keeps an agent's idle connection open: longer than the clients' own expiry (httpx, and so
the openai SDK, drop theirs after 5 s), so no client sends a call on a connection the gateway is closing at that
moment. With uvicorn's default, also 5 s, an agent whose loop stalls that long (a loaded machine) can lose a call to
"Server disconnected without sending a response", and an agent without retries its episode."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one episode may spend, and how it samples (the run's generator settings)."""

    sampling: SamplingParams
    max_calls: int
    """Model calls per episode (``generator.max_turns``)."""
    max_total_tokens: int
    """Prompt plus completion tokens of one call (``generator.max_total_tokens``)."""
    check_template: bool = True
    """Render each linked call's chat from scratch and count a difference as skew (``generator.check_template``)."""


class GatewayError(Exception):
    """A request the gateway refuses: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Choice:
    """One sampled reply, until the agent continues it (or the episode ends)."""

    ids: list[int]
    logprobs: list[float]
    spans: list[list[int]]
    """``[offset in ids, weight version]`` wherever the version changes."""
    text: str
    message: Message
    finish: str
    stop_string: str | None


@dataclass
class Segment:
    """One token sequence of an episode: a prompt and everything after it, as the trainer takes it."""

    messages: list[Message]
    """The chat as the model saw it (tool prompt applied), through the last call."""
    template_tools: ToolSchemas | None
    tools: ToolSchemas | None
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    version_spans: list[list[int]] = field(default_factory=list)
    written: dict[int, str] = field(default_factory=dict)
    """What the model wrote, by the index of its reply in ``messages``."""
    pending: list[_Choice] = field(default_factory=list)
    """The last call's choices, not yet in the sequence."""

    @property
    def ids(self) -> list[int]:
        """The running context: prompt plus response."""
        return self.prompt_ids + self.response_ids

    def take(self, choice: _Choice) -> None:
        """Append ``choice``'s sampled tokens (loss mask 1) and record what it wrote."""
        for offset, version in choice.spans:
            mark_version(self.version_spans, len(self.response_ids) + offset, version)
        self.response_ids += choice.ids
        self.loss_mask += [1] * len(choice.ids)
        self.rollout_logprobs += choice.logprobs
        self.written[len(self.messages)] = choice.text
        self.messages = [*self.messages, choice.message]

    def branch(self, choice: _Choice) -> Segment:
        """A copy of this segment (before its pending choices) continued by ``choice``."""
        copy = Segment(list(self.messages), self.template_tools, self.tools, list(self.prompt_ids),
                       list(self.response_ids), list(self.loss_mask), list(self.rollout_logprobs),
                       [list(s) for s in self.version_spans], dict(self.written))
        copy.take(choice)
        return copy

    def sequence(self) -> dict[str, Any]:
        """The segment as trainer data (:attr:`generators.trajectory.Trajectory.segments` entries)."""
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "rollout_logprobs": self.rollout_logprobs, "version_spans": self.version_spans}


@dataclass
class Episode:
    """What the gateway recorded for one agent episode."""

    key: str
    segments: list[Segment] = field(default_factory=list)
    """Its segments (the last call of each may have pending choices)."""
    calls: int = 0
    skewed: int = 0
    """Linked calls whose from-scratch rendering differs from the linked ids."""
    tool_log: list[dict[str, Any]] = field(default_factory=list)
    stop: StopReason | None = None
    """Set when a budget refused a call (max_turns, max_tokens)."""
    last_cut: bool = False
    """Whether the token limit cut the last call's reply (an SDK may raise on it)."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Each ``/v1/responses`` reply's chat through it, by response id (for ``previous_response_id``)."""
    generate_s: float = 0.0
    refused: int = 0
    """Calls on this episode's channel that were refused: another episode's key, an unknown or an ended one."""
    channel: asyncio.Future[asyncio.Server] | None = None
    """Its own port's server (see :meth:`Gateway.open`)."""
    channel_port: int = 0
    session: Session = field(default_factory=Session)
    """Sticky routing: a replicated engine sends all of this episode's calls to one replica."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def end(self) -> list[Segment]:
        """The episode's segments, each pending choice taken: the first by its own segment, the others as
        branches."""
        branches = []
        for segment in self.segments:
            choices, segment.pending = segment.pending, []
            branches += [segment.branch(c) for c in choices[1:]]
            if choices:
                segment.take(choices[0])
        return [s for s in self.segments + branches if any(s.loss_mask)]


MAX_STOPS = 4
"""Stop strings a call may ask for: OpenAI's limit, and vLLM's (past it the engine would answer 400, a 502 here)."""
ANY_HOST = ("0.0.0.0", "")
"""Hosts that mean every interface."""


def node_address() -> str:
    """This node's address on its default route, as other nodes reach it (loopback where it has no route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.254.254.254", 1))  # no packet is sent: this only picks the outgoing interface
        except OSError:
            return "127.0.0.1"
        return probe.getsockname()[0]


class Gateway:
    """The server. ``async with Gateway(...)``; :meth:`open` an episode, hand the agent :meth:`client`, :meth:`end`
    it when the agent returns."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, parser: OutputParser,
                 tool_prompt: ToolPrompt, limits: Limits, *, host: str = "127.0.0.1") -> None:
        if not engine.supports_token_ids:
            raise ValueError(f"the capture gateway samples token ids; {type(engine).__name__} cannot")
        self.engine, self.tokenizer, self.parser, self.tool_prompt = engine, tokenizer, parser, tool_prompt
        self.limits = limits
        self.host = host
        self.episodes: dict[str, Episode] = {}
        self._ended: set[str] = set()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0
        self._announced = host
        self._channels: dict[int, Episode] = {}
        self.refused = 0
        """Calls refused for their key, on any port (each channel's are also its episode's)."""

    @property
    def url(self) -> str:
        """The server's root URL: at ``host``, or at this node's address where ``host`` is every interface."""
        return f"http://{self._announced}:{self.port}"

    async def start(self) -> None:
        """Serve on a free port of ``host`` (``0.0.0.0``: every interface)."""
        import uvicorn

        sock = socket.socket()
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        self._announced = node_address() if self.host in ANY_HOST else self.host
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task
                raise RuntimeError("the capture gateway stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop serving; idempotent."""
        for episode in list(self._channels.values()):
            self._close_channel(episode)
        if self.refused:
            log.warning("the capture gateway refused %d calls for their key (another episode's, an ended or an "
                        "unknown one): an agent reaching for what is not its own", self.refused)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def open(self) -> Episode:
        """A new episode with a key of its own, and a port of its own (its channel) that refuses every other key:
        where an isolated agent process is relayed, so a key it learns of cannot be spent there."""
        assert self._server is not None, "start the gateway first"
        episode = Episode(secrets.token_urlsafe(18))
        self.episodes[episode.key] = episode
        sock = socket.socket()
        sock.bind((self.host, 0))
        sock.listen(64)  # connections wait in the backlog until the server below accepts them
        episode.channel_port = sock.getsockname()[1]
        self._channels[episode.channel_port] = episode
        # uvicorn takes its sockets once, at start: each channel is one more listening socket speaking the same
        # server's protocol, so its connections are that server's (closed at its shutdown) and each request's
        # scope["server"] names the port it came in on.
        config, server = self._server.config, self._server
        protocol: Any = functools.partial(config.http_protocol_class, config=config, server_state=server.server_state,
                                          app_state=server.lifespan.state)
        episode.channel = asyncio.ensure_future(asyncio.get_running_loop().create_server(protocol, sock=sock))
        return episode

    def client(self, episode: Episode) -> AgentClient:
        """What ``episode``'s agent connects with."""
        return AgentClient(base_url=f"{self.url}/v1", api_key=episode.key, model=self.engine.model_name,
                           episode_url=f"{self.url}/e/{episode.key}/v1",
                           channel_url=f"http://{self._announced}:{episode.channel_port}")

    def end(self, episode: Episode) -> list[Segment]:
        """End ``episode``: its calls from now on get 409. Returns its segments."""
        self.episodes.pop(episode.key, None)
        self._ended.add(episode.key)
        self._close_channel(episode)
        return episode.end()

    def _close_channel(self, episode: Episode) -> None:
        self._channels.pop(episode.channel_port, None)
        if episode.channel is not None:
            episode.channel.add_done_callback(_close_server)

    def episode(self, key: str | None, port: int | None = None) -> Episode:
        """The open episode with ``key``, called on ``port``: a channel's own episode only."""
        channel = self._channels.get(port or 0)
        try:
            if channel is not None and key != channel.key:
                raise GatewayError(403, "key_not_for_this_channel", "this port serves one episode; the key given "
                                                                    "is not its key")
            if key in self._ended:
                raise GatewayError(409, "episode_ended", "this episode has ended; its agent may not call the model "
                                                         "any more")
            episode = self.episodes.get(key or "")
            if episode is None:
                raise GatewayError(401, "invalid_api_key", "unknown episode key: use the api_key (or the /e/KEY/v1 "
                                                           "base URL) the gateway gave this episode's agent")
        except GatewayError:
            self.refused += 1
            if channel is not None:
                channel.refused += 1
            raise
        return episode

    async def chat(self, episode: Episode, request: ChatRequest) -> tuple[list[_Choice], int]:
        """Sample ``request``'s choices in ``episode``; returns them and the prompt's length in tokens."""
        async with episode.lock:  # one call of an episode at a time: segments grow in call order
            if episode.calls >= self.limits.max_calls:
                episode.stop = "max_turns"
                raise GatewayError(429, "call_limit", f"this episode may call the model {self.limits.max_calls} "
                                                      "times (generator.max_turns)")
            messages, template_tools = self.tool_prompt.apply(request.chat(), request.tools)
            segment = self._continue(episode, messages, template_tools, request.tools)
            budget = self.limits.max_total_tokens - len(segment.ids)
            if budget <= 0:
                episode.stop = "max_tokens"
                raise GatewayError(400, "context_length_exceeded", f"the prompt is {len(segment.ids)} tokens; this "
                                   f"episode allows {self.limits.max_total_tokens} per call with its completion")
            episode.calls += 1
            sampling = replace(self.limits.sampling, max_tokens=min(request.token_limit(self.limits.sampling),
                                                                    budget), stop=request.stops())
            token = rollout_session.set(episode.session)
            t0 = time.perf_counter()
            try:
                choices = await asyncio.gather(*(self._sample(episode, segment, sampling, k)
                                                 for k in range(request.n)))
            finally:
                rollout_session.reset(token)
                episode.generate_s += time.perf_counter() - t0
            segment.pending = list(choices)
            episode.last_cut = any(c.finish == "length" for c in choices)
            for choice in choices:
                calls = choice.message.get("tool_calls") or []
                episode.tool_log += [{"turn": episode.calls, "name": c["function"]["name"], "status": "unknown"}
                                     for c in calls]
                episode.tool_log += [{"turn": episode.calls, "name": None, "status": "unparsed"}
                                     for _ in choice.message.get("tool_call_errors") or []]
            return list(choices), len(segment.ids)

    def _continue(self, episode: Episode, messages: list[Message], template_tools: ToolSchemas | None,
                  tools: ToolSchemas | None) -> Segment:
        """The segment this call extends, its new messages appended as observation tokens; else a new segment."""
        for segment in reversed(episode.segments):
            if segment.tools != tools:
                continue
            at = len(segment.messages)
            matching = [c for c in segment.pending if at < len(messages) and _same(messages[at], c.message)]
            if not matching or not _same_chat(messages[:at], segment.messages) or len(messages) == at + 1:
                continue
            chosen = matching[0]
            episode.segments += [segment.branch(c) for c in segment.pending if c is not chosen]
            segment.pending = []
            segment.take(chosen)
            new = messages[at + 1:]
            observation = self.tokenizer.close_turn(chosen.ids) + self.tokenizer.observation_ids(new, template_tools)
            segment.response_ids += observation
            segment.loss_mask += [0] * len(observation)
            segment.rollout_logprobs += [0.0] * len(observation)
            segment.messages = [*segment.messages, *new]
            if self.limits.check_template and self.tokenizer.render(self._as_written(segment),
                                                                    template_tools) != segment.ids:
                episode.skewed += 1
            return segment
        written = [self.tool_prompt.as_written(m) for m in messages]
        segment = Segment(list(messages), template_tools, tools, self.tokenizer.prompt_ids(written, template_tools))
        episode.segments.append(segment)
        return segment

    def _as_written(self, segment: Segment) -> list[Message]:
        return [{"role": "assistant", "content": segment.written[i]} if i in segment.written
                else self.tool_prompt.as_written(m) for i, m in enumerate(segment.messages)]

    async def _sample(self, episode: Episode, segment: Segment, sampling: SamplingParams, k: int) -> _Choice:
        ids: list[int] = []
        logprobs: list[float] = []
        spans: list[list[int]] = []

        def seeded(params: SamplingParams, continuation: int) -> SamplingParams:
            if params.seed is None:
                return params
            return replace(params, seed=request_seed(params.seed, episode.key, episode.calls, k, continuation))

        async for part in generate_turn(self.engine, segment.ids, sampling, seeded):
            if part.token_ids or part.finish_reason != "abort":  # stopped before its first token: no token has it
                mark_version(spans, len(ids), part.weight_version)
            ids += part.token_ids
            logprobs += part.logprobs
        text = self.tokenizer.decode(ids)
        # The reply leaves out the stop string that ended it, as OpenAI's and Anthropic's APIs do (a ReAct agent
        # stopping at "Observation:" writes its own); the sequence keeps every token sampled.
        shown = text.partition(part.stop_string)[0] if part.stop_string else text
        message = self.parser.parse(shown, segment.tools)
        for i, call in enumerate(message.get("tool_calls") or []):  # unique within the episode: agents key on ids
            call["id"] = f"call_{episode.calls}_{k}_{i}"
        return _Choice(ids, logprobs, spans, text, message, part.finish_reason, part.stop_string)


# ------------------------------------------------------------------------------------------------ the HTTP API


class ChatRequest(BaseModel):
    """The part of an OpenAI chat completions request the gateway reads (other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stop)}")
        return stop

    def chat(self) -> list[Message]:
        """The messages in the envkit form: roles checked, text parts joined, developer read as system."""
        out: list[Message] = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            if role not in _ROLES:
                raise GatewayError(400, "invalid_message", f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                                                           f"got {role!r}")
            message: Message = {"role": "system" if role == "developer" else role,
                                "content": _text(m.get("content"), f"messages[{i}].content")}
            if role == "assistant" and m.get("tool_calls"):
                message["tool_calls"] = _tool_calls(m["tool_calls"], i)
            if role == "tool":
                message["tool_call_id"] = str(m.get("tool_call_id") or "")
            out.append(message)
        return out

    def token_limit(self, sampling: SamplingParams) -> int:
        """The completion's token limit: the request's, at most the run's."""
        asked = self.max_completion_tokens or self.max_tokens
        return min(asked, sampling.max_tokens) if asked else sampling.max_tokens

    def stops(self) -> tuple[str, ...]:
        """The stop strings asked for."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "input_text",
                                                                                   "output_text") for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise GatewayError(400, "invalid_message", f"{where} must be a string or a list of text parts; the policy reads "
                                               "text only")


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    try:
        return [{"id": str(c.get("id", "")), "type": "function",
                 "function": {"name": str(c["function"]["name"]), "arguments": str(c["function"].get("arguments")
                                                                                   or "{}")}} for c in calls]
    except (KeyError, TypeError, AttributeError):
        raise GatewayError(400, "invalid_message", f"messages[{i}].tool_calls must be a list of "
                                                   '{"function": {"name", "arguments"}} objects') from None


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return call["function"]["arguments"]


def _same(sent: Message, ours: Message) -> bool:
    """Whether a message the agent sent back is the reply the gateway gave (content up to outer whitespace; calls
    by name and arguments)."""
    if sent["role"] != ours["role"] or (sent.get("content") or "").strip() != (ours.get("content") or "").strip():
        return False
    a, b = sent.get("tool_calls") or [], ours.get("tool_calls") or []
    return len(a) == len(b) and all(x["function"]["name"] == y["function"]["name"] and _arguments(x) == _arguments(y)
                                    for x, y in zip(a, b, strict=True))


def _same_chat(sent: list[Message], ours: list[Message]) -> bool:
    return len(sent) == len(ours) and all(_same(a, b) and (a.get("tool_call_id") or "") == (b.get("tool_call_id")
                                                                                           or "")
                                          for a, b in zip(sent, ours, strict=True))


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise GatewayError(400, "invalid_request", "the body is not JSON") from None


def _parse(model: type[_Body], data: Any) -> _Body:
    """``data`` as a ``model`` request, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        detail = e.errors()[0]
        where = ".".join(str(p) for p in detail.get("loc", ()))
        raise GatewayError(400, "invalid_request", f"{where}: {detail['msg']}" if where else detail["msg"]) from None


def _no_retry(status: int) -> dict[str, str]:
    """The header that keeps the OpenAI and Anthropic SDKs from retrying a refusal (by default they retry 409 and
    429, with back-off: a finished episode's agent would wait seconds to be refused again)."""
    return {"x-should-retry": "false"} if status < 500 else {}


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "code": code}}, status_code=status, headers=_no_retry(status))


_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 409: "invalid_request_error",
                     429: "rate_limit_error"}


def _anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"),
                                                    "message": message}}, status_code=status,
                        headers=_no_retry(status))


def _response(choices: list[_Choice], prompt_tokens: int, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "message": _openai_message(c.message), "logprobs": None,
                     "finish_reason": _finish(c)} for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(c.ids) for c in choices),
                  "total_tokens": prompt_tokens + sum(len(c.ids) for c in choices)},
    }


def _openai_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
        out["content"] = out["content"] or None
    return out


def _finish(choice: _Choice) -> str:
    if choice.message.get("tool_calls"):
        return "tool_calls"
    return "length" if choice.finish == "length" else "stop"


async def _stream(body: dict[str, Any], usage: bool) -> AsyncIterator[str]:
    """The response as server-sent chunks: each choice's whole message in one delta (the gateway samples a call at
    once), then its finish reason, then the usage when asked for."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    for choice in body["choices"]:
        delta: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"]}
        if "tool_calls" in choice["message"]:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
        yield f"data: {json.dumps({**head, 'choices': [{'index': choice['index'], 'delta': delta}]})}\n\n"
        done = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps({**head, 'choices': [done]})}\n\n"
    if usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def _close_server(started: asyncio.Future[asyncio.Server]) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result().close()


def build_app(gateway: Gateway) -> FastAPI:
    """The gateway's routes: ``/v1/chat/completions``, ``/v1/responses``, Anthropic's ``/v1/messages`` and
    ``/v1/models``, also under ``/e/{key}``."""
    app = FastAPI(title="envkit capture gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def episode_of(request: Request, key: str | None) -> Episode:
        if key is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
        server = request.scope.get("server")
        return gateway.episode(key, server[1] if server else None)

    async def chat(request: Request, key: str | None = None) -> Response:
        try:
            episode = episode_of(request, key)
            body = _parse(ChatRequest, await _json(request))
            choices, prompt_tokens = await gateway.chat(episode, body)
        except GatewayError as e:
            return _error(e.status, e.code, str(e))
        except EngineError as e:
            return _error(502, "engine_error", f"the inference engine failed: {e}")
        out = _response(choices, prompt_tokens, gateway.engine.model_name)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(out, usage), media_type="text/event-stream")
        return JSONResponse(out)

    async def responses(request: Request, key: str | None = None) -> Response:
        try:
            episode = episode_of(request, key)
            body = _parse(ResponsesRequest, await _json(request))
            earlier = episode.responses.get(body.previous_response_id or "", [])
            if body.previous_response_id and not earlier:
                raise GatewayError(400, "previous_response_not_found", f"no response {body.previous_response_id!r} "
                                   "in this episode")
            try:
                chat_body = body.chat_body(earlier)
            except UnsupportedInput as e:
                raise GatewayError(400, "unsupported", str(e)) from None
            (choice,), prompt_tokens = await gateway.chat(episode, _parse(ChatRequest, chat_body))
        except GatewayError as e:
            return _error(e.status, e.code, str(e))
        except EngineError as e:
            return _error(502, "engine_error", f"the inference engine failed: {e}")
        out = response_body(choice.message, truncated=choice.finish == "length", prompt_tokens=prompt_tokens,
                            completion_tokens=len(choice.ids), model=gateway.engine.model_name, request=body)
        episode.responses[out["id"]] = body.history(chat_body, _openai_message(choice.message))
        if body.stream:
            return StreamingResponse(responses_stream(out), media_type="text/event-stream")
        return JSONResponse(out)

    async def messages(request: Request, key: str | None = None) -> Response:
        try:
            episode = episode_of(request, key)
            body = _parse(MessagesRequest, await _json(request))
            try:
                chat_body = body.chat_body()
            except UnsupportedInput as e:
                raise GatewayError(400, "unsupported", str(e)) from None
            (choice,), prompt_tokens = await gateway.chat(episode, _parse(ChatRequest, chat_body))
        except GatewayError as e:
            return _anthropic_error(e.status, str(e))
        except EngineError as e:
            return _anthropic_error(502, f"the inference engine failed: {e}")
        out = message_body(choice.message, finish=choice.finish, stop_sequence=choice.stop_string,
                           prompt_tokens=prompt_tokens, completion_tokens=len(choice.ids),
                           model=gateway.engine.model_name)
        if body.stream:
            return StreamingResponse(anthropic_stream(out), media_type="text/event-stream")
        return JSONResponse(out)

    async def models(request: Request, key: str | None = None) -> Response:
        try:
            episode_of(request, key)
        except GatewayError as e:
            return _error(e.status, e.code, str(e))
        return JSONResponse({"object": "list", "data": [{"id": gateway.engine.model_name, "object": "model",
                                                         "created": 0, "owned_by": "envkit"}]})

    for prefix in ("", "/e/{key}"):
        app.add_api_route(prefix + "/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route(prefix + "/v1/responses", responses, methods=["POST"])
        app.add_api_route(prefix + "/v1/messages", messages, methods=["POST"])
        app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
    return app

