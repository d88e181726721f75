"""Run logging: a rich progress line, TensorBoard events, optional wandb, metrics.jsonl, and at the end the
curves (PNG, and SVG in the report) and the run's HTML report (``trainer/report.py``)."""

from __future__ import annotations

import io
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.tensorboard import SummaryWriter

from generators.report import passed, rubric_stats, tool_stats
from generators.trajectory import Trajectory, write_jsonl
from trainer.batching import StepBatch
from trainer.config import Config
from trainer.report import Phase, RunRecord, write_run_report

STEP_GROUPS = 2
"""Groups of each env kept per training step for the report (the step's whole batch is in TensorBoard)."""
EVAL_GROUPS = 8
"""Held-out tasks of each env kept per evaluation for the report (every sample of each)."""
MAX_STEP_PHASES = 50
"""Training steps whose samples the report shows, evenly spaced over a longer run (and always the last)."""


class RunLogger:
    """Everything a run reports, written under ``out`` (rank 0 only)."""

    def __init__(self, out: Path, cfg: Config, *, total_steps: int, start_step: int = 0, stage: str = "rl") -> None:
        self.out = out
        self.cfg = cfg
        self.stage = stage
        """rl or sft: what the curves show (rewards, or losses)."""
        out.mkdir(parents=True, exist_ok=True)
        self.console = Console(stderr=True)
        self.env_names = ", ".join(m.display_name for m in cfg.env.members)
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        """One row per held-out evaluation: ``step`` and its ``eval/...`` metrics."""
        self.phases: list[Phase] = []
        """Sampled trajectories of every evaluation and step, for the report."""
        self.last_trajectories: list[Trajectory] = []
        self.eval_trajectories: list[Trajectory] = []
        if start_step:  # resumed: the curves and tables continue the interrupted run's
            self._reload(out / "metrics.jsonl", start_step)
        self._metrics_file = (out / "metrics.jsonl").open("a")
        self.tb = SummaryWriter(str(out / "tensorboard")) if cfg.logging.tensorboard else None
        self.wandb = self._init_wandb() if cfg.logging.wandb else None
        self.progress = Progress(
            TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[headline]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, disable=not cfg.logging.progress,
        )
        self.task = self.progress.add_task("train", total=total_steps, headline="-", tps="-")
        self.progress.start()
        self._t0 = time.perf_counter()

    def _reload(self, path: Path, start_step: int) -> None:
        """The steps and evaluations up to ``start_step`` that an earlier process of this run logged."""
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        rows = [r for r in rows if r["step"] <= start_step]
        steps = {r["step"]: r for r in rows if not is_eval_row(r)}  # the last write of a step wins
        self.history = [steps[s] for s in sorted(steps)]
        for row in rows:
            if is_eval_row(row):
                self._add_eval(row["step"], {k: v for k, v in row.items() if k != "step"})

    def _add_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self.evals and self.evals[-1]["step"] == step:
            self.evals[-1].update(metrics)
        else:
            self.evals.append({"step": step, **metrics})

    def _init_wandb(self) -> Any:
        os.environ.setdefault("WANDB_MODE", self.cfg.logging.wandb_mode)
        import wandb  # optional dependency, only with logging.wandb=true

        return wandb.init(project=self.cfg.logging.wandb_project, dir=str(self.out), config=asdict(self.cfg))

    def log_step(self, step: int, metrics: dict[str, float], trajectories: list[Trajectory]) -> None:
        """Record one training step's metrics, and with ``logging.rollouts`` its rollouts (a step logged again after
        a resume writes its file again)."""
        self.history.append({"step": step, **metrics})
        if trajectories:
            self.last_trajectories = trajectories
            self.phases.append(Phase(f"step-{step}", f"step {step}", sample_groups(trajectories, STEP_GROUPS),
                                     len(trajectories)))
            if self.cfg.logging.rollouts:
                write_jsonl(trajectories, self.out / "rollouts" / f"step-{step:06d}.jsonl")
        self._metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics_file.flush()
        self._scalars(step, metrics)
        step_s = metrics.get("time/step_s", 0.0)
        tokens = metrics.get("rollout/model_tokens", metrics.get("train/tokens", 0.0))
        headline = (f"reward {metrics['reward/mean']:.3f}" if "reward/mean" in metrics
                    else f"loss {metrics.get('train/loss', 0.0):.4f}")
        self.progress.update(self.task, completed=step, headline=headline,
                             tps=f"{tokens / step_s if step_s else 0.0:.0f}")
        if not self.cfg.logging.progress or not self.console.is_terminal:  # a bar draws only on a terminal
            loss = f", loss {metrics.get('train/loss', 0.0):.4f}" if "reward/mean" in metrics else ""
            self.console.print(f"step {step}: {headline}{loss}, {step_s:.1f} s")

    def log_eval(self, step: int, name: str, values: dict[str, float], trajectories: list[Trajectory]) -> None:
        """Record one held-out evaluation: ``name`` (accuracy or greedy_accuracy) with the mean reward and, for a
        mixture, both per env (``values`` keys as in :func:`trainer.runs.evaluate`); or the supervised stage's
        held-out ``loss``. An accuracy evaluation's rollouts go to ``evals/step-N.jsonl``."""
        metrics = {f"eval/{key}": value for key, value in values.items()}
        self._add_eval(step, metrics)
        if name == "accuracy":
            self.eval_trajectories = trajectories
            self.phases.append(Phase(f"eval-{step}", f"held-out eval at step {step}",
                                     sample_groups(trajectories, EVAL_GROUPS), len(trajectories)))
            write_jsonl(trajectories, self.out / "evals" / f"step-{step:06d}.jsonl")
        self._metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics_file.flush()
        self._scalars(step, metrics)
        if name == "loss":
            self.progress.console.print(f"held-out loss at step {step}: {values[name]:.4f}")
            return
        reward = values.get("reward" if name == "accuracy" else "greedy_reward", 0.0)
        calls = values.get("tool_call_rate" if name == "accuracy" else "greedy_tool_call_rate")
        tools = f", {calls:.1%} of episodes call a tool" if calls is not None else ""
        self.progress.console.print(f"held-out {name.replace('_', ' ')} at step {step}: {values[name]:.1%}, mean "
                                    f"reward {reward:.3f}{tools} ({len(trajectories)} rollouts)")

    def _scalars(self, step: int, metrics: dict[str, float]) -> None:
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self, results: dict[str, Any]) -> dict[str, Any]:
        """Write the reward curve, the HTML report and summary.json; returns their paths."""
        self.progress.stop()
        curve, svg = self._curves(self.out / "reward_curve.png")
        results = {**results, "wall_s": round(time.perf_counter() - self._t0, 1), "output_dir": str(self.out)}
        run = RunRecord(title=f"envkit train: {self.env_names}", config=asdict(self.cfg), results=results,
                        steps=self.history, evals=self.evals, phases=_thin(self.phases, MAX_STEP_PHASES),
                        curves_svg=svg)
        report = write_run_report(run, self.out / "report.html")
        write_jsonl(self.eval_trajectories + self.last_trajectories, self.out / "final_trajectories.jsonl")
        paths = {"reward_curve": str(curve), "report": str(report), "metrics": str(self.out / "metrics.jsonl"),
                 "tensorboard": str(self.out / "tensorboard")}
        (self.out / "summary.json").write_text(json.dumps({**results, **paths}, indent=2) + "\n")
        return paths

    def _curves(self, path: Path) -> tuple[Path, str]:
        """Train reward per step (per env too, for a mixture) and held-out accuracy and mean reward per
        evaluation: written to ``path`` (PNG) and returned as inline SVG for the report."""
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.2))
        steps = [h["step"] for h in self.history]
        supervised = self.stage == "sft"
        if supervised:
            losses = ax.twinx()
            losses.plot(steps, [h.get("train/loss", float("nan")) for h in self.history], "C3-", label="train loss")
            held = [(e["step"], e["eval/loss"]) for e in self.evals if "eval/loss" in e]
            if held:
                losses.plot(*zip(*held, strict=True), "C3o--", label="held-out loss")
            losses.set_ylabel("loss (mean NLL of model tokens)")
            losses.set_ylim(bottom=0)
            losses.legend(fontsize=8, loc="upper right")
        else:
            ax.plot(steps, [h.get("reward/mean", 0.0) for h in self.history], label="train reward (mean)")
        for member in self.cfg.env.members if len(self.cfg.env.members) > 1 and not supervised else []:
            key = f"env/{member.display_name}/reward/mean"
            ax.plot(steps, [h.get(key, float("nan")) for h in self.history], alpha=0.6,
                    label=f"train reward: {member.display_name}")
        for key, style, label in (("eval/accuracy", "o--", "held-out accuracy"),
                                  ("eval/reward", "s:", "held-out mean reward")):
            points = [(e["step"], e[key]) for e in self.evals if key in e]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=label)
        if self.cfg.trainer.mode == "async":  # how far behind the trained policy each step's rollouts were sampled
            versions = ax.twinx()
            versions.plot(steps, [h.get("rollout/staleness_mean", 0.0) for h in self.history], "c-.",
                          label="staleness (mean, versions)")
            versions.plot(steps, [h.get("rollout/staleness", 0.0) for h in self.history], "m:",
                          label="staleness (max, versions)")
            versions.set_ylim(-0.1, self.cfg.trainer.max_staleness + 1.1)
            versions.set_ylabel("staleness")
            versions.legend(fontsize=8, loc="lower right")
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
        what = "sft" if supervised else self.cfg.algorithm.advantage
        ax.set_title(f"{self.env_names}: {what} on {self.cfg.model.path}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        plt.close(fig)
        return path, svg.getvalue()[svg.getvalue().index("<svg"):]

    def note(self, text: str) -> None:
        """A line for the person watching the run."""
        self.console.print(text)

    def close(self) -> None:
        """Flush and close every sink."""
        self.progress.stop()
        self._metrics_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class NullLogger:
    """The logger of a rank that reports nothing (ranks above 0): every call does nothing."""

    @property
    def evals(self) -> list[dict[str, float]]:
        """None logged."""
        return []

    def log_step(self, step: int, metrics: dict[str, float], trajectories: list[Trajectory]) -> None:
        """Nothing."""

    def log_eval(self, step: int, name: str, values: dict[str, float], trajectories: list[Trajectory]) -> None:
        """Nothing."""

    def note(self, text: str) -> None:
        """Nothing."""

    def finish(self, results: dict[str, Any]) -> dict[str, Any]:
        """No files: no paths."""
        return {}

    def close(self) -> None:
        """Nothing to close."""


def rollout_metrics(trajs: list[Trajectory], batch: StepBatch, version: int) -> dict[str, float]:
    """Reward, pass rate, lengths, stop reasons and staleness of one step's rollouts; per env for a mixture."""
    metrics = _outcomes(trajs)
    metrics.update({
        "rollout/response_tokens": _mean([t.num_model_tokens for t in trajs if not t.failed]),
        "rollout/turns": _mean([t.num_turns for t in trajs if not t.failed]),
        "rollout/staleness": max((version - t.policy_version for t in trajs), default=0),
        "rollout/staleness_mean": _mean([version - t.policy_version for t in trajs]),
        "rollout/stale_dropped": batch.counts.get("stale_dropped", 0),
        "rollout/trained": batch.counts.get("trained", 0),
        "rollout/failed": batch.counts.get("failed", 0),
        "rollout/zero_variance_groups": batch.counts.get("zero_variance_groups", 0),
        "rollout/zero_variance_groups_passed": batch.counts.get("zero_variance_groups_passed", 0),
    })
    shared = [t.branch_turn for t in trajs if t.branch_turn is not None and not t.failed]
    if shared:
        metrics["rollout/branch_turn"] = _mean(shared)
    metrics["reward/group_std"] = _mean(_group_stds(trajs))
    if refused := sum(t.refused_calls for t in trajs):
        metrics["agent/refused_calls"] = refused  # an agent process spending a key not its own
    labels = sorted({t.env_name for t in trajs})
    if len(labels) > 1:
        trained = {t.group_id for t in batch.trajectories}  # groups left after the failed and flat ones
        for label in labels:
            mine = [t for t in trajs if t.env_name == label]
            metrics.update({f"env/{label}/{k}": v for k, v in _outcomes(mine).items()})
            metrics[f"env/{label}/rollouts"] = len(mine)
            metrics[f"env/{label}/trained"] = sum(not t.failed and t.group_id in trained for t in mine)
    metrics.update({f"tools/{k}": v for k, v in tool_stats(trajs).items()})
    metrics.update({f"rubric/{k}": v for k, v in rubric_stats(trajs).items()})
    gen_s = sum(t.timings.get("generate", 0.0) for t in trajs)
    metrics["rollout/model_tokens"] = sum(t.num_model_tokens for t in trajs)
    metrics["train/tokens"] = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch.trajectories)
    metrics["rollout/tokens_per_rollout_s"] = metrics["rollout/model_tokens"] / gen_s if gen_s else 0.0
    return metrics


