"""Demonstrations: the env writes each assistant turn in the model's place (:meth:`envkit.Env.demonstrate`), played
as a chat episode, so supervised data is laid out exactly as the model's rollouts are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envkit import Env, Message
from generators.engines.base import Completion
from generators.episodes.base import Rollout
from generators.parsers import OutputParser
from generators.tool_prompt import written_text

if TYPE_CHECKING:
    from generators.chat import ChatTokenizer


class DemoTurns:
    """The env's demonstration as a model turn: written in the taught format, tokenized, loss_mask 1."""

    def __init__(self, tokenizer: ChatTokenizer, parser: OutputParser) -> None:
        self.tokenizer, self.parser = tokenizer, parser

    async def __call__(self, env: Env, state: Rollout, max_tokens: int) -> tuple[Message, Completion, str]:
        """One longer than ``max_tokens`` is cut there like a model turn, and the env gets what the cut tokens
        say."""
        text = written_text(await env.demonstrate(list(state.traj.messages)), self.parser.tool_parser)
        ids, finish = [*self.tokenizer.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_id], "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
            text = self.tokenizer.decode(ids)
        state.append(ids, [0.0] * len(ids))
        return self.parser.parse(text, state.tools), Completion(ids, [], finish, -1), text
