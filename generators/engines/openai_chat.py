"""Chat completions against any OpenAI-compatible endpoint, through the official ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import openai

from generators.engines.base import ChatCompletion, EngineError, InferenceEngine, SamplingParams


class OpenAIChat:
    """A pooled ``openai.AsyncOpenAI`` client turned into :class:`ChatCompletion` values."""

    def __init__(self, base_url: str, *, model_name: str, api_key: str = "EMPTY", timeout: float = 600.0,
                 max_retries: int = 2) -> None:
        self.model_name = model_name
        self.native_tools = True
        """False once the endpoint refused ``tools`` (e.g. vLLM without a tool parser); tools then stay out of
        requests and the caller reads ``<tool_call>`` text instead."""
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout,
                                         max_retries=max_retries)

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None, *, weight_version: int = 0) -> ChatCompletion:
        """One chat completion; API errors become EngineError with the endpoint's message."""
        kwargs: dict[str, Any] = {
            "model": self.model_name, "messages": messages, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
        }
        if sampling.stop:
            kwargs["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            kwargs["seed"] = sampling.seed
        try:
            response = await self._create(kwargs, tools)
        except openai.OpenAIError as e:
            status = getattr(e, "status_code", None)
            raise EngineError(f"chat completion failed at {self.client.base_url}: {e}", status=status) from e
        choice = response.choices[0]
        calls = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments or json.dumps({})}}
            for c in choice.message.tool_calls or []
        ]
        finish = "length" if choice.finish_reason == "length" else "stop"  # "tool_calls" ends a turn normally
        tokens = response.usage.completion_tokens if response.usage else 0
        # vLLM's reasoning parsers answer reasoning_content (newer servers: reasoning), an extra field of the message
        reasoning = getattr(choice.message, "reasoning_content", None) or getattr(choice.message, "reasoning", None)
        return ChatCompletion(choice.message.content, calls, finish, tokens, weight_version,
                              reasoning if isinstance(reasoning, str) else None)

    async def _create(self, kwargs: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
        if not tools or not self.native_tools:
            return await self.client.chat.completions.create(**kwargs)
        try:
            return await self.client.chat.completions.create(**kwargs, tools=tools)
        except openai.BadRequestError as e:
            if "tool" not in str(e).lower():
                raise
            self.native_tools = False
            return await self.client.chat.completions.create(**kwargs)

    async def aclose(self) -> None:
        """Close the HTTP pool."""
        await self.client.close()


class OpenAIEndpoint(InferenceEngine):
    """Any external OpenAI-compatible endpoint (a hosted API, someone's vLLM/SGLang) in chat mode.

    It cannot take or return token ids, so rollouts through it are for evaluation, not training.
    """

    supports_token_ids = False

    def __init__(self, base_url: str, *, model: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._base_url = base_url.rstrip("/")
        self.model_name = model
        self._api_key = api_key or "EMPTY"
        self._timeout = timeout
        self._chat: OpenAIChat | None = None

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def chat_url(self) -> str | None:
        return self._base_url  # the endpoint's own root, /v1 included

    async def start(self) -> None:
        if self._chat is None:
            self._chat = OpenAIChat(self._base_url, model_name=self.model_name, api_key=self._api_key,
                                    timeout=self._timeout)

    async def stop(self) -> None:
        if self._chat is not None:
            await self._chat.aclose()
            self._chat = None

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        if self._chat is None:
            raise EngineError("OpenAIEndpoint is not started; use `async with engine:`")
        return await self._chat.chat(messages, sampling, tools)
