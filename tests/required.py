"""Parts the tests need that `make test` installs (a Docker engine, DeepSpeed): under it a missing one fails
the run and names the part, so a broken install cannot pass as skips. Run by hand elsewhere (``pytest`` without
``ENVKIT_TESTS_STRICT=1``, which the Makefile sets), their tests skip with the reason instead."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

STRICT = os.environ.get("ENVKIT_TESTS_STRICT") == "1"


def missing(part: str, why: str) -> NoReturn:
    """Fail (under `make test`) or skip (elsewhere) because ``part`` cannot be used; works at module level too."""
    if STRICT:
        pytest.fail(f"{part} is required under `make test`, which installs it, but {why}", pytrace=False)
    pytest.skip(f"{part} cannot be used here: {why}", allow_module_level=True)


def require_module(name: str, install: str) -> ModuleType:
    """Import ``name``, or fail/skip naming it and how ``install`` gets it."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or a package failing at import (DeepSpeed probing its accelerator)
        error = f"{type(e).__name__}: {e}"
    missing(name, f"it cannot be imported ({error}); {install}")
