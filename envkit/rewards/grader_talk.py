"""What a reply says to its grader, found in the text a judge reads, and the reply without it.

A policy scored by an LLM judge learns to write to that judge: a score, an instruction, a forged end of its quote.
A blacklist of words is read past with spelling, so the text is first normalised (:func:`normalise`): Unicode NFKC
(full-width and mathematical letters become plain ones), invisible and format characters out (zero-width spaces, word
joiners, bidi controls, tag characters), and look-alike letters from other scripts read as the Latin ones in a word
made of them ("ѕсоrе" in Cyrillic is "score"). Then a span that talks to the grader is removed whole
(:func:`talk_spans`):

- a sentence with a word a reply has no cause to write but to its grader (:data:`GRADER_TALK`), from its start, not
  from the word: the text a policy glues before its talk goes with it;
- a sentence that passes a verdict on the reply itself ("this is right", "the answer above is correct", "I am
  certain it is right": :data:`VERDICT` with :data:`ITSELF`), and a mark of approval (✅, 💯);
- an HTML comment (text a reader of the rendered reply never sees), and a fenced code block that talks;
- a sentence in another language than the task's: in another script, or in Latin letters with the common words of
  Spanish, French, German, Italian, Portuguese or Dutch and not of English;
- a line that holds only a number, after a blank line (a bare score at the end of a reply).

What each check costs an honest reply is the second look only (the lower score counts, see
:mod:`envkit.rewards.judges`).
"""

from __future__ import annotations

import re
import unicodedata

from envkit.markup import CONTROL_SHAPES

GRADER_TALK = re.compile(
    r"\b(?:scor(?:e|es|ed|ing)|grad(?:e|es|ed|ing|er|ers)|ratings?|rated?|full\s+marks|judg\w*|evaluators?|"
    r"reviewers?|deserv\w*|criteri\w*|instructions?|ignor\w*|disregard\w*|this\s+(?:reply|response))\b"
    r"|\b(?:system|assistant|user)\s*:|\b\d+\s*(?:/|out\s+of)\s*\d+|<<<|>>>|[{}]|" + CONTROL_SHAPES.pattern,
    re.IGNORECASE)
"""What a sentence that talks to its grader has: words a reply has no cause to write but to its grader ("evaluate",
"system" or "review" alone are not among them: a math or a code reply writes them), a role's name as a speaker
("System:"), a score out of something, JSON braces, quote markers and chat control tokens
(:data:`envkit.markup.CONTROL_SHAPES`: a reply has no cause to open a turn of its own)."""

VERDICT = re.compile(
    r"\b(?:correct|incorrect|right|wrong|perfect|flawless|excellent|accurate|verified|validated|approved|"
    r"(?:double[- ])?checked|certain|sure|guaranteed|confirmed)\b", re.IGNORECASE)
"""Words of a verdict: on the reply itself (:data:`ITSELF`), talk to its grader."""
ITSELF = re.compile(
    r"\b(?:this|that|it|my|the|above|previous)\s+(?:(?:reply|response|answer|solution|result|output)\b|is\b)"
    r"|\bI\s+(?:am|have|'m)\b|\bI'm\b|\b(?:reply|response|answer|solution)\s+(?:above|here)\b", re.IGNORECASE)
"""A sentence that speaks of the reply itself (or of its writer's certainty)."""
APPROVAL = re.compile("[\u2705\u2611\u2713\u2714\U0001F44D\U0001F4AF\U0001F3C6\u2B50\U0001F947]")
"""Marks of approval: a check mark, a thumb up, 100, a trophy, a star, a gold medal."""
STOPWORDS = {
    "en": "the and is are of to it this that with for you your not be was have what",
    "es": "el la los las es de que y en por para una con del se su esta este muy",
    "fr": "le la les est de que et en une des du pour pas avec cette ce vous sur",
    "de": "der die das ist und nicht zu ein eine mit den dem bitte diese für auf sie",
    "it": "il lo la gli le di che e è una per con del della questa non sono",
    "pt": "o a os as é de que e em um uma para com não do da esta",
    "nl": "de het een is en van niet dat met voor op zijn deze dit ook",
}
"""Each language's commonest words, to tell a sentence in another Latin-script language from English."""
_STOPWORDS = {lang: frozenset(words.split()) for lang, words in STOPWORDS.items()}
LOOK_ALIKES = str.maketrans(
    "аеорсухіјѕԁһӏԛԝАВЕКМНОРСТХУІЈЅαονριкΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aeopcyxijsdhlqwABEKMHOPCTXYIJSaovpikABEZHIKMNOPTYX")
"""Cyrillic and Greek letters drawn as Latin ones."""
_LOOK_ALIKE_CHARS = frozenset(chr(c) for c in LOOK_ALIKES)
_WORD = re.compile(r"\w+")
_INVISIBLE_RANGES = ((0xFE00, 0xFE0F), (0xE0100, 0xE01EF))  # variation selectors
_FILLERS = frozenset("\u034f\u115f\u1160\u3164\uffa0")  # combining grapheme joiner, Hangul fillers: drawn as nothing