def step_outcomes(trajs: list[Trajectory]) -> dict[str, float]:
    """A step's outcomes over all its rollouts (every seat's, in a run of several policies): mean reward, pass rate,
    stop reasons and failed rollouts."""
    return {**_outcomes(trajs), "rollout/failed": sum(t.failed for t in trajs)}


def _outcomes(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean reward and pass rate of the rollouts that finished, and a count per stop reason."""
    done = [t for t in trajs if not t.failed]
    metrics = {"reward/mean": _mean([t.reward for t in done]),
               "reward/pass_rate": _mean([passed(t) for t in done])}
    for reason, count in Counter(t.stop_reason for t in trajs).items():
        metrics[f"stop/{reason}"] = count
    return metrics


def _group_stds(trajs: list[Trajectory]) -> list[float]:
    """The spread of reward within each group of two or more finished rollouts: what its advantages compare."""
    groups: dict[str, list[float]] = {}
    for t in trajs:
        if not t.failed:
            groups.setdefault(t.group_id, []).append(t.reward)
    return [statistics.pstdev(rewards) for rewards in groups.values() if len(rewards) > 1]


def is_eval_row(row: dict[str, Any]) -> bool:
    """A metrics.jsonl row written by an evaluation (only ``eval/`` keys beside the step)."""
    return all(key.startswith("eval/") for key in row if key != "step")


def _thin(phases: list[Phase], limit: int) -> list[Phase]:
    """Every evaluation, and at most ``limit`` training steps: evenly spaced, the last one included."""
    steps = [p for p in phases if p.key.startswith("step-")]
    if len(steps) <= limit:
        return phases
    keep = {id(steps[round(i * (len(steps) - 1) / (limit - 1))]) for i in range(limit)}
    return [p for p in phases if not p.key.startswith("step-") or id(p) in keep]


def sample_groups(trajectories: list[Trajectory], groups: int) -> list[Trajectory]:
    """Every rollout of the first ``groups`` groups of each env."""
    kept: dict[str, list[str]] = {}
    for t in trajectories:
        ids = kept.setdefault(t.env_name, [])
        if t.group_id not in ids and len(ids) < groups:
            ids.append(t.group_id)
    return [t for t in trajectories if t.group_id in kept[t.env_name]]


def _mean(values: list[float] | list[int] | list[bool]) -> float:
    return sum(values) / len(values) if values else 0.0
