"""Evaluation results: summary statistics over trajectories and a single-file HTML report to read them.

The report is one self-contained HTML file (inline CSS and SVG, no scripts, no external resources) so it can be
attached to an issue or opened from a cluster's scratch dir. Every string in it comes from a model or an env and
is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from generators.trajectory import STOP_REASONS, Trajectory

Z_95 = 1.959964
MAX_ERRORS = 5
MAX_BINS = 10
_BADGES = {"passed": "PASS", "notpassed": "FAIL", "failed": "ERROR"}


def passed(trajectory: Trajectory, pass_threshold: float = 1.0) -> bool:
    """True if the rollout finished (no error or timeout) with reward >= ``pass_threshold``."""
    return not trajectory.failed and trajectory.reward >= pass_threshold


def pass_rates(trajectories: list[Trajectory], pass_threshold: float = 1.0) -> dict[str, dict[str, int]]:
    """Each task's rollouts passed and tried, by its group id (the task's id, or ``seed-N``)."""
    tasks: dict[str, dict[str, int]] = {}
    for t in trajectories:
        row = tasks.setdefault(t.group_id, {"passed": 0, "tried": 0})
        row["tried"] += 1
        row["passed"] += passed(t, pass_threshold)
    return tasks


def seat_results(trajectories: list[Trajectory], pass_threshold: float = 1.0) -> dict[str, float]:
    """One seat's rollouts: the share that ``passed`` (``accuracy``), the mean reward of the finished ones over all
    (``reward``), and how many ``failed``."""
    n = max(len(trajectories), 1)
    return {"accuracy": sum(passed(t, pass_threshold) for t in trajectories) / n,
            "reward": sum(t.reward for t in trajectories if not t.failed) / n,
            "failed": sum(t.failed for t in trajectories)}


@dataclass(frozen=True)
class EvalSummary:
    """Aggregate results of one evaluation run.

    Failed rollouts (error/timeout) count as not passed and score 0 in ``mean_reward``: an eval that loses rollouts
    must not look better for it. ``reward_ci95`` is the half-width of a normal-approximation 95% interval
    (1.96 standard errors, sample std); with fewer than 2 rollouts there is no spread to estimate and it is 0.
    """

    n: int
    n_passed: int
    n_failed: int
    pass_rate: float
    pass_threshold: float
    mean_reward: float
    reward_ci95: float
    stop_reasons: dict[str, int]
    model_tokens: int
    tokens_counted: bool
    """False when no trajectory carries token ids (chat-mode endpoints): ``model_tokens`` is then 0, not a count."""
    tokens_per_s: float
    mean_turns: float
    wall_s: float
    """Wall-clock seconds of the rollouts (not of starting the model server)."""
    errors: list[str]
    """The first few distinct error messages, in order of appearance."""
    tools: dict[str, float] = field(default_factory=dict)
    """What the agent did with its tools (:func:`tool_stats`); empty when no rollout called one."""
    rubric: dict[str, float] = field(default_factory=dict)
    """Each rubric part's mean score and the length bias (:func:`rubric_stats`); empty without a rubric."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)


