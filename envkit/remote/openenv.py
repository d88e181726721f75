"""OpenEnvEnv: an OpenEnv environment server (PyPI ``openenv-core`` 0.3, ``openenv`` 0.10) used as an envkit env, over
its own wire protocol.

OpenEnv (0.3) keeps an episode's state only on its WebSocket: each connection to ``/ws`` gets its own environment
instance (its REST ``/reset`` and ``/step`` make a fresh one per request, so they cannot carry an episode). Frames:

    -> {"type": "reset", "data": {"seed": 0, "episode_id": ..., **task}}
    -> {"type": "step", "data": {<action fields>}}
    <- {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
    <- {"type": "error", "data": {"message": ..., "code": "VALIDATION_ERROR" | "EXECUTION_ERROR" | ...}}
    -> {"type": "close"}

The mapping: the assistant's text becomes the action field ``action_key``; the observation field ``observation_key``
(or, without one, the observation as JSON) becomes a user message; ``reward`` None counts as 0; ``done`` is
``terminated``. OpenEnv 0.10 (PyPI ``openenv``) also sends the observation's ``metadata`` inside it, where an env may
keep what the model must not see (the answer): it goes to ``info["metadata"]``, and into the model's message only
with ``show_metadata=True``. Both keys are read from the server's ``/schema`` when not given: the action's one string
field, the observation's first string field. ``to_action``/``to_messages`` replace the mapping for richer envs.
OpenEnv itself is not imported: the wire protocol is all this needs.

An MCP-type env (OpenEnv 0.10's ``MCPEnvironment``, whose action is ``call_tool``; found from ``/schema``, or
``mcp=True``) is a tool env: its tools, from a ``list_tools`` step, are the env's ``tools``; each tool call of a
reply is one ``call_tool`` step, answered by a ``tool`` message (the tool's text, or ``Error: ...``), its reward
summed over the calls. It acts only through its tools, so a reply without a tool call ends the episode
(``terminated``, reward 0).

``tasks(split)`` reads OpenEnv 0.10's Task API (``/list_environments``, ``/{env}/splits``, ``/{env}/num_tasks``,
``/{env}/task_range``), a page at a time: task ``i`` is ``{"id", "split", "index", "spec"}``, and resetting on it
sends ``split`` and ``index``, as that API selects a task. A server without the API (0.3, or an env that does not
list tasks) has no task list (None), and episodes are drawn by seed.

    env = envkit.make("openenv:http://127.0.0.1:8001")        # e.g. OpenEnv's echo env under uvicorn
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from envkit.core import Env, StepResult, Task
from envkit.errors import InvalidActionError, RemoteEnvCrashError, RemoteEnvError, RemoteInvalidActionError
from envkit.messages import Message, tool_result, user
from envkit.registry import EnvSpec
from envkit.remote.client import RemoteConfig, WsSession, retry_connect
from envkit.remote.wsclient import WsConnection
from envkit.tasks import LazyTasks
from envkit.tools import Tool, tool_calls_of

_RESERVED = {"metadata", "done", "reward"}  # fields every OpenEnv Action/Observation has; never the payload


def _string_fields(schema: dict[str, Any]) -> list[str]:
    props = schema.get("properties", {})
    return [k for k, v in props.items() if k not in _RESERVED and isinstance(v, dict) and v.get("type") == "string"]


class OpenEnvEnv(Env):
    """An OpenEnv server at ``url`` (``http://host:port``) as an envkit env; one WebSocket session per env."""

    def __init__(
        self,
        url: str,
        *,
        action_key: str | None = None,
        observation_key: str | None = None,
        to_action: Callable[[Message], dict[str, Any]] | None = None,
        to_messages: Callable[[dict[str, Any]], list[Message]] | None = None,
        show_metadata: bool = False,
        mcp: bool | None = None,
        remote: RemoteConfig | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
            raise ValueError(f"OpenEnvEnv needs the server's URL, like http://127.0.0.1:8000, got {url!r}")
        secure = parts.scheme in ("https", "wss")
        self.http_url = f"{'https' if secure else 'http'}://{parts.netloc}{parts.path.rstrip('/')}"
        self.ws_url = f"{'wss' if secure else 'ws'}://{parts.netloc}{parts.path.rstrip('/')}/ws"
        self.action_key, self.observation_key = action_key, observation_key
        self._to_action, self._to_messages = to_action, to_messages
        self.show_metadata = show_metadata
        self.mcp = mcp
        self.tools: list[Tool] = []  # type: ignore[misc]  # an MCP-type env's, read at init
        self.config = remote or RemoteConfig()
        self._session = WsSession("OpenEnv")
        self.spec = EnvSpec(name=f"openenv:{url}", entry_point="envkit.remote.openenv:OpenEnvEnv",
                            kwargs={"action_key": action_key, "observation_key": observation_key,
                                    "show_metadata": show_metadata, "mcp": mcp},
                            description=f"OpenEnv server at {self.http_url}", source="openenv")

    async def init(self) -> None:
        """Read the server's schemas (whether it is an MCP-type env, which fields carry text) where not given,
        open the WebSocket session, and list an MCP-type env's tools."""
        if self._session.ws is not None:
            return
        if self.mcp is None or (self.action_key is None and self._to_action is None) or (
                self.observation_key is None and self._to_messages is None):
            await self._infer_keys()
        self._session.ws = await retry_connect(
            lambda: WsConnection.connect(self.ws_url, timeout_s=self.config.connect_timeout_s), self.config,
            self.ws_url)
        if self.mcp:
            listed = (await self._exchange({"type": "step", "data": {"type": "list_tools"}})).get("observation", {})
            self.tools = [Tool(name=t["name"], description=t.get("description") or "",
                               parameters=t.get("input_schema") or {"type": "object", "properties": {}})
                          for t in listed.get("tools", [])]

    async def _infer_keys(self) -> None:
        async def get() -> httpx.Response:
            async with httpx.AsyncClient(timeout=self.config.connect_timeout_s) as client:
                return await client.get(f"{self.http_url}/schema")

        response = await retry_connect(get, self.config, self.http_url)
        if response.status_code != 200:
            raise RemoteEnvError(f"{self.http_url}/schema answered {response.status_code}: {response.text[:200]}",
                                 code="schema_unavailable", status=response.status_code)
        schemas = response.json()
        action = schemas.get("action", {})
        if self.mcp is None:
            self.mcp = "tool_name" in action.get("properties", {}) and self._to_action is None
        if self.mcp:
            return
        if self.action_key is None and self._to_action is None:
            fields = _string_fields(action)
            if len(fields) != 1:
                raise RemoteEnvError(f"cannot tell which action field takes the assistant's text (string fields: "
                                     f"{fields or 'none'}); pass action_key= or to_action=", code="schema_mismatch")
            self.action_key = fields[0]
        if self.observation_key is None and self._to_messages is None:
            fields = _string_fields(schemas.get("observation", {}))
            self.observation_key = fields[0] if fields else None  # None: the observation is sent as JSON

    async def _exchange(self, frame: dict[str, Any]) -> dict[str, Any]:
        answer = await self._session.exchange(frame, self.config.timeout_s)
        if answer.get("type") == "error":
            data = answer.get("data", {})
            code, message = str(data.get("code", "UNKNOWN")).lower(), str(data.get("message", ""))
            if code == "validation_error":
                raise RemoteInvalidActionError(f"the OpenEnv server refused the action: {message} "
                                               f"{data.get('errors', '')}", code=code)
            if code == "execution_error":
                raise RemoteEnvCrashError(f"the OpenEnv env raised: {message}", code=code)
            raise RemoteEnvError(f"the OpenEnv server answered an error: {message}", code=code)
        return answer.get("data", {})

    def _observed(self, answer: dict[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        """The model's messages and the step's info from an observation frame's data."""
        observation = dict(answer.get("observation", {}))
        metadata = observation.pop("metadata", None)
        info: dict[str, Any] = {"observation": observation, **({"metadata": metadata} if metadata else {})}
        shown = {**observation, "metadata": metadata} if self.show_metadata and metadata else observation
        if self._to_messages is not None:
            return self._to_messages(shown), info
        text = shown.get(self.observation_key) if self.observation_key else None
        if self.mcp and text is None:  # an MCP env's opening: its text fields, whatever they are called
            text = "\n".join(v for k, v in shown.items() if isinstance(v, str) and k not in _RESERVED) or None
        if not isinstance(text, str):
            return [user(json.dumps(shown))], info
        return [user(text + (f"\nmetadata: {json.dumps(metadata)}" if shown is not observation else ""))], info

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        """OpenEnv reset; ``task`` fields go along as reset parameters (``task["id"]`` as the ``episode_id``)."""
        await self.init()
        data = {k: v for k, v in (task or {}).items() if k != "spec"}  # a Task API task: split and index select it
        if "id" in data:
            data["episode_id"] = str(data.pop("id"))
        if seed is not None:
            data["seed"] = seed
        return self._observed(await self._exchange({"type": "reset", "data": data}))

    async def step(self, action: Message) -> StepResult:
        """OpenEnv step with the assistant's text as the action field (an MCP-type env: a ``call_tool`` step per
        tool call); reward None counts as 0."""
        if self.mcp:
            return await self._call_tools(action)
        if self._to_action is not None:
            payload = self._to_action(action)
        else:
            if action.get("content") is None:
                raise InvalidActionError(f"OpenEnvEnv sends the assistant's text as {self.action_key!r}; "
                                         "this action has none (pass to_action= to map tool calls)")
            payload = {self.action_key: action["content"]}
        answer = await self._exchange({"type": "step", "data": payload})
        messages, info = self._observed(answer)
        reward = answer.get("reward")
        return StepResult(messages, float(reward) if reward is not None else 0.0,
                          terminated=bool(answer.get("done", False)), info=info)

    def tasks(self, split: str = "train") -> Sequence[Task] | None:
        """The server's tasks of ``split`` through OpenEnv's Task API (blocking HTTP, a page at a time), or None
        where it has none."""
        with _blocking_client(self.config) as http:
            names = http.get(f"{self.http_url}/list_environments")
            if names.status_code != 200 or not isinstance(names.json(), list) or not names.json():
                return None
            base = f"{self.http_url}/{names.json()[0]}"
            splits = http.get(f"{base}/splits")
            if splits.status_code != 200:  # 501: the env does not list its tasks
                return None
        available = [entry.get("name") for entry in splits.json()]
        if split not in available:
            raise ValueError(f"the OpenEnv server at {self.http_url} has splits {available}, not {split!r}")
        return OpenEnvTasks(base, split, self.config)

    async def _call_tools(self, action: Message) -> StepResult:
        """One ``call_tool`` step per tool call of ``action``; its ``tool`` messages, its summed reward."""
        calls, errors = tool_calls_of(action)
        if not calls and not errors:
            return StepResult([], terminated=True, info={"reason": "a reply without a tool call ends an MCP env's "
                                                                  "episode"})
        messages: list[Message] = []
        results: list[dict[str, Any]] = []
        reward, done = 0.0, False
        for call in calls:
            name = call["function"]["name"]
            try:
                arguments = json.loads(call["function"].get("arguments") or "{}")
            except json.JSONDecodeError as e:
                text, status = f"Error: arguments are not valid JSON: {e.msg}", "error"
            else:
                answer = await self._exchange({"type": "step", "data": {"type": "call_tool", "tool_name": name,
                                                                        "arguments": arguments}})
                text, status = _tool_text(answer.get("observation", {}))
                reward += float(answer.get("reward") or 0.0)
                done = done or bool(answer.get("done", False))
            messages.append(tool_result(text, call["id"], name))
            results.append({"name": name, "status": status})
            if done:
                break
        if errors:
            messages.append(user("Malformed tool call: " + "; ".join(errors)))
        return StepResult(messages, reward, terminated=done,
                          info={"tool_calls": len(calls), "tool_call_errors": len(errors), "tool_results": results})

    async def close(self) -> None:
        """End the OpenEnv session (idempotent)."""
        ws, self._session.ws = self._session.ws, None
        if ws is None:
            return
        if not ws.closed:
            ws.send(json.dumps({"type": "close"}))
        await ws.close()


class OpenEnvTasks(LazyTasks):
    """One split of an OpenEnv server's Task API at ``base`` (``http://host:port/<env>``), read ``page_size`` task
    specs at a time on access."""

    def __init__(self, base: str, split: str, config: RemoteConfig, page_size: int = 256) -> None:
        self.base, self.split, self.page_size, self.config = base, split, page_size, config
        self._pages: dict[int, list[Task]] = {}
        self._name = f"{base} split {split!r}"
        count = self._post("num_tasks", {"split": split}).get("num_tasks")
        if type(count) is not int or count < 0:
            raise RemoteEnvError(f"{base}/num_tasks answered no count for split {split!r}", code="bad_answer")
        self._len = count

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            with _blocking_client(self.config) as http:
                response = http.post(f"{self.base}/{route}", json=body)
        except httpx.HTTPError as e:
            raise RemoteEnvError(f"POST {self.base}/{route} failed: {type(e).__name__}: {e}",
                                 code="connect_error") from e
        if response.status_code != 200:
            raise RemoteEnvError(f"POST {self.base}/{route} answered {response.status_code}: {response.text[:200]}",
                                 code="bad_answer", status=response.status_code)
        return response.json()

    def _task(self, i: int) -> Task:
        page, k = divmod(i, self.page_size)
        if page not in self._pages:
            start = page * self.page_size
            stop = min(start + self.page_size, self._len)
            specs = self._post("task_range", {"split": self.split, "start": start, "stop": stop}).get("tasks")
            if not isinstance(specs, list) or len(specs) != stop - start:
                raise RemoteEnvError(f"{self.base}/task_range answered no valid tasks {start}..{stop} of split "
                                     f"{self.split!r}", code="bad_answer")
            self._pages[page] = [
                {"id": spec["id"] if isinstance(spec, dict) and isinstance(spec.get("id"), str)
                 else f"{self.split}-{start + j}", "split": self.split, "index": start + j, "spec": spec}
                for j, spec in enumerate(specs)]
        return self._pages[page][k]


def _blocking_client(config: RemoteConfig) -> httpx.Client:
    """A blocking client for the Task API's routes: connects retried, the remote config's timeouts."""
    return httpx.Client(transport=httpx.HTTPTransport(retries=config.connect_retries),
                        timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s))


def _tool_text(observation: dict[str, Any]) -> tuple[str, str]:
    """A ``call_tool`` observation as the tool message's text and its status (ok, error)."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error)}", "error"
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):  # MCP's CallToolResult
        text = "\n".join(str(c.get("text", "")) for c in result["content"] if isinstance(c, dict))
        return text, "error" if result.get("is_error") else "ok"
    return (result if isinstance(result, str) else json.dumps(result)), "ok"


def make_openenv(name: str, **kwargs: Any) -> OpenEnvEnv:
    """The ``openenv`` scheme of ``envkit.make``: ``openenv:http://host:port`` is the OpenEnv server at that URL."""
    return OpenEnvEnv(name.removeprefix("openenv:"), **kwargs)
