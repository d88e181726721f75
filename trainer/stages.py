"""A run of several stages, each from the weights the one before it left (``stages=[sft, rl]``,
``+recipe=tool_agent``):

    out/sft/    the supervised stage: its checkpoints, metrics, report and final weights (``weights/vN``)
    out/rl/     RL from those weights; its starting policy is the one the SFT stage evaluated last, so it is not
                evaluated again
    out/summary.json, out/report.html
                held-out results before the first stage and after each one, the steps of both, every evaluation's
                rollouts

``trainer.resume=latest`` skips the stages that finished (they wrote ``summary.json``) and resumes the one that was
running from its newest checkpoint (or starts it, if it had written none).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from generators import read_jsonl
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, ModelConfig
from trainer.distill import train_distill
from trainer.loop import train
from trainer.metrics import EVAL_GROUPS, is_eval_row, sample_groups
from trainer.online import train_online
from trainer.placement import launch_stage
from trainer.report import Phase, RunRecord, write_run_report
from trainer.sft import train_sft

RUNS: dict[str, Callable[..., dict[str, Any]]] = {"sft": train_sft, "rl": train, "distill": train_distill,
                                                  "online": train_online}
"""What runs each stage (``config.STAGES`` names them): ``run(cfg, evaluate_before=...) -> results``, built on
trainer/runs.py, whatever the run's number of policies. A new stage is a module with such a function, and a line here
and in ``config.STAGES``."""

HEADLINES = ("accuracy", "greedy_accuracy", "tool_call_rate", "greedy_tool_call_rate", "reward", "greedy_reward")
"""Held-out results reported before the first stage and after each one."""


def run_stages(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.stages`` in order; returns the held-out results before and after each stage and where the
    outputs are."""
    out = Path(cfg.trainer.output_dir)
    model = cfg.model
    by_stage: dict[str, dict[str, Any]] = {}
    for stage in cfg.stages:
        stage_out = out / stage if len(cfg.stages) > 1 else out
        finished = stage_out / "summary.json"
        if cfg.trainer.resume and finished.is_file() and len(cfg.stages) > 1:
            by_stage[stage] = json.loads(finished.read_text())
        else:
            resume = cfg.trainer.resume
            if (len(cfg.stages) > 1 and resume == "latest"
                    and not CheckpointManager(stage_out / "checkpoints", keep_last=1).all()):
                resume = None  # this stage had not saved a checkpoint yet: it starts
            stage_cfg = replace(cfg, stages=[stage], model=model,
                                trainer=replace(cfg.trainer, output_dir=str(stage_out), resume=resume))
            previous = list(by_stage.values())[-1:]
            by_stage[stage] = launch_stage(stage_cfg, RUNS[stage], evaluate_before=not _evaluated(previous))
            _release_memory()
        model = handed_on(model, by_stage[stage])
    if len(cfg.stages) == 1:
        return by_stage[cfg.stages[0]]
    results = combine(cfg.stages, by_stage)
    results.update({key: value for key, value in by_stage[cfg.stages[-1]].items() if key.startswith("weights/")})
    results["weights"] = model.path
    results["report"] = str(write_stages_report(cfg, by_stage, results, out / "report.html"))
    results["output_dir"] = str(out)
    (out / "summary.json").write_text(json.dumps({**results, "stages_results": by_stage}, indent=2) + "\n")
    return results


def handed_on(model: ModelConfig, results: dict[str, Any]) -> ModelConfig:
    """The next stage's starting weights: the model a stage trained (``weights``); with seats, those of the policy
    its results name (``policy``: a seat's sft stage), or each policy's (``weights/NAME``)."""
    by_policy = {key.removeprefix("weights/"): value for key, value in results.items() if key.startswith("weights/")}
    if "policy" in results:
        by_policy[results["policy"]] = results["weights"]
    elif "weights" in results:
        model = replace(model, path=results["weights"])
    return replace(model, policy_paths={**model.policy_paths, **by_policy})


