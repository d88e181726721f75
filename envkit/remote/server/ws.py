"""``/ws``: the WebSocket endpoint of ``envkit serve``, one session per connection, its frames answered by the
:class:`~envkit.remote.server.sessions.EnvServer` operations; idle connections are closed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

from pydantic import ValidationError

from envkit.remote.deadlines import Canceller
from envkit.remote.protocol import ApiError, WsRequest
from envkit.remote.server.asgi import Receive, Scope, Send
from envkit.remote.server.sessions import EnvServer, plain_step_action

_WS_STEP = frozenset({"op", "action"})


class Connection(Protocol):
    """The state of one WebSocket connection: answers its frames, holds at most one session."""

    session_id: str | None

    async def handle(self, text: str | None) -> str | None:
        """The answer frame to one request frame (None: no answer)."""
        ...

    async def close(self) -> None:
        """Delete the connection's session, if any."""
        ...


class WsEndpoint:
    """``/ws``: one session per connection, frames ``{"op": "create"|"reset"|"step"|"state"|"snapshot"|"restore"|
    "delete", ...}`` (or
    another protocol's, by ``connection``: ``/openenv/ws``).

    A plain ASGI app that :class:`~envkit.remote.server.guard.Guard` calls, not a FastAPI route: Starlette's
    WebSocket wrapper (state checks on every frame) and the route's exception-handling send wrapper took about 3 µs
    of the server's 31 µs of CPU per step of a fast env.
    """

    def __init__(self, server: EnvServer, connection: Callable[[EnvServer], Connection] | None = None) -> None:
        self.server = server
        self.connection = connection or _WsSession

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        handler = self.connection(self.server)
        limits, deadlines = self.server.limits, self.server.deadlines
        idle = Canceller()
        try:
            while True:
                deadlines.add(idle, limits.session_ttl_s if handler.session_id else limits.idle_timeout_s, idle)
                try:
                    message = await receive()
                finally:
                    deadlines.discard(idle)
                if message["type"] != "websocket.receive":
                    break
                answer = await handler.handle(message.get("text"))
                if answer is not None:
                    await send({"type": "websocket.send", "text": answer})
        except asyncio.CancelledError:
            if not idle.expired:
                raise
            idle.task.uncancel()
            await send({"type": "websocket.close", "code": 1001, "reason": "idle: no frame within the timeout"})
        except OSError:  # the client went away while we answered
            pass
        finally:
            await handler.close()


async def _refused(err: ApiError) -> NoReturn:
    raise err


class _WsSession:
    """The state of one WebSocket connection: at most one session, deleted when the connection ends."""

    def __init__(self, server: EnvServer) -> None:
        self.server = server
        self.session_id: str | None = None

    async def handle(self, text: str | None) -> str | None:
        """The answer frame to one request frame."""
        op, work = self._operation(text)
        _, payload = await self.server.answer(op, "ws", work)
        return payload.decode()

    def _operation(self, text: str | None) -> tuple[str, Awaitable[dict[str, Any]]]:
        try:
            if text is None:
                raise ApiError("bad_request", "send JSON text frames, not binary ones")
            action = plain_step_action(text, _WS_STEP)
            if action is not None and self.session_id is not None:
                return "step", self.server.step(self.session_id, action)
            try:
                req = WsRequest.model_validate_json(text)
            except ValidationError as e:
                if any(p.get("type") == "json_invalid" for p in e.errors()):
                    raise ApiError("bad_request", "the frame is not valid JSON") from e
                problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors()[:5])
                raise ApiError("validation_error", problems) from e
        except ApiError as e:
            return "invalid", _refused(e)
        return req.op, self._run(req)

    async def _run(self, req: WsRequest) -> dict[str, Any]:
        server = self.server
        if req.op == "create":
            return await self._create(req)
        if self.session_id is None:
            raise ApiError("session_not_found", "this connection has no session; send {\"op\": \"create\"} first")
        if req.op == "reset":
            return await server.reset(self.session_id, req.seed, req.task)
        if req.op == "step":
            if req.action is None:
                raise ApiError("validation_error", "step needs an 'action' (an assistant message)")
            return await server.step(self.session_id, req.action.model_dump(exclude_unset=True))
        if req.op == "state":
            return server.state(self.session_id)
        if req.op == "snapshot":
            return await server.snapshot(self.session_id)
        if req.op == "restore":
            if not req.snapshot:
                raise ApiError("validation_error", "restore needs a 'snapshot' (a token from the snapshot op)")
            return await server.restore(self.session_id, req.snapshot)
        session_id, self.session_id = self.session_id, None
        await server.delete(session_id)
        return {"deleted": session_id}

    async def _create(self, req: WsRequest) -> dict[str, Any]:
        """The ``create`` op: the connection's session, its only one (a connection holding one must delete it first)."""
        if self.session_id is not None and self.session_id in self.server.sessions:
            raise ApiError("validation_error", "this connection already has a session; delete it first")
        created = await self.server.create(req.kwargs, seat=req.seat, table=req.table)
        self.session_id = created["session_id"]
        return created

    async def close(self) -> None:
        if self.session_id is not None and self.session_id in self.server.sessions:
            await self.server.delete(self.session_id, "disconnected")
