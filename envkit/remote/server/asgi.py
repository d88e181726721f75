"""The ASGI interface's types, as the server's middleware (:mod:`.guard`) and its WebSocket endpoint (:mod:`.ws`)
both speak it. A leaf: the guard imports the endpoint, so the types they share sit below both."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