def tool_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What the agent did with its tools over the finished rollouts (empty when none wrote a call).

    ``calls_per_episode`` and ``episodes_with_call`` (the share with at least one call) count calls that could be
    read; ``calls``, ``unparsed`` (calls written but unreadable), ``errors``, ``timeouts`` and ``unknown`` (an env that
    does not report how calls went) are totals; ``turns_per_episode`` is a mean; ``calls/NAME`` counts each tool and
    ``execs/KIND`` the calls that ran code in a sandbox of that kind (docker, local)."""
    done = [t for t in trajectories if not t.failed]
    log = [entry for t in done for entry in t.tool_log]
    if not log:
        return {}
    statuses = Counter(entry["status"] for entry in log)
    stats: dict[str, float] = {
        "calls_per_episode": sum(t.tool_calls for t in done) / len(done),
        "episodes_with_call": sum(t.tool_calls > 0 for t in done) / len(done),
        "turns_per_episode": sum(t.num_turns for t in done) / len(done),
        "calls": len(log) - statuses["unparsed"],
        **{key: statuses[status] for key, status in (("unparsed", "unparsed"), ("errors", "error"),
                                                     ("timeouts", "timeout"), ("unknown", "unknown"))},
    }
    for name, count in sorted(Counter(e["name"] for e in log if e["status"] != "unparsed").items()):
        stats[f"calls/{name}"] = count
    for kind, count in sorted(Counter(e["sandbox"] for e in log if e.get("sandbox")).items()):
        stats[f"execs/{kind}"] = count
    return stats


def rubric_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Over the finished rollouts a rubric scored: each part's mean score (by part name), and ``length_corr``, the
    correlation of reward with the model tokens sampled (a judge that likes long answers shows here; 0 where either
    does not vary). Empty when no rollout has a breakdown."""
    scored = [t for t in trajectories if not t.failed and t.scores]
    if not scored:
        return {}
    parts = sorted({name for t in scored for name in t.scores})
    stats = {name: statistics.fmean(t.scores[name] for t in scored if name in t.scores) for name in parts}
    rewards, lengths = [t.reward for t in scored], [float(t.num_model_tokens) for t in scored]
    varies = len(set(rewards)) > 1 and len(set(lengths)) > 1
    stats["length_corr"] = statistics.correlation(rewards, lengths) if varies else 0.0
    return stats


def describe_rubric(stats: dict[str, float]) -> str:
    """:func:`rubric_stats` in a line of words."""
    parts = ", ".join(f"{name} {value:.3f}" for name, value in stats.items() if name != "length_corr")
    return f"mean by part: {parts}; reward/length correlation {stats['length_corr']:+.2f}"


def first_errors(trajectories: Sequence[Trajectory], limit: int = MAX_ERRORS) -> list[str]:
    """The first ``limit`` distinct error messages of ``trajectories``, in order of appearance."""
    return list(dict.fromkeys(t.error for t in trajectories if t.error))[:limit]


def summarize(trajectories: Sequence[Trajectory], *, wall_s: float, pass_threshold: float = 1.0) -> EvalSummary:
    """Pass rate, mean reward with a 95% CI, stop reasons, throughput and error samples of ``trajectories``."""
    n = len(trajectories)
    scores = [0.0 if t.failed else t.reward for t in trajectories]
    mean = sum(scores) / n if n else 0.0
    ci = 0.0
    if n >= 2:
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
        ci = Z_95 * std / math.sqrt(n)
    n_passed = sum(passed(t, pass_threshold) for t in trajectories)
    reasons = Counter(t.stop_reason for t in trajectories)
    tokens_counted = any(t.prompt_ids for t in trajectories)
    tokens = sum(t.num_model_tokens for t in trajectories) if tokens_counted else 0
    errors = first_errors(trajectories)
    return EvalSummary(
        n=n,
        n_passed=n_passed,
        n_failed=sum(t.failed for t in trajectories),
        pass_rate=n_passed / n if n else 0.0,
        pass_threshold=pass_threshold,
        mean_reward=mean,
        reward_ci95=ci,
        stop_reasons={r: reasons.get(r, 0) for r in STOP_REASONS},
        model_tokens=tokens,
        tokens_counted=tokens_counted,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        mean_turns=sum(t.num_turns for t in trajectories) / n if n else 0.0,
        wall_s=wall_s,
        errors=errors,
        tools=tool_stats(trajectories),
        rubric=rubric_stats(trajectories),
    )