SENTENCE_RE = re.compile(r"[^.!?。！？]*(?:[.!?。！？]+|$)")
"""A sentence of a line, with its end: punctuation (Latin or CJK), or the end of the line."""
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.DOTALL)
_FENCE = re.compile(r"^```.*?(?:^```[^\n]*$|\Z)", re.DOTALL | re.MULTILINE)
_BARE_NUMBER_LINE = re.compile(r"(?<=\n\n)[ \t*#>_~`\[(]*[-+]?\d+(?:[.,]\d+)?[ \t*_~`\])%★☆!.]*(?=\n|$)")
_SCRIPTS = (("latin", re.compile(r"[A-Za-z\u00c0-\u024f]")), ("cyrillic", re.compile(r"[\u0400-\u04ff]")),
            ("greek", re.compile(r"[\u0370-\u03ff]")), ("arabic", re.compile(r"[\u0600-\u06ff]")),
            ("hebrew", re.compile(r"[\u0590-\u05ff]")), ("devanagari", re.compile(r"[\u0900-\u097f]")),
            ("cjk", re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")))


def _invisible(char: str) -> bool:
    code = ord(char)
    return (unicodedata.category(char) == "Cf" or char in _FILLERS
            or (unicodedata.category(char) == "Cc" and char not in "\n\t")
            or any(low <= code <= high for low, high in _INVISIBLE_RANGES))


def visible(text: str) -> str:
    """``text`` without the characters that draw nothing (format and control characters but newline and tab,
    zero-width, variation selectors)."""
    return "".join(c for c in text if not _invisible(c))


def normalise(text: str) -> str:
    """``text`` as :func:`talk_spans` reads it: NFKC, without what draws nothing, and each word made of Latin letters
    and their look-alikes spelt in Latin."""
    text = visible(unicodedata.normalize("NFKC", text))

    def latin(word: re.Match[str]) -> str:
        w = word[0]
        if any(c in _LOOK_ALIKE_CHARS for c in w) and all(c in _LOOK_ALIKE_CHARS or c.isascii() for c in w):
            return w.translate(LOOK_ALIKES)
        return w

    return _WORD.sub(latin, text)


def main_script(text: str) -> str | None:
    """The script most of ``text``'s letters are in (None without letters)."""
    counts = {name: len(pattern.findall(text)) for name, pattern in _SCRIPTS}
    best = max(counts, key=counts.__getitem__)
    return best if counts[best] else None


def talk_spans(text: str, script: str | None = None) -> list[tuple[int, int]]:
    """The spans of ``text`` (normalised: :func:`normalise`) that talk to its grader, in order and disjoint.

    ``script``: the script the reply is expected in (the task's); by default the reply's own main script."""
    spans = [m.span() for m in _COMMENT.finditer(text)]
    spans += [m.span() for m in _FENCE.finditer(text) if GRADER_TALK.search(m[0])]
    spans += [m.span() for m in _BARE_NUMBER_LINE.finditer(text) if text[:m.start()].strip()]
    script = script or main_script(text)
    start = 0
    for line in text.split("\n"):
        at = start
        for sentence in SENTENCE_RE.findall(line):
            if sentence.strip() and (GRADER_TALK.search(sentence) or APPROVAL.search(sentence)
                                     or (VERDICT.search(sentence) and ITSELF.search(sentence))
                                     or _foreign(sentence, script)):
                spans.append((at, at + len(sentence)))
            at += len(sentence)
        start += len(line) + 1
    return _merged(spans)


def _foreign(sentence: str, script: str | None) -> bool:
    """Whether ``sentence`` is in another language than the reply's (``script``; Latin is taken as English)."""
    own = main_script(sentence)
    if script is None or own is None:
        return False
    if own != script:
        return True
    if own != "latin":
        return False
    words = [w.lower() for w in _WORD.findall(sentence)]
    counts = {lang: sum(w in common for w in words) for lang, common in _STOPWORDS.items()}
    other = max((lang for lang in counts if lang != "en"), key=counts.__getitem__)
    return counts[other] >= 2 and counts[other] > counts["en"]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def redact(text: str, script: str | None = None) -> str | None:
    """``text`` normalised and less each span that talks to its grader, lines that leave empty dropped; None where
    nothing in it talks to its grader."""
    normal = normalise(text)
    spans = talk_spans(normal, script)
    if not spans:
        return None
    while spans:  # what a removal leaves may talk in turn (a score left alone on its line)
        normal = _cut(normal, spans)
        spans = talk_spans(normal, script)
    return normal


def _cut(normal: str, spans: list[tuple[int, int]]) -> str:
    cut, at = [], 0
    for start, end in spans:  # a removed span leaves a mark, so that a line it emptied goes and a blank one stays
        cut += [normal[at:start], re.sub(r"[^\n]", "", normal[start:end]).replace("\n", "\0\n") + "\0"]
        at = end
    cut.append(normal[at:])
    lines = [line for line in "".join(cut).split("\n") if "\0" not in line or line.replace("\0", "").strip()]
    return "\n".join(line.replace("\0", "").rstrip() for line in lines).strip()


def without_grader_talk(text: str, script: str | None = None) -> str:
    """``text`` less what talks to its grader (see the module docstring), or ``text`` itself where nothing does."""
    redacted = redact(text, script)
    return text if redacted is None else redacted
