"""A training run's ``report.html``: one self-contained page that shows the run itself.

Sections: the results (held-out metrics before → after), the curves (an inline SVG), a per-step metrics table, every
held-out evaluation, the composed configuration, and sampled trajectories browsable by phase (an evaluation or a
training step), env and outcome. The filters are a few lines of inline script that read and write the URL's
fragment (``#phase=step-3&env=sums&status=passed``), so a filtered view can be linked to. Every string is escaped.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from generators.report import CSS, escape, kv_table, outcome, trajectory_html
from generators.trajectory import Trajectory

STEP_COLUMNS = {
    "reward/mean": "reward", "reward/pass_rate": "pass rate", "rollout/turns": "turns",
    "rollout/response_tokens": "model tokens/rollout", "rollout/trained": "trained", "rollout/failed": "failed",
    "rollout/zero_variance_groups": "flat groups", "rollout/staleness": "staleness",
    "rollout/stale_dropped": "stale dropped", "tools/episodes_with_call": "calling a tool",
    "tools/calls_per_episode": "tool calls/episode", "tools/errors": "tool errors", "tools/timeouts": "tool timeouts",
    "tools/unparsed": "unreadable calls", "train/loss": "loss", "train/grad_norm": "grad norm",
    "train/entropy": "entropy", "train/clip_fraction": "clipped", "train/tokens_per_s": "train tokens/s",
    "time/generate_s": "generate s", "time/train_s": "train s", "time/step_s": "step s",
}
"""metrics.jsonl keys shown in the per-step table, and their column titles (the file has them all)."""


@dataclass
class Phase:
    """Trajectories of one moment of the run: an evaluation or a training step."""

    key: str
    """``eval-0``, ``step-3``: the value the phase filter selects."""
    title: str
    trajectories: list[Trajectory]
    total: int
    """Rollouts the phase had; ``trajectories`` may be a sample of them."""


@dataclass
class RunRecord:
    """What a run logged, as the report needs it."""

    title: str
    config: dict[str, Any]
    results: dict[str, Any]
    steps: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    """One row per evaluation: ``step`` and the ``eval/...`` metrics."""
    phases: list[Phase] = field(default_factory=list)
    curves_svg: str = ""


def write_run_report(run: RunRecord, path: Path) -> Path:
    """Write the report (atomically: a temp file renamed into place)."""
    shown = [t for p in run.phases for t in p.trajectories]
    body = "\n".join([
        f"<h1>{escape(run.title)}</h1>",
        f"<p class=muted>written {escape(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        "<h2 id=results>Results</h2>", kv_table(_results(run)),
        "<h2 id=curves>Curves</h2>", run.curves_svg or "<p class=muted>no steps</p>",
        "<h2 id=steps>Per-step metrics</h2>", _steps_table(run.steps),
        "<h2 id=evals>Held-out evaluations</h2>", _evals_table(run.evals),
        "<h2 id=config>Configuration</h2>", kv_table(_flatten(run.config)),
        f"<h2 id=trajectories>Trajectories</h2><p class=muted>{len(shown)} shown: "
        + "; ".join(f"{escape(p.title)} {len(p.trajectories)} of {p.total}" for p in run.phases) + ".</p>",
        _filters(run.phases, sorted({t.env_name for t in shown})),
        "<p id=showing class=muted></p><div id=trajs>",
        *(trajectory_html(i, t, 1.0, {"phase": p.key, "env": t.env_name, "status": outcome(t, 1.0)})
          for i, (p, t) in enumerate((p, t) for p in run.phases for t in p.trajectories)),
        "</div>",
    ])
    page = (f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{escape(run.title)}</title>"
            f"<style>{CSS}{_CSS}</style></head><body>\n{body}\n<script>{_SCRIPT}</script></body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def _results(run: RunRecord) -> dict[str, Any]:
    rows: dict[str, Any] = {"steps": len(run.steps)}
    if run.evals:
        first = run.evals[0]
        for key in sorted(k for k in first if k.startswith("eval/")):
            last = next(e for e in reversed(run.evals) if key in e)  # a stage's own evaluations end with it
            rows[f"held-out {key[5:]}"] = (f"{_fmt(first[key])} (step {first['step']:.0f}) → "
                                           f"{_fmt(last[key])} (step {last['step']:.0f})")
    generated = sum(s.get("rollout/model_tokens", 0.0) for s in run.steps)
    generate_s = sum(s.get("time/generate_s", 0.0) for s in run.steps)
    rows["training rollouts"] = int(sum(v for s in run.steps for k, v in s.items() if k.startswith("stop/")))
    rows["generated tokens"] = f"{generated:.0f} in {generate_s:.1f} s of generation" + (
        f" ({generated / generate_s:.1f} tokens/s)" if generate_s else "")
    rows["time per step"] = " · ".join(
        f"{name} {sum(s.get(f'time/{name}_s', 0.0) for s in run.steps) / max(len(run.steps), 1):.1f} s"
        for name in ("generate", "train", "sync", "step"))
    rows.update({k: v for k, v in run.results.items()
                 if not k.startswith(("accuracy", "reward", "greedy", "eval", "tool_call_rate"))})
    return rows


def _steps_table(steps: list[dict[str, float]]) -> str:
    if not steps:
        return "<p class=muted>no steps</p>"
    columns = [k for k in STEP_COLUMNS if any(k in s for s in steps)]
    envs = sorted({k.split("/")[1] for s in steps for k in s if k.startswith("env/") and k.endswith("/reward/mean")})
    columns += [f"env/{e}/reward/mean" for e in envs]
    head = "".join(f"<th>{escape(STEP_COLUMNS.get(c, c.removeprefix('env/').replace('/reward/mean', ' reward')))}"
                   "</th>" for c in columns)
    rows = "".join(
        f"<tr><td>{s['step']:.0f}</td>" + "".join(f"<td>{_fmt(s[c]) if c in s else ''}</td>" for c in columns)
        + "</tr>" for s in steps)
    return f"<table class=grid id=step-table><tr><th>step</th>{head}</tr>{rows}</table>"


def _evals_table(evals: list[dict[str, float]]) -> str:
    if not evals:
        return "<p class=muted>no held-out evaluation (trainer.eval_tasks=0, or no env has held-out starts)</p>"
    columns = sorted({k for e in evals for k in e if k != "step"})
    head = "".join(f"<th>{escape(c.removeprefix('eval/'))}</th>" for c in columns)
    rows = "".join(f"<tr><td>{e['step']:.0f}</td>" + "".join(f"<td>{_fmt(e[c]) if c in e else ''}</td>"
                                                             for c in columns) + "</tr>" for e in evals)
    return f"<table class=grid id=eval-table><tr><th>step</th>{head}</tr>{rows}</table>"


def _filters(phases: list[Phase], envs: list[str]) -> str:
    def select(name: str, options: list[tuple[str, str]]) -> str:
        items = "".join(f"<option value='{escape(v)}'>{escape(text)}</option>" for v, text in options)
        return f"<label>{name} <select id=filter-{name}><option value=''>all</option>{items}</select></label> "

    statuses = Counter(outcome(t, 1.0) for p in phases for t in p.trajectories)
    return "<div class=filters>" + select("phase", [(p.key, p.title) for p in phases]) + select(
        "env", [(e, e) for e in envs]) + select("status", [
            (s, f"{text} ({statuses[s]})") for s, text in
            (("passed", "passed"), ("notpassed", "not passed"), ("failed", "error/timeout"))]) + "</div>"


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as ``a.b.c: value`` rows, keys masked; lists of dicts (a mixture) stay JSON."""
    rows: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            rows.update(_flatten(value, f"{prefix}{key}."))
        elif key.endswith("api_key") and value:  # a report is for sharing: a key in it would travel with it
            rows[f"{prefix}{key}"] = "(set, not shown)"
        else:
            rows[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return rows


def _fmt(x: float) -> str:
    return f"{x:.4g}"


_CSS = """
table.grid{border-collapse:collapse;margin:.4em 0;font-size:13px}
table.grid th,table.grid td{border:1px solid #ddd;padding:2px 6px;text-align:right}
table.grid th{background:#f6f6f6}
.filters label{margin-right:1em}
svg{max-width:100%;height:auto}
"""

# Filters: each select narrows the trajectories to those whose data-* attribute matches; the URL fragment keeps
# the selection so that a view can be linked to and survives a reload.
_SCRIPT = """
const names = ["phase", "env", "status"];
function apply() {
  const want = Object.fromEntries(names.map(n => [n, document.getElementById("filter-" + n).value]));
  let shown = 0;
  const all = document.querySelectorAll("#trajs details.traj");
  for (const d of all) {
    const ok = names.every(n => !want[n] || d.dataset[n] === want[n]);
    d.hidden = !ok;
    shown += ok;
  }
  document.getElementById("showing").textContent = `showing ${shown} of ${all.length} trajectories`;
  const hash = new URLSearchParams(names.filter(n => want[n]).map(n => [n, want[n]])).toString();
  history.replaceState(null, "", hash ? "#" + hash : location.pathname);
}
const given = new URLSearchParams(location.hash.slice(1));
for (const n of names) {
  const select = document.getElementById("filter-" + n);
  if (given.has(n)) select.value = given.get(n);
  select.addEventListener("change", apply);
}
apply();
"""
