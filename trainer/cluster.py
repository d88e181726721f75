"""Moved: the container cluster tool is ``trainer.container_cluster`` (``python -m trainer.container_cluster``), a
name that says what it is beside ``trainer.placement.cluster`` (a stage's trainer ranks on Ray). This path still
works, with a DeprecationWarning that names the new one."""

from __future__ import annotations

import warnings
from typing import Any

import trainer.container_cluster as _moved

warnings.warn("trainer.cluster moved to trainer.container_cluster (python -m trainer.container_cluster)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The moved module's ``name``."""
    return getattr(_moved, name)


if __name__ == "__main__":
    _moved.main()
