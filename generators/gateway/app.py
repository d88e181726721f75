"""The gateway's HTTP routes: one handler serves every dialect in :data:`DIALECTS`, each at its route and under
``/e/{key}``; ``/v1/models`` answers any of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from envkit import tracing
from generators.engines.base import EngineError, InferenceEngine
from generators.gateway.anthropic import Messages
from generators.gateway.chat import ChatCompletions, openai_error
from generators.gateway.contained import Contained, contain
from generators.gateway.dialect import Dialect, json_body, models_list, read_json, request_key
from generators.gateway.responses import Responses
from generators.gateway.types import ChatRequest, Choice, Episode, GatewayError


class Backend(Protocol):
    """What the routes need of the gateway behind them: the engine that names the model, the episode a key calls
    in, and a call sampled there. :class:`generators.gateway.server.Gateway` is one; it builds its routes at its start,
    so this module names what it uses rather than importing it."""

    engine: InferenceEngine

    def episode(self, key: str | None, port: int | None = None) -> Episode:
        """The open episode with ``key``, called on ``port``; :class:`GatewayError` if there is none."""
        ...

    async def chat(self, episode: Episode, request: ChatRequest) -> tuple[list[Choice], int]:
        """Sample ``request``'s choices in ``episode``; returns them and the prompt's length in tokens."""
        ...


DIALECTS: tuple[Dialect, ...] = (ChatCompletions(), Responses(), Messages())
"""The APIs the gateway speaks. A new one is a module with a :class:`~generators.gateway.dialect.Dialect`, and a line
here."""


def build_app(gateway: Backend) -> Contained:
    """The gateway's routes: each dialect's, and ``/v1/models``, also under ``/e/{key}``; an exception none of them
    caught is a structured 500 (:mod:`.contained`)."""
    app = FastAPI(title="envkit capture gateway", docs_url=None, redoc_url=None)  # its schema: /openapi.json
    for prefix in ("", "/e/{key}"):
        for dialect in DIALECTS:
            app.add_api_route(prefix + dialect.route, _handler(gateway, dialect), methods=["POST"],
                              openapi_extra=json_body(dialect.body))
        app.add_api_route(prefix + "/v1/models", _models(gateway), methods=["GET"])
    return contain(app, dialect_error)


def dialect_error(request: Request, status: int, code: str, message: str) -> JSONResponse:
    """A refusal in the error shape of the dialect whose route ``request`` called (OpenAI's for any other)."""
    dialect = next((d for d in DIALECTS if request.url.path.endswith(d.route)), DIALECTS[0])
    return dialect.error(status, code, message)


Handler = Callable[[Request, str | None], Awaitable[Response]]


def _handler(gateway: Backend, dialect: Dialect) -> Handler:
    """The one handler, for ``dialect``: read the call, sample it in its episode, answer in the dialect's shape."""

    async def handle(request: Request, key: str | None = None) -> Response:
        try:
            episode = _episode(gateway, request, key)
            with tracing.attached(episode.trace), tracing.span(f"gateway {dialect.route}", turn=episode.calls + 1):
                call = dialect.read(await read_json(request), episode)
                choices, prompt_tokens = await gateway.chat(episode, call.chat)
        except GatewayError as e:
            return dialect.error(e.status, e.code, str(e))
        except EngineError as e:
            return dialect.error(502, "engine_error", f"the inference engine failed: {e}")
        body = dialect.answer(call, choices, prompt_tokens, gateway.engine.model_name, episode)
        if call.stream:
            return StreamingResponse(dialect.events(call, body), media_type="text/event-stream")
        return JSONResponse(body)

    return handle


def _models(gateway: Backend) -> Handler:
    async def models(request: Request, key: str | None = None) -> Response:
        try:
            _episode(gateway, request, key)
        except GatewayError as e:
            return openai_error(e.status, e.code, str(e))
        return models_list(gateway.engine.model_name)

    return models


def _episode(gateway: Backend, request: Request, key: str | None) -> Episode:
    """The episode a request calls in: by the key in its path, else its bearer token or ``x-api-key``, on the port
    it came in on."""
    if key is None:
        key = request_key(request)
    server = request.scope.get("server")
    return gateway.episode(key, server[1] if server else None)
