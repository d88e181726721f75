"""The last line of a server's error handling (the gateway's, the policy server's): :func:`contain` gives an app a
structured 500 for any exception its handlers did not catch (the error shape of the API called, a request id in the
message, the traceback logged once under that id) and keeps the client's connection open after it, and counts every
status a client was sent, by route, however the response was made."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Counted = Callable[[str, int, float], None]
"""Told each response's route (the path template, ``unmatched`` for none), status and seconds taken."""
ErrorShape = Callable[[Request, int, str, str], JSONResponse]
"""The refusal ``status``, ``code``, ``message`` in the shape of the API ``request`` called."""


def _uncounted(route: str, status: int, seconds: float) -> None:
    """Count nothing (a server without metrics)."""


def contain(app: FastAPI, error: ErrorShape, counted: Counted = _uncounted) -> Contained:
    """``app`` answering an exception no handler caught with ``error``'s 500, each response counted."""

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = secrets.token_hex(6)
        route = getattr(request.scope.get("route"), "path", "unmatched")  # the template: a path may hold a key
        log.error("request %s (%s %s) failed", request_id, request.method, route,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error(request, 500, "internal_error", f"the server failed to answer this request (request id "
                                                     f"{request_id}; its log has the cause)")

    app.add_exception_handler(Exception, internal_error)
    return Contained(app, counted)


class Contained:
    """ASGI middleware: counts each response, and ends a request whose handler raised once its 500 is sent (the
    exception handler's; Starlette raises on after sending it, and uvicorn would log it again and drop the
    connection)."""

    def __init__(self, app: FastAPI, counted: Counted) -> None:
        self.app, self.counted = app, counted

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: int | None = None

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:  # logged and answered by the app's exception handler, unless that failed too
            if status is None:
                status = 500
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"internal error"})
        finally:
            route = scope.get("route")
            if status is not None:  # else the client went away before an answer
                self.counted(getattr(route, "path", "unmatched"), status, time.perf_counter() - t0)
