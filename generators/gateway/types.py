"""The capture gateway's shared types, one floor below its modules: the refusals (:class:`GatewayError`), the chat
completions request every dialect's call is read into (:class:`ChatRequest`), and the episodes calls are sampled in
(:class:`Episode`, its :class:`Segment` token sequences and their pending :class:`Choice` replies). The dialects,
the routes and the server all name them, and the server imports the routes: so they live here, each still importable
from its old module (:mod:`.dialect`, :mod:`.chat`, :mod:`.server`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from envkit import Message
from generators.engines.replicas import Session
from generators.tool_prompt import ToolSchemas
from generators.trajectory import StopReason, mark_version

if TYPE_CHECKING:
    from generators.engines.base import SamplingParams


class GatewayError(Exception):
    """A request the gateway refuses: answered with ``status``, ``code`` and the message, in the dialect's error
    shape."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class UnsupportedInput(GatewayError):
    """A request the gateway cannot serve through the policy (a hosted tool, an image block): answered 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, "unsupported", message)


ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
"""Stop strings a call may ask for: OpenAI's limit, and vLLM's (past it the engine would answer 400, a 502 here)."""


class FunctionSchema(BaseModel):
    """A tool's function, as OpenAI's API takes it: a name, what it does, and its parameters' JSON schema (an
    object's)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is None:
            return None
        if parameters.get("type", "object") != "object":
            raise ValueError(f"the parameters' schema must be of type object, not {parameters['type']!r}")
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
            raise ValueError("the parameters' properties must be an object of schemas")
        return parameters


class FunctionTool(BaseModel):
    """One entry of a chat request's ``tools``."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionSchema


_TOOLS = TypeAdapter(list[FunctionTool])


class ChatRequest(BaseModel):
    """The part of an OpenAI chat completions request the gateway reads (other fields are accepted and ignored).
    Strict: a number sent as a string, or a boolean, is refused rather than read as one."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools is not None:
            try:
                _TOOLS.validate_python(tools)
            except ValidationError as e:
                detail = e.errors()[0]
                raise ValueError(f"{'.'.join(map(str, detail['loc']))}: {detail['msg']}") from None
        return tools

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
            if role not in ROLES:
                raise GatewayError(400, "invalid_message", f"messages[{i}].role must be one of {', '.join(ROLES)}, "
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


@dataclass
class Choice:
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
    pending: list[Choice] = field(default_factory=list)
    """The last call's choices, not yet in the sequence."""

    @property
    def ids(self) -> list[int]:
        """The running context: prompt plus response."""
        return self.prompt_ids + self.response_ids

    def take(self, choice: Choice) -> None:
        """Append ``choice``'s sampled tokens (loss mask 1) and record what it wrote."""
        for offset, version in choice.spans:
            mark_version(self.version_spans, len(self.response_ids) + offset, version)
        self.response_ids += choice.ids
        self.loss_mask += [1] * len(choice.ids)
        self.rollout_logprobs += choice.logprobs
        self.written[len(self.messages)] = choice.text
        self.messages = [*self.messages, choice.message]

    def continued_by(self, messages: list[Message], tools: ToolSchemas | None) -> Choice | None:
        """The pending choice that ``messages`` (a call's chat, tool prompt applied) send back, followed by new
        messages: the call continues this segment with it. None where the call does not."""
        at = len(self.messages)
        if self.tools != tools or len(messages) <= at + 1 or not _same_chat(messages[:at], self.messages):
            return None
        return next((c for c in self.pending if _same(messages[at], c.message)), None)

    def branch(self, choice: Choice) -> Segment:
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
    trace: dict[str, str] = field(default_factory=dict)
    """The trace context it was opened in (its rollout's): its calls are spans there, whatever process made them."""

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