def write_html_report(trajectories: Sequence[Trajectory], summary: EvalSummary, path: str | Path, *, title: str,
                      config: dict[str, Any]) -> Path:
    """Write the self-contained HTML report (atomically: a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = Counter(outcome(t, summary.pass_threshold) for t in trajectories)
    body = "\n".join([
        f"<h1>{escape(title)}</h1>",
        f"<p class=muted>written {escape(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        "<h2>Configuration</h2>", kv_table(config),
        "<h2>Summary</h2>", _summary_table(summary),
        "<h2>Reward histogram</h2>", histogram_svg(trajectories),
        "<h2>Trajectories</h2>", _filters(counts),
        "<div id=trajs>", *(trajectory_html(i, t, summary.pass_threshold) for i, t in enumerate(trajectories)),
        "</div>",
    ])
    page = f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{escape(title)}</title>" \
           f"<style>{CSS}</style></head><body>\n{body}\n</body></html>\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def escape(value: object) -> str:
    """``value`` as text safe inside HTML (quotes included)."""
    return html.escape(str(value), quote=True)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def outcome(t: Trajectory, pass_threshold: float) -> str:
    """``passed``, ``notpassed`` or ``failed`` (error or timeout): the report's filter classes."""
    if t.failed:
        return "failed"
    return "passed" if passed(t, pass_threshold) else "notpassed"


def kv_table(rows: dict[str, Any]) -> str:
    """A two-column table of names and values (JSON for non-strings), escaped."""
    cells = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
        for k, v in rows.items()
    )
    return f"<table class=kv>{cells}</table>"


def _summary_table(s: EvalSummary) -> str:
    tokens = f"{s.model_tokens} ({s.tokens_per_s:.1f} tokens/s)" if s.tokens_counted else \
        "not counted (chat-mode endpoint: no token ids)"
    rows: dict[str, Any] = {
        "rollouts": f"{s.n} ({s.n_failed} failed: error or timeout)",
        "pass rate": f"{s.pass_rate:.1%} ({s.n_passed}/{s.n}, reward >= {_fmt(s.pass_threshold)})",
        "mean reward": f"{s.mean_reward:.4f} ± {s.reward_ci95:.4f} (95% CI, failed rollouts score 0)",
        "stop reasons": ", ".join(f"{r}: {c}" for r, c in s.stop_reasons.items()),
        "mean turns": f"{s.mean_turns:.2f}",
        "model tokens": tokens,
        "wall time": f"{s.wall_s:.1f} s",
    }
    if s.tools:
        rows["tool use"] = describe_tools(s.tools)
    if s.rubric:
        rows["rubric"] = describe_rubric(s.rubric)
    if s.errors:
        rows["errors (first distinct)"] = "\n".join(s.errors)
    return kv_table(rows)


def describe_tools(stats: dict[str, float]) -> str:
    """:func:`tool_stats` in a line or three of words."""
    lines = [f"{stats['calls_per_episode']:.2f} calls per episode, {stats['episodes_with_call']:.1%} of episodes "
             f"call a tool, {stats['turns_per_episode']:.2f} turns per episode",
             f"{stats['calls']:.0f} calls: {stats['errors']:.0f} failed, {stats['timeouts']:.0f} timed out, "
             f"{stats['unparsed']:.0f} more unreadable"]
    per_tool = {k.removeprefix("calls/"): v for k, v in stats.items() if k.startswith("calls/")}
    execs = {k.removeprefix("execs/"): v for k, v in stats.items() if k.startswith("execs/")}
    where = "; ran in sandboxes: " + ", ".join(f"{kind} {n:.0f}" for kind, n in execs.items()) if execs else ""
    lines.append("by tool: " + ", ".join(f"{name} {n:.0f}" for name, n in per_tool.items()) + where)
    return "\n".join(lines)


def _bins(rewards: list[float]) -> list[tuple[str, int]]:
    """One bin per distinct value when there are few (0/1 rewards read better so), else equal-width bins."""
    distinct = sorted(set(rewards))
    if len(distinct) <= MAX_BINS:
        counts = Counter(rewards)
        return [(_fmt(v), counts[v]) for v in distinct]
    lo, hi = distinct[0], distinct[-1]
    width = (hi - lo) / MAX_BINS
    binned = [0] * MAX_BINS
    for r in rewards:
        binned[min(int((r - lo) / width), MAX_BINS - 1)] += 1
    return [(f"{_fmt(lo + i * width)}–{_fmt(lo + (i + 1) * width)}", c) for i, c in enumerate(binned)]


