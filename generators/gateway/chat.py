"""OpenAI's chat completions API (``POST /v1/chat/completions``, JSON or streamed): the gateway's own request form,
which every other dialect is read into (:class:`ChatRequest`), and the dialect that speaks it."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from envkit import Message
from generators.gateway.dialect import Call, GatewayError, no_retry, parse

if TYPE_CHECKING:
    from generators.engines.base import SamplingParams
    from generators.gateway.server import Choice, Episode

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
"""Stop strings a call may ask for: OpenAI's limit, and vLLM's (past it the engine would answer 400, a 502 here)."""


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


def openai_message(message: Message) -> dict[str, Any]:
    """A sampled reply as an OpenAI assistant message."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
        out["content"] = out["content"] or None
    return out


def _finish(choice: Choice) -> str:
    if choice.message.get("tool_calls"):
        return "tool_calls"
    return "length" if choice.finish == "length" else "stop"


class ChatCompletions:
    """The chat completions dialect: ``n`` choices, ``stop``, ``stream_options.include_usage``."""

    route = "/v1/chat/completions"

    def read(self, body: Any, episode: Episode) -> Call:
        chat = parse(ChatRequest, body)
        return Call(chat, chat.stream)

    def answer(self, call: Call, choices: list[Choice], prompt_tokens: int, model: str,
               episode: Episode) -> dict[str, Any]:
        completion_tokens = sum(len(c.ids) for c in choices)
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": i, "message": openai_message(c.message), "logprobs": None,
                         "finish_reason": _finish(c)} for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    async def events(self, call: Call, body: dict[str, Any]) -> AsyncIterator[str]:
        """Each choice's whole message in one delta (the gateway samples a call at once), then its finish reason,
        then the usage when asked for."""
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for choice in body["choices"]:
            delta: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"]}
            if "tool_calls" in choice["message"]:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
            yield f"data: {json.dumps({**head, 'choices': [{'index': choice['index'], 'delta': delta}]})}\n\n"
            done = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
            yield f"data: {json.dumps({**head, 'choices': [done]})}\n\n"
        if (call.chat.stream_options or {}).get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"

    def error(self, status: int, code: str, message: str) -> JSONResponse:
        return openai_error(status, code, message)


def openai_error(status: int, code: str, message: str) -> JSONResponse:
    """A refusal in OpenAI's error shape (chat completions and Responses share it)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "code": code}}, status_code=status, headers=no_retry(status))