def _evaluated(previous: Iterable[dict[str, Any]]) -> bool:
    """Whether the stage before (``previous``: its results, or none) evaluated the policy the next one starts from
    (held-out results after)."""
    return any(f"{name}_after" in results for results in previous for name in HEADLINES)


def _release_memory() -> None:
    """Hand a finished stage's memory back to the OS before the next stage loads its model and starts its server:
    glibc keeps freed heap pages (4.8 GB after a short SFT stage here, 0.7 GB once trimmed)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def combine(stages: list[str], by_stage: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``NAME_before`` (the first stage's), ``NAME_after_STAGE`` for each stage and ``NAME_after`` (the last's) for
    every headline result any stage reported."""
    results: dict[str, Any] = {"stages": list(stages)}
    for name in HEADLINES:
        # the first stage that evaluated the policy it started from (a seat's sft stage plays no held-out episodes)
        before = next((by_stage[s][f"{name}_before"] for s in stages if f"{name}_before" in by_stage[s]), None)
        if before is not None:
            results[f"{name}_before"] = before
        for stage in stages:
            after = by_stage[stage].get(f"{name}_after")
            if after is not None:
                results[f"{name}_after_{stage}"] = results[f"{name}_after"] = after
    return results


def write_stages_report(cfg: Config, by_stage: dict[str, dict[str, Any]], results: dict[str, Any],
                        path: Path) -> Path:
    """One report for the whole run: the stages' steps one after the other, every held-out evaluation, the rollouts
    of each evaluation, and links to each stage's own report."""
    out = path.parent
    steps: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    phases: list[Phase] = []
    offset = 0
    for stage in cfg.stages:
        file = out / stage / "metrics.jsonl"
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []
        stage_steps = list({r["step"]: r for r in rows if not is_eval_row(r)}.values())  # a resumed step: its last row
        steps += [{**r, "step": r["step"] + offset} for r in stage_steps]
        evals += [{**r, "step": r["step"] + offset} for r in rows if is_eval_row(r)]
        for file in sorted((out / stage / "evals").glob("step-*.jsonl")):
            step = int(file.stem.removeprefix("step-"))
            trajectories = list(read_jsonl(file))
            phases.append(Phase(f"{stage}-eval-{step}", f"{stage}: held-out eval at its step {step}",
                                sample_groups(trajectories, EVAL_GROUPS), len(trajectories)))
        offset += max((r["step"] for r in stage_steps), default=0)
    headline = {key: value for key, value in results.items() if key.startswith(HEADLINES)}
    links = {f"{stage} report": by_stage[stage].get("report", "") for stage in cfg.stages}
    run = RunRecord(title=f"envkit train: {' → '.join(cfg.stages)} on {cfg.env.display_name}",
                    config=asdict(cfg), results={**headline, **links}, steps=steps, evals=_merged(evals),
                    phases=phases, curves_svg=_curves(evals, cfg.stages))
    return write_run_report(run, path)


def _merged(evals: list[dict[str, float]]) -> list[dict[str, float]]:
    """Evaluation rows of one step (accuracy, greedy accuracy, loss) as one row."""
    merged: dict[float, dict[str, float]] = {}
    for row in evals:
        merged.setdefault(row["step"], {}).update(row)
    return [merged[step] for step in sorted(merged)]


def _curves(evals: list[dict[str, float]], stages: list[str]) -> str:
    """Held-out accuracy and tool-call rate at every evaluation of the run, as inline SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _merged(evals)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for key, style, label in (("eval/accuracy", "o-", "held-out accuracy"),
                              ("eval/greedy_accuracy", "s--", "held-out greedy accuracy"),
                              ("eval/tool_call_rate", "^:", "episodes calling a tool")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xlabel("step (" + " then ".join(stages) + ")")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    return svg.getvalue()[svg.getvalue().index("<svg"):]
