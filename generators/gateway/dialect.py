"""What a dialect of the gateway is (:class:`Dialect`), and what every dialect shares: the error a request is refused
with (:class:`~generators.gateway.types.GatewayError`), the request body read into a pydantic model, tool schemas in
the chat form, server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from generators.gateway.body import read_json as read_json  # its home was here: still importable
from generators.gateway.types import ChatRequest, Choice, Episode, GatewayError
from generators.gateway.types import UnsupportedInput as UnsupportedInput  # its home was here: still importable

_Body = TypeVar("_Body", bound=BaseModel)


@dataclass(frozen=True)
class Call:
    """One request, read: the chat completions call it describes, whether it is streamed, and the dialect's own
    request (what its answer echoes)."""

    chat: ChatRequest
    stream: bool
    request: Any = None


class Dialect(Protocol):
    """One API the gateway speaks at :attr:`route` (and under ``/e/KEY``). Every call is a chat completions call
    underneath: the dialect reads its request into one (:meth:`read`), the gateway samples it, and the dialect
    writes the reply in its own shape (:meth:`answer`, :meth:`events`) and its refusals too (:meth:`error`)."""

    route: str
    body: type[BaseModel]
    """The request it reads: the route's schema in the server's OpenAPI document."""

    def read(self, body: Any, episode: Episode) -> Call:
        """The call ``body`` (the request's JSON) makes in ``episode``; :class:`GatewayError` if it makes none."""
        ...

    def answer(self, call: Call, choices: list[Choice], prompt_tokens: int, model: str,
               episode: Episode) -> dict[str, Any]:
        """The reply to ``call``, whose sampled ``choices`` read a prompt of ``prompt_tokens``."""
        ...

    def events(self, call: Call, body: dict[str, Any]) -> AsyncIterator[str]:
        """The reply :meth:`answer` gave, as the server-sent events a streamed call gets."""
        ...

    def error(self, status: int, code: str, message: str) -> JSONResponse:
        """A refusal, in this API's error shape."""
        ...


def parse(model: type[_Body], data: Any) -> _Body:
    """``data`` as a ``model`` request, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        detail = e.errors()[0]
        where = ".".join(str(p) for p in detail.get("loc", ()))
        message = detail["msg"].removeprefix("Value error, ")
        raise GatewayError(400, "invalid_request", f"{where}: {message}" if where else message) from None


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its body is ``model``'s JSON (the handler reads it through :func:`read_json`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def request_key(request: Request) -> str | None:
    """The API key a request carries: its bearer token, else its ``x-api-key`` (Anthropic's SDK sends that)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")


def models_list(model: str) -> JSONResponse:
    """``GET /v1/models``'s answer: the one model served."""
    return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                     "owned_by": "envkit"}]})


def no_retry(status: int) -> dict[str, str]:
    """The header that keeps the OpenAI and Anthropic SDKs from retrying a refusal (by default they retry 409 and
    429, with back-off: a finished episode's agent would wait seconds to be refused again)."""
    return {"x-should-retry": "false"} if status < 500 else {}


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool schema in the chat completions form (a tool with no parameters takes an empty object)."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event named ``kind``, whose data is ``data`` typed ``kind`` (as Anthropic's and the Responses
    API's are)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
