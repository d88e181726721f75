"""trainer: RL on any envkit env, wherever it runs (in-process, ``ws://``, Docker sandboxes, OpenEnv, gymnasium).

From the command line, ``python -m trainer [overrides]``; from Python, the same overrides::

    import trainer

    results = trainer.run(["env.name=ws://127.0.0.1:8000/arithmetic", "trainer.steps=10"])

The configuration schema is :mod:`trainer.config`, the defaults ``trainer/conf``, the loop :mod:`trainer.loop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import Config

__all__ = ["CONF_DIR", "compose", "run"]

CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The Hydra configs: ``config.yaml`` (the defaults) and one directory per config group."""


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The run's config: ``trainer/conf`` with Hydra ``overrides`` applied, validated (ConfigError if invalid)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = hydra_compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_object(raw)  # type: ignore[return-value]


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Compose the config from ``overrides`` and train (here, or on Ray with ``placement.backend=ray``); returns the
    results ``python -m trainer`` prints."""
    from trainer.launch import launch

    return launch(compose(overrides))
