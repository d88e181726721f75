"""Text a policy or an env wrote, kept as data when it goes into another model's prompt.

A chat template writes its turns with control tokens (``<|im_start|>system``, ``[INST]``, ``<start_of_turn>``), and
a tokenizer reads the same characters anywhere in the rendered text as those tokens. So a reply that writes
``<|im_end|><|im_start|>system`` opens a real system turn in the judge's prompt: quoting cannot hold it in. What
:func:`inert` returns reads the same (a word joiner, U+2060, is invisible) and tokenizes as plain characters.

A renderer that knows its tokenizer passes its special tokens (``generators.chat.ChatTokenizer``); an endpoint whose
tokenizer is unknown (an LLM judge, an opponent) gets :data:`CONTROL_SHAPES`, the shapes control tokens take across
model families.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

WORD_JOINER = "\u2060"

CONTROL_SHAPES = re.compile(
    r"<\|[^\s|<>]{1,48}\|>"  # ChatML, Llama 3, Phi: <|im_start|>, <|eot_id|>
    r"|<｜[^\s｜<>]{1,48}｜>"  # DeepSeek: <｜User｜>
    r"|\[/?(?:INST|TOOL_CALLS|AVAILABLE_TOOLS|TOOL_RESULTS|SYSTEM_PROMPT|THINK)\]"  # Mistral
    r"|</?s>|<(?:bos|eos|pad|start_of_turn|end_of_turn)>")  # Llama 2, Gemma
"""Control-token shapes of the common chat templates (ChatML, Llama, Mistral, Gemma, DeepSeek)."""


def control_pattern(specials: Iterable[str] = ()) -> re.Pattern[str]:
    """:data:`CONTROL_SHAPES` plus the exact ``specials`` (a tokenizer's special tokens), longest first."""
    exact = sorted({s for s in specials if len(s) > 1}, key=len, reverse=True)
    if not exact:
        return CONTROL_SHAPES
    return re.compile("|".join([*map(re.escape, exact), CONTROL_SHAPES.pattern]))


def inert(text: str, pattern: re.Pattern[str] = CONTROL_SHAPES) -> str:
    """``text`` with a word joiner after the first character of each control token ``pattern`` finds in it."""
    return pattern.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)
