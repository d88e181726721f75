"""Reading final answers out of model text, tolerant of the formats models actually use."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

_NUMBER = r"[-−]?\s*\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?"
_FORMATS: list[tuple[str, re.Pattern[str]]] = [
    ("hashes", re.compile(r"####\s*(" + _NUMBER + ")")),
    ("boxed", re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")),
    ("answer_is", re.compile(r"answer\s*(?:is\s*:?|:|=)\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)),
]
_BARE_NUMBER = re.compile(_NUMBER)

AnswerFormat = Literal["hashes", "boxed", "answer_is", "bare"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A number found in model text, and the format it was given in."""

    text: str
    value: float
    format: AnswerFormat

    @property
    def explicit(self) -> bool:
        """True when the model marked the answer (``####``, ``\\boxed{}``, "the answer is")."""
        return self.format != "bare"


def parse_number(text: str) -> float | None:
    """Parse ``"1,234"``, ``"-3.5"``, ``"$12"``, ``"3/4"`` or ``"−7"`` to a float; None if it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").replace("−", "-").replace(" ", "").rstrip(".")
    try:
        return float(Fraction(cleaned)) if "/" in cleaned else float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str | None) -> Answer | None:
    """The final numeric answer in ``text``: the last marked one (``#### 19``, ``\\boxed{19}``,
    "The answer is 19") if any, else the last number in the text; None when there is no number."""
    if not text:
        return None
    for fmt, pattern in _FORMATS:
        matches = pattern.findall(text)
        if matches:
            value = parse_number(matches[-1])
            if value is not None:
                return Answer(matches[-1].strip(), value, fmt)  # type: ignore[arg-type]
    bare = _BARE_NUMBER.findall(text)
    if bare:
        value = parse_number(bare[-1])
        if value is not None:
            return Answer(bare[-1].strip(), value, "bare")
    return None


def grade_number(text: str | None, expected: float) -> dict[str, Any]:
    """Grade the final number of ``text`` against ``expected``: ``correct``, ``parsed_answer``, ``expected``,
    ``format`` (None when no number was found) and ``explicit`` (the answer was marked)."""
    answer = extract_answer(text)
    return {
        "correct": answer is not None and math.isclose(answer.value, expected, rel_tol=1e-9, abs_tol=1e-9),
        "parsed_answer": None if answer is None else answer.value,
        "expected": expected,
        "format": None if answer is None else answer.format,
        "explicit": answer is not None and answer.explicit,
    }
