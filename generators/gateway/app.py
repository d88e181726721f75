"""The gateway's HTTP routes: one handler serves every dialect in :data:`DIALECTS`, each at its route and under
``/e/{key}``; ``/v1/models`` answers any of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from envkit import tracing
from generators.engines.base import EngineError
from generators.gateway.anthropic import Messages
from generators.gateway.chat import ChatCompletions, openai_error
from generators.gateway.dialect import Dialect, GatewayError, models_list, read_json, request_key
from generators.gateway.responses import Responses

if TYPE_CHECKING:
    from generators.gateway.server import Episode, Gateway

DIALECTS: tuple[Dialect, ...] = (ChatCompletions(), Responses(), Messages())
"""The APIs the gateway speaks. A new one is a module with a :class:`~generators.gateway.dialect.Dialect`, and a line
here."""


def build_app(gateway: Gateway) -> FastAPI:
    """The gateway's routes: each dialect's, and ``/v1/models``, also under ``/e/{key}``."""
    app = FastAPI(title="envkit capture gateway", docs_url=None, redoc_url=None, openapi_url=None)
    for prefix in ("", "/e/{key}"):
        for dialect in DIALECTS:
            app.add_api_route(prefix + dialect.route, _handler(gateway, dialect), methods=["POST"])
        app.add_api_route(prefix + "/v1/models", _models(gateway), methods=["GET"])
    return app


Handler = Callable[[Request, str | None], Awaitable[Response]]


def _handler(gateway: Gateway, dialect: Dialect) -> Handler:
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


def _models(gateway: Gateway) -> Handler:
    async def models(request: Request, key: str | None = None) -> Response:
        try:
            _episode(gateway, request, key)
        except GatewayError as e:
            return openai_error(e.status, e.code, str(e))
        return models_list(gateway.engine.model_name)

    return models


def _episode(gateway: Gateway, request: Request, key: str | None) -> Episode:
    """The episode a request calls in: by the key in its path, else its bearer token or ``x-api-key``, on the port
    it came in on."""
    if key is None:
        key = request_key(request)
    server = request.scope.get("server")
    return gateway.episode(key, server[1] if server else None)
