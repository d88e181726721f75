"""Chat-template tokenization for token-in/token-out rollouts, without ever re-tokenizing earlier turns.

Observation tokens come from the fixed-prefix trick: render a fixed dummy conversation, render it again with the
new messages appended, and keep the difference. That yields exactly the tokens the template writes for the new
messages in context (role headers, separators, the next generation prompt), whatever the template.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from envkit.markup import control_pattern, inert

_PREFIX: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    # Qwen3's template writes an empty <think></think> into the last assistant turn only while it is last; with
    # reasoning of its own the turn renders the same once tool results follow
    {"role": "assistant", "content": "A", "reasoning_content": "R"},
]


LONG_TEXT = 1 << 16
"""Characters past which tokenizing takes long enough (a millisecond or more) to be done off an event loop."""


class ChatTokenizer:
    """An HF tokenizer plus the chat-template arithmetic the rollout loop needs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; rollouts need one to render messages")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the rollout loop needs it to close assistant turns")
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._prefix_cache: dict[str, list[int]] = {}
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        self._control = control_pattern([*specials, *tokenizer.all_special_tokens])

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        """Load the tokenizer (and its chat template) of a checkpoint dir or hub name."""
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @cached_property
    def max_text_bytes_per_token(self) -> int:
        """A bound on the UTF-8 bytes of text one token stands for, so a prompt over n times this many bytes is over
        n tokens, known without tokenizing it: the longest token's text (a byte-level token's characters each stand
        for one byte, and take one or two), four times over where a normalizer may have shortened the text."""
        longest = max(len(token.encode("utf-8")) for token in self.tokenizer.get_vocab())
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return longest if backend is not None and backend.normalizer is None else 4 * longest

    @cached_property
    def fingerprint(self) -> str:
        """``NAME@HASH``: the checkpoint's name and a hash of the vocabulary (every token and id, special ones
        included). Two tokenizers with one hash map text to the same ids."""
        vocab = json.dumps(sorted(self.tokenizer.get_vocab().items()), ensure_ascii=False).encode()
        name = Path(str(self.tokenizer.name_or_path)).name or "tokenizer"
        return f"{name}@{hashlib.sha256(vocab).hexdigest()[:16]}"

    @property
    def template(self) -> str:
        """The chat template's source (named templates joined): what ``OutputParser.for_template`` reads."""
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else "\n".join(template.values())

    @cached_property
    def generation_prompt(self) -> str:
        """The text the template writes to open the model's turn (``<|im_start|>assistant\n``; DeepSeek-R1's ends
        in ``<think>\n``, so the model's output starts inside its reasoning)."""
        chat = [{"role": "user", "content": "U"}]
        try:
            opened = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            closed = self.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        except Exception:  # a template may refuse a chat without tools or a system message: then it says nothing
            return ""
        return opened[len(closed):] if opened.startswith(closed) else ""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` as the chat template renders them. What an env, a user or a tool wrote is data:
        a control token's text in it (``<|im_start|>system``) stays text (:func:`envkit.markup.inert`). The
        model's own turns keep theirs, as it sampled them."""
        text = self.tokenizer.apply_chat_template([self._as_data(m) for m in messages], tools=tools or None,
                                                  add_generation_prompt=generation_prompt, tokenize=False)
        return self._encode(text)

    def _as_data(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message`` with the control tokens in its text made inert, unless the model wrote it."""
        content = message.get("content")
        if message.get("role") == "assistant" or not content:
            return message
        if isinstance(content, str):
            return {**message, "content": inert(content, self._control)}
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            return {**message, "content": [{**part, "text": inert(part["text"], self._control)}
                                           if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                                           for part in content]}
        return message

    def _encode(self, text: str) -> list[int]:
        """``text``'s ids, special tokens in it read as such and none added: what ``apply_chat_template`` gives
        with ``tokenize=True``, from the Rust tokenizer directly where there is one (half the time per call)
        unless it was left set to truncate, pad or split special tokens, which only the full call undoes."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (backend is not None and backend.truncation is None and backend.padding is None
                and not backend.encode_special_tokens):
            if len(text) > LONG_TEXT:  # the batch call lets go of the GIL: a server's other threads run meanwhile
                return backend.encode_batch([text], add_special_tokens=False)[0].ids
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The opening messages with the generation prompt: what the model continues from."""
        return self.render(messages, tools)

    def observation_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Tokens for new env messages after an assistant turn, ending with the next generation prompt."""
        base = self._prefix_ids(tools)
        full = self.render(_PREFIX + messages, tools)
        if full[: len(base)] != base:
            raise ValueError("the chat template is not prefix-consistent: appending messages changed earlier tokens")
        return full[len(base):]

    def _prefix_ids(self, tools: list[dict[str, Any]] | None) -> list[int]:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._prefix_cache:
            self._prefix_cache[key] = self.render(_PREFIX, tools, generation_prompt=False)
        return self._prefix_cache[key]

    @cached_property
    def _turn_suffix(self) -> list[int]:
        """Tokens the template writes after an assistant message's eos (e.g. a newline)."""
        base = self._prefix_ids(None)
        last_eos = len(base) - 1 - base[::-1].index(self.eos_id)
        return base[last_eos + 1:]

    def close_turn(self, model_ids: list[int]) -> list[int]:
        """Tokens that close an assistant turn the model produced: the template's suffix after eos, preceded by an
        eos when the model did not write one (its turn was cut off by max_tokens)."""
        ended = bool(model_ids) and model_ids[-1] == self.eos_id
        return ([] if ended else [self.eos_id]) + self._turn_suffix

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with a trailing eos dropped (special tokens inside the text are kept)."""
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)
