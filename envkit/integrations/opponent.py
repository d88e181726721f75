"""The other seat of a two-player game (``textarena:ID`` with ``opponent=``): a fixed opponent, or the policy itself.

``opponent`` is one of:

- ``"policy"``: self-play against the model being trained or evaluated, through its inference server's OpenAI
  chat route. ``python -m trainer`` and ``envkit eval`` publish that route in ``ENVKIT_POLICY_URL`` and
  ``ENVKIT_POLICY_MODEL`` once their engine is up, so the opponent moves with the weights of the moment.
- ``{"base_url": ..., "model": ..., "api_key": ..., "temperature": 1.0, "max_tokens": 256}``: any OpenAI-compatible
  chat endpoint (a frozen copy of the policy, another model); ``base_url`` and ``model`` default to the policy's.
- a callable ``(observation: str) -> str``, sync or async (a textarena ``Agent`` is one), or its import path
  ``"module:attr"`` (a class there is made with no arguments).

An endpoint opponent reads its seat's game as a chat: the game's messages as user turns, its own moves as its
replies. A callable gets the text of its seat's messages so far, as textarena's own agents do. Only the env's seat
is the policy's to learn from: the opponent's moves are part of the env.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from envkit.errors import EnvError
from envkit.markup import inert
from envkit.messages import Message

POLICY_URL_VAR = "ENVKIT_POLICY_URL"
"""The OpenAI-compatible root (``http://host:port/v1``) where the policy being trained or evaluated answers."""
POLICY_MODEL_VAR = "ENVKIT_POLICY_MODEL"
"""The model name requests to :data:`POLICY_URL_VAR` use."""
_ENDPOINT_KEYS = {"base_url", "model", "api_key", "temperature", "max_tokens"}


class OpponentError(EnvError):
    """The opponent could not move (its endpoint failed or is unknown): the episode fails, not the policy."""


class Opponent(Protocol):
    """Plays the other seat: its next move from the chat of its seat so far."""

    async def move(self, messages: list[Message]) -> str: ...

    async def aclose(self) -> None: ...


def make_opponent(spec: Any) -> Opponent:
    """The opponent ``spec`` names (see the module doc)."""
    if spec == "policy":
        return ChatOpponent()
    if isinstance(spec, dict):
        unknown = set(spec) - _ENDPOINT_KEYS
        if unknown:
            raise ValueError(f"opponent endpoint keys are {sorted(_ENDPOINT_KEYS)}, got {sorted(unknown)}")
        return ChatOpponent(**spec)
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        if not attr:
            raise ValueError(f"opponent must be 'policy', an endpoint dict, a callable or 'module:attr', got {spec!r}")
        target = getattr(importlib.import_module(module), attr)
        spec = target() if inspect.isclass(target) else target
    if not callable(spec):
        raise ValueError(f"opponent {spec!r:.80} is not callable")
    return CallableOpponent(spec)


class CallableOpponent:
    """A function of the seat's observation text."""

    def __init__(self, fn: Callable[[str], str | Awaitable[str]]) -> None:
        self.fn = fn

    async def move(self, messages: list[Message]) -> str:
        out = self.fn("\n".join(m["content"] or "" for m in messages if m["role"] == "user"))
        if inspect.isawaitable(out):
            out = await out
        if not isinstance(out, str):
            raise OpponentError(f"opponent {self.fn!r:.80} returned {type(out).__name__}, not a move (str)")
        return out

    async def aclose(self) -> None:
        """Nothing to release."""


class ChatOpponent:
    """A model behind an OpenAI-compatible chat route; by default the policy's (read when it first moves, as the
    trainer starts its inference server after it has made its envs)."""

    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 temperature: float = 1.0, max_tokens: int = 256) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.temperature, self.max_tokens = temperature, max_tokens
        self._client: Any = None

    async def move(self, messages: list[Message]) -> str:
        import httpx  # the textarena extra installs it; only an endpoint opponent needs it

        url = self.base_url or os.environ.get(POLICY_URL_VAR)
        model = self.model or os.environ.get(POLICY_MODEL_VAR)
        if not url or not model:
            raise OpponentError(f"opponent 'policy' needs the policy's chat endpoint: python -m trainer and envkit "
                                f"eval publish it in {POLICY_URL_VAR} and {POLICY_MODEL_VAR} (not for an in-process "
                                "engine, or an env in another process); or pass opponent={'base_url': ..., "
                                "'model': ...}")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=600.0)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # what the game (and through it the policy) wrote is data to the opponent's template: its moves stay its own
        sent = [{"role": m["role"], "content": m["content"] or ""} for m in messages]
        sent = [m if m["role"] == "assistant" else {**m, "content": inert(m["content"])} for m in sent]
        body = {"model": model, "messages": sent,
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        try:
            response = await self._client.post(url.rstrip("/") + "/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as e:
            raise OpponentError(f"the opponent at {url} did not answer: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise OpponentError(f"the opponent at {url} answered {response.status_code}: {response.text[:300]}")
        return response.json()["choices"][0]["message"].get("content") or ""

    async def aclose(self) -> None:
        """Close the HTTP client."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
