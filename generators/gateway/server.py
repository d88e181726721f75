"""The capture gateway's core: how a call is sampled in its episode and linked into the episode's token sequences
(:class:`Gateway`; the episodes and segments themselves are in :mod:`.types`); the package docstring says what it
records and why."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from envkit import Message, tracing
from envkit.agents.agent import AgentClient
from generators.chat import LONG_TEXT
from generators.engines.base import InferenceEngine, SamplingParams, generate_turn, request_seed
from generators.engines.replicas import rollout_session
from generators.gateway.app import build_app
from generators.gateway.types import ChatRequest, Choice, Episode, GatewayError, Segment
from generators.parsers import OutputParser
from generators.tool_prompt import ToolPrompt, ToolSchemas
from generators.trajectory import mark_version

if TYPE_CHECKING:
    import uvicorn

    from generators.chat import ChatTokenizer

log = logging.getLogger(__name__)

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
        self._protocol: Callable[[], asyncio.Protocol] | None = None
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
        # uvicorn takes its sockets once, at start: each episode's channel is one more listening socket speaking
        # this server's protocol, so its connections are this server's (closed at its shutdown) and each request's
        # scope["server"] names the port it came in on.
        self._protocol = functools.partial(config.http_protocol_class, config=config,
                                           server_state=self._server.server_state,
                                           app_state=self._server.lifespan.state)

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
        assert self._protocol is not None, "start the gateway first"
        episode = Episode(secrets.token_urlsafe(18), trace=tracing.carrier())
        self.episodes[episode.key] = episode
        sock = socket.socket()
        sock.bind((self.host, 0))
        sock.listen(64)  # connections wait in the backlog until the server below accepts them
        episode.channel_port = sock.getsockname()[1]
        self._channels[episode.channel_port] = episode
        episode.channel = asyncio.ensure_future(asyncio.get_running_loop().create_server(self._protocol, sock=sock))
        return episode

    def client(self, episode: Episode) -> AgentClient:
        """What ``episode``'s agent connects with."""
        return AgentClient(base_url=f"{self.url}/v1", api_key=episode.key, model=self.engine.model_name,
                           episode_url=f"{self.url}/e/{episode.key}/v1",
                           channel_url=f"http://{self._announced}:{episode.channel_port}",
                           traceparent=episode.trace.get("traceparent"))

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

    async def chat(self, episode: Episode, request: ChatRequest) -> tuple[list[Choice], int]:
        """Sample ``request``'s choices in ``episode``; returns them and the prompt's length in tokens."""
        async with episode.lock:  # one call of an episode at a time: segments grow in call order
            if episode.calls >= self.limits.max_calls:
                episode.stop = "max_turns"
                raise GatewayError(429, "call_limit", f"this episode may call the model {self.limits.max_calls} "
                                                      "times (generator.max_turns)")
            chat = request.chat()
            size = self._bounded(chat)
            messages, template_tools = self.tool_prompt.apply(chat, request.tools)
            if size > LONG_TEXT:  # its tokenizing would hold up every other call on this loop
                segment = await asyncio.to_thread(self._continue, episode, messages, template_tools, request.tools)
            else:
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

    def _bounded(self, chat: list[Message]) -> int:
        """The UTF-8 bytes of the chat's text; a prompt whose text alone is too long for the call's token budget is
        refused before it is tokenized, which would take seconds (a 5 MB prompt: 15 s)."""
        size = sum(len((m.get("content") or "").encode("utf-8")) for m in chat)
        if size > self.limits.max_total_tokens * self.tokenizer.max_text_bytes_per_token:
            raise GatewayError(400, "context_length_exceeded", f"the prompt's text is {size} bytes, more than "
                                                               f"{self.limits.max_total_tokens} tokens hold")
        return size

    def continues(self, episode: Episode, request: ChatRequest) -> bool:
        """Whether ``request`` continues one of ``episode``'s segments (sends a reply back with new messages)."""
        messages, _ = self.tool_prompt.apply(request.chat(), request.tools)
        return any(s.continued_by(messages, request.tools) for s in episode.segments)

    def _continue(self, episode: Episode, messages: list[Message], template_tools: ToolSchemas | None,
                  tools: ToolSchemas | None) -> Segment:
        """The segment this call extends, its new messages appended as observation tokens; else a new segment."""
        for segment in reversed(episode.segments):
            chosen = segment.continued_by(messages, tools)
            if chosen is None:
                continue
            new = messages[len(segment.messages) + 1:]
            observation = self.tokenizer.close_turn(chosen.ids) + _rendered(self.tokenizer.observation_ids, new,
                                                                            template_tools)
            episode.segments += [segment.branch(c) for c in segment.pending if c is not chosen]
            segment.pending = []
            segment.take(chosen)
            segment.response_ids += observation
            segment.loss_mask += [0] * len(observation)
            segment.rollout_logprobs += [0.0] * len(observation)
            segment.messages = [*segment.messages, *new]
            if self.limits.check_template and self.tokenizer.render(self._as_written(segment),
                                                                    template_tools) != segment.ids:
                episode.skewed += 1
            return segment
        written = [self.tool_prompt.as_written(m) for m in messages]
        segment = Segment(list(messages), template_tools, tools, _rendered(self.tokenizer.prompt_ids, written,
                                                                           template_tools))
        episode.segments.append(segment)
        return segment

    def _as_written(self, segment: Segment) -> list[Message]:
        return [{"role": "assistant", "content": segment.written[i]} if i in segment.written
                else self.tool_prompt.as_written(m) for i, m in enumerate(segment.messages)]

    async def _sample(self, episode: Episode, segment: Segment, sampling: SamplingParams, k: int) -> Choice:
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
        return Choice(ids, logprobs, spans, text, message, part.finish_reason, part.stop_string)


def _rendered(render: Callable[[list[Message], ToolSchemas | None], list[int]], messages: list[Message],
              tools: ToolSchemas | None) -> list[int]:
    """``render``'s token ids for ``messages``; a chat the template cannot render is the caller's to change (400),
    found before the episode changes."""
    try:
        return render(messages, tools)
    except Exception as e:  # a template is code of its own: whatever it raises on this chat
        raise GatewayError(400, "invalid_request", "the chat template cannot render these messages "
                                                   f"({type(e).__name__}: {e})") from None


def _close_server(started: asyncio.Future[asyncio.Server]) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result().close()
