"""``import_ref``: what a ``"module:attr"`` string names, as entry points, configs (``rubric=``, ``grader=``) and
agent hosts write objects by name. A leaf: it imports nothing else of envkit, so any module may use it."""

from __future__ import annotations

import importlib
from typing import Any


def import_ref(ref: str) -> Any:
    """What ``"module:attr.attr"`` names (the module itself, without ``:attr``); raises what the import or the
    lookup raises."""
    module_name, _, attr = ref.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        found = getattr(found, part)
    return found