def histogram_svg(trajectories: Sequence[Trajectory]) -> str:
    """An inline SVG histogram of the finished rollouts' rewards, with a note counting them."""
    rewards = [t.reward for t in trajectories if not t.failed]
    n_failed = len(trajectories) - len(rewards)
    note = f"<p class=muted>{len(rewards)} finished rollouts" + \
        (f"; {n_failed} failed (error/timeout) are not shown.</p>" if n_failed else ".</p>")
    if not rewards:
        return note
    bins = _bins(rewards)
    bar_w, gap, plot_h, top, bottom = 56, 8, 160, 20, 40
    width, height = len(bins) * (bar_w + gap) + gap, top + plot_h + bottom
    peak = max(c for _, c in bins)
    parts = [f'<svg class=hist width="{width}" height="{height}" viewBox="0 0 {width} {height}" role=img '
             f'aria-label="reward histogram">',
             f'<line x1="0" y1="{top + plot_h}" x2="{width}" y2="{top + plot_h}" class=axis />']
    for i, (label, count) in enumerate(bins):
        x = gap + i * (bar_w + gap)
        h = round(plot_h * count / peak)
        y = top + plot_h - h
        cx = x + bar_w / 2
        parts.append(f'<rect x="{x}" y="{y}" width="{bar_w}" height="{h}" class=bar><title>reward {escape(label)}: '
                     f'{count}</title></rect>')
        parts.append(f'<text x="{cx}" y="{y - 4}" class=count>{count}</text>')
        parts.append(f'<text x="{cx}" y="{top + plot_h + 16}" class=label>{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts) + note


def _filters(counts: Counter[str]) -> str:
    """Radio buttons that filter trajectories by status with CSS alone (``:checked ~`` sibling selectors)."""
    options = [("all", f"all ({sum(counts.values())})"), ("passed", f"passed ({counts['passed']})"),
               ("notpassed", f"not passed ({counts['notpassed']})"),
               ("failed", f"error/timeout ({counts['failed']})")]
    return "".join(
        f'<input type=radio name=filter id=f-{key}{" checked" if key == "all" else ""}>'
        f"<label for=f-{key} class=filter>{escape(text)}</label>"
        for key, text in options
    )


def trajectory_html(index: int, t: Trajectory, pass_threshold: float, attrs: dict[str, str] | None = None) -> str:
    """One rollout as a collapsible ``<details>``: header, metadata and every message; ``attrs`` become its
    ``data-*`` attributes (what a page's filters select on)."""
    status = outcome(t, pass_threshold)
    task = t.task_id if t.task_id is not None else "-"
    head = (f'<span class="badge {status}">{_BADGES[status]}</span> #{index} task <b>{escape(task)}</b> '
            f"· group {escape(t.group_id)} sample {t.sample_index} · reward {_fmt(t.reward)} · "
            f"{escape(t.stop_reason)} · {t.num_turns} turn{'s' if t.num_turns != 1 else ''}")
    meta: dict[str, Any] = {
        "seed": t.seed, "stop reason": t.stop_reason, "truncated": t.truncated,
        "step rewards": [round(r, 6) for r in t.step_rewards], "model tokens": t.num_model_tokens,
        "template mismatches": t.template_mismatches, "policy version": t.policy_version,
        "timings (s)": {k: round(v, 3) for k, v in t.timings.items()},
    }
    if t.scores:
        meta["rubric"] = {name: round(value, 6) for name, value in t.scores.items()}
    if t.tool_log:
        meta["tool calls"] = "\n".join(_call_note(e, with_turn=True) for e in t.tool_log)
    if t.error:
        meta = {"error": t.error, **meta}
    answered = iter([e for e in t.tool_log if e["status"] != "unparsed"])  # one tool message per call, in order
    messages = "".join(_message(m, _call_note(next(answered, {})) if m.get("role") == "tool" else "")
                       for m in t.messages) or "<p class=muted>no messages</p>"
    data = "".join(f' data-{escape(k)}="{escape(v)}"' for k, v in (attrs or {}).items())
    return f'<details class="traj {status}"{data}><summary>{head}</summary>{kv_table(meta)}{messages}</details>'


def _call_note(entry: dict[str, Any], *, with_turn: bool = False) -> str:
    """One :attr:`Trajectory.tool_log` entry in words: ``python ok in docker (0.021 s)``."""
    if not entry:
        return ""
    where = f" in {entry['sandbox']}" if entry.get("sandbox") else ""
    took = f" ({entry['exec_s']:g} s)" if isinstance(entry.get("exec_s"), int | float) else ""
    turn = f"turn {entry.get('turn')}: " if with_turn else ""
    return f"{turn}{entry.get('name') or 'unreadable call'} {entry.get('status')}{where}{took}"


def _message(m: dict[str, Any], note: str = "") -> str:
    role = str(m.get("role", "?"))
    who = role + (f" · {m['name']}" if m.get("name") else "") + \
        (f" · answers {m['tool_call_id']}" if m.get("tool_call_id") else "") + (f" · {note}" if note else "")
    content = m.get("content")
    parts = [f'<div class="msg role-{escape(role)}"><div class=role>{escape(who)}</div>']
    if m.get("reasoning_content"):
        parts.append(f"<details class=reasoning><summary>reasoning</summary><pre>{escape(m['reasoning_content'])}"
                     "</pre></details>")
    if content:
        parts.append(f"<pre>{escape(content)}</pre>")
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {})
        parts.append(f'<div class=call>tool call <b>{escape(fn.get("name", "?"))}</b> <span class=muted>'
                     f'{escape(call.get("id", ""))}</span><pre>{escape(_pretty_args(fn.get("arguments")))}</pre></div>')
    for error in m.get("tool_call_errors") or []:
        parts.append(f"<div class=call>malformed tool call <pre>{escape(error)}</pre></div>")
    if not content and not m.get("tool_calls"):
        parts.append("<pre class=muted>(empty)</pre>")
    parts.append("</div>")
    return "".join(parts)


