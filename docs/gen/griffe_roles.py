"""A griffe extension that turns the docstrings' reStructuredText into the Markdown mkdocstrings renders: Sphinx
roles (``:class:`~envkit.Env```) become code spans, and a paragraph's closing ``::`` a colon before its code."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const|ref|term):`(~?)([^`]+)`")


def to_markdown(text: str) -> str:
    """``text`` with every Sphinx role as a code span of its target and ``::`` before a literal block as ``:``."""
    # `~a.b.C` shows as `C`, as Sphinx renders it
    text = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
