"""A command-line agent: reads a task (JSON) on stdin, plays it with an openai-SDK tool loop against the endpoint in
``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``, and prints its answer, as coding CLIs do. It needs the openai
SDK alone (it runs in a venv of its own, .venv-agent); ``agent_envs`` plays the same loop in-process.

    echo '{"question": "What is 2 + 3?"}' | OPENAI_BASE_URL=... python cli_agent.py --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import openai

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "required": ["a", "b"],
                                                       "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}}}}}
INSTRUCTIONS = "Use the add tool, then answer."


def llm(client: Any, **kwargs: Any) -> openai.AsyncOpenAI:
    """The SDK's client for ``client``: no retries, so a refused call reaches the agent at once."""
    return openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, **kwargs)


def run_add(arguments: str) -> str:
    """What the agent's ``add`` tool answers."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def tool_loop(task: dict[str, Any], client: Any, *, turns: int = 3, max_tokens: int = 48,
                    stream: bool = False) -> str:
    """Ask, run the tool calls the model writes, and ask again, ``turns`` times at most; the last reply's text."""
    chat = llm(client)
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": task["question"]}]
    text = ""
    for _ in range(turns):
        if stream:
            message = await _streamed(chat, client.model, messages, max_tokens)
        else:
            reply = await chat.chat.completions.create(model=client.model, messages=messages, tools=[ADD],
                                                       max_tokens=max_tokens)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        text = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if not calls:
            messages.append({"role": "user", "content": "Check it with the tool."})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": run_add(call["function"]["arguments"])})
    return text


async def _streamed(chat: openai.AsyncOpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int
                    ) -> dict[str, Any]:
    """One streamed call, its chunks assembled into the assistant message."""
    content, calls = "", {}
    stream = await chat.chat.completions.create(model=model, messages=messages, tools=[ADD], max_tokens=max_tokens,
                                                stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["id"] += call.id or ""
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message



def main() -> None:
    """Parse the flags, play the task from stdin, print the final answer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48, help="the completion limit per model call")
    parser.add_argument("--turns", type=int, default=3, help="model calls at most")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    client = SimpleNamespace(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                             model=os.environ.get("OPENAI_MODEL", "policy"))
    print(asyncio.run(tool_loop(task, client, turns=args.turns, max_tokens=args.max_tokens)))


if __name__ == "__main__":
    main()
