"""``/openenv``: the served env as an OpenEnv server, for OpenEnv's own clients (0.3 and 0.10:
``GenericEnvClient(base_url="http://host:port/openenv")``) and what is built on them.

As in OpenEnv, each WebSocket connection to ``/openenv/ws`` is one session (made at its first frame, closed with it),
under ``envkit serve``'s limits. Its frames:

    -> {"type": "reset", "data": {"seed": 0, "task": {...}}}        both optional
    -> {"type": "step", "data": {"content": "...", "tool_calls": [...]}}   an assistant message, its role implied
    -> {"type": "state"}                                             -> {"type": "state", "data": {...}}
    -> {"type": "close"}
    <- {"type": "observation", "data": {"observation": {"messages": [...], "tools": [...], "truncated": false,
        "metadata": {...}}, "reward": r, "done": d}}               tools only after a reset
    <- {"type": "error", "data": {"message": ..., "code": "VALIDATION_ERROR" | "EXECUTION_ERROR" | ...}}

``done`` is terminated or truncated, and ``truncated`` says which. The env's ``info`` is the observation's
``metadata``: an env may keep the answer there, and OpenEnv keeps metadata from the model (envkit's own OpenEnv
client shows it only with ``show_metadata=True``). ``GET /openenv/health`` and ``/openenv/schema``
answer as OpenEnv's do.
"""

from __future__ import annotations

import json
from typing import Any

from envkit.remote.protocol import ApiError
from envkit.remote.server.sessions import EnvServer

PREFIX = "/openenv"
_OPENENV_CODES = {"validation_error": "VALIDATION_ERROR", "invalid_action": "VALIDATION_ERROR",
                  "invalid_task": "VALIDATION_ERROR", "bad_request": "VALIDATION_ERROR",
                  "env_error": "EXECUTION_ERROR", "env_timeout": "EXECUTION_ERROR"}
_MESSAGES = {"type": "array", "items": {"type": "object"}, "description": "chat messages"}
SCHEMA: dict[str, Any] = {
    "action": {"title": "AssistantMessage", "type": "object", "properties": {
        "content": {"type": "string", "description": "the assistant's text"},
        "tool_calls": {"type": "array", "items": {"type": "object"}, "description": "OpenAI tool calls"}}},
    "observation": {"title": "ChatObservation", "type": "object", "properties": {
        "messages": _MESSAGES, "tools": {"type": "array", "items": {"type": "object"}},
        "truncated": {"type": "boolean"}, "metadata": {"type": "object"}, "done": {"type": "boolean"},
        "reward": {"type": ["number", "null"]}}},
    "state": {"title": "SessionState", "type": "object", "properties": {
        "episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer"}}},
}
"""What ``GET /openenv/schema`` answers: the action, observation and state as JSON schemas."""


class OpenEnvSession:
    """One ``/openenv/ws`` connection: at most one session, made at its first frame, deleted when it ends."""

    def __init__(self, server: EnvServer) -> None:
        self.server = server
        self.session_id: str | None = None
        self.tools: list[dict[str, Any]] = []

    async def handle(self, text: str | None) -> str | None:
        """The answer frame to one request frame (none to ``close``)."""
        try:
            frame = json.loads(text) if text is not None else None
            if not isinstance(frame, dict) or not isinstance(frame.get("data", {}), dict):
                raise ApiError("validation_error", 'send JSON text frames {"type": ..., "data": {...}}')
            kind, data = frame.get("type"), frame.get("data") or {}
            op = kind if kind in ("reset", "step", "state", "close") else "invalid"
            _, body = await self.server.answer(op, "openenv", self._run(kind, data))
        except (json.JSONDecodeError, ApiError) as e:
            err = e if isinstance(e, ApiError) else ApiError("bad_request", f"the frame is not JSON: {e}")
            return _error(err)
        if not body:
            return None
        answer = json.loads(body)
        if "error" in answer:
            return _error(ApiError(answer["error"]["code"], answer["error"]["message"]))
        return json.dumps(answer)

    async def _run(self, kind: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        if kind == "close":
            await self.close()
            return None
        if kind not in ("reset", "step", "state"):
            raise ApiError("validation_error", f"unknown frame type {kind!r}: reset, step, state or close")
        if self.session_id is None:
            created = await self.server.create({})
            self.session_id, self.tools = created["session_id"], created["tools"]
        if kind == "state":
            state = self.server.state(self.session_id)
            return {"type": "state", "data": {"episode_id": self.session_id, "step_count": state["steps"],
                                              **state}}
        if kind == "reset":
            seed, task = data.get("seed"), data.get("task")
            if (seed is not None and not isinstance(seed, int)) or (task is not None and not isinstance(task, dict)):
                raise ApiError("validation_error", "reset data: 'seed' is an integer and 'task' an object")
            out = await self.server.reset(self.session_id, seed, task)
            observation = {"messages": out["observation"], "tools": self.tools, "truncated": False,
                           "metadata": out["info"]}
            return {"type": "observation", "data": {"observation": observation, "reward": None, "done": False}}
        out = await self.server.step(self.session_id, {"role": "assistant", **data})
        observation = {"messages": out["observation"], "truncated": out["truncated"], "metadata": out["info"]}
        return {"type": "observation", "data": {"observation": observation, "reward": out["reward"],
                                                "done": out["terminated"] or out["truncated"]}}

    async def close(self) -> None:
        """Delete the connection's session."""
        session_id, self.session_id = self.session_id, None
        if session_id is not None and session_id in self.server.sessions:
            await self.server.delete(session_id, "disconnected")


def _error(err: ApiError) -> str:
    code = _OPENENV_CODES.get(err.code, err.code.upper())
    return json.dumps({"type": "error", "data": {"message": err.message, "code": code}})