def _pretty_args(arguments: Any) -> str:
    """Tool-call arguments as indented JSON; a model's malformed JSON is shown as written."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, indent=2, ensure_ascii=False)


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.muted{color:#777}
table.kv{border-collapse:collapse;margin:.4em 0}
table.kv th,table.kv td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top;white-space:pre-wrap}
table.kv th{background:#f6f6f6;font-weight:600}
svg.hist .bar{fill:#4a7bd0}svg.hist .axis{stroke:#999}
svg.hist text{font-size:12px;text-anchor:middle;fill:#333}
input[name=filter]{display:none}
label.filter{display:inline-block;padding:3px 10px;margin:0 4px 8px 0;border:1px solid #bbb;border-radius:12px;
cursor:pointer}
input[name=filter]:checked+label.filter{background:#333;color:#fff}
#f-passed:checked~#trajs .traj:not(.passed),#f-notpassed:checked~#trajs .traj:not(.notpassed),
#f-failed:checked~#trajs .traj:not(.failed){display:none}
details.traj{border:1px solid #ddd;border-left:6px solid #999;border-radius:4px;margin:6px 0;padding:4px 8px}
details.traj.passed{border-left-color:#2e9e44}details.traj.notpassed{border-left-color:#d08a1c}
details.traj.failed{border-left-color:#d0342c;background:#fff6f5}
summary{cursor:pointer}
.badge{display:inline-block;min-width:4em;text-align:center;font-weight:700;font-size:12px;border-radius:3px;
color:#fff;padding:1px 4px}
.badge.passed{background:#2e9e44}.badge.notpassed{background:#d08a1c}.badge.failed{background:#d0342c}
.msg{margin:8px 0;padding:6px 10px;border-radius:6px;border:1px solid #e3e3e3}
.msg .role{font-size:12px;font-weight:700;text-transform:uppercase;letter-spacing:.04em;color:#555}
.role-system{background:#f3f3f3}.role-user{background:#eef4ff}.role-assistant{background:#effaf0}
.role-tool{background:#fff7e8}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:13px/1.4 ui-monospace,monospace}
.call{border-left:3px solid #8a6bd1;padding-left:8px;margin:4px 0}
.reasoning summary{color:#777}
"""
