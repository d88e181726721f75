"""Uniform sampling, the band curriculum and on-policy distillation on arithmetic, at equal wall time.

    python examples/curriculum/compare.py --out runs/cmp                      # every arm, seeds 0 and 1
    python examples/curriculum/compare.py --out runs/cmp --arms uniform band  # the curriculum alone
    python examples/curriculum/compare.py --out runs/mix --arms uniform band --level 2 3 4  # on a mixture
    python examples/curriculum/compare.py --out runs/mix-08 --arms band --band 0.1 0.8   # another band
    python examples/curriculum/compare.py --out runs/m13 --arms uniform bandit --level 1 2 3  # the bandit
    python examples/curriculum/compare.py --out runs/cmp --report             # the table and plot of what ran

Arms (each ``python -m trainer`` on the same env, model and settings; runs that finished are not run again):

    uniform   RL from scratch, tasks in shuffled order (the default)
    band      RL from scratch, curriculum.sampler=band from a train-split profile (``envkit eval --pass-rates``,
              made once in OUT/train-rates.json; its cost is printed, as it is paid once per task set), each
              task's rate over its latest group (curriculum.window=8: a solved task is set aside after one flat
              group, not two); on a mixture, grouped by level (``--group-by``: curriculum.group_by); ``--band LOW HIGH``
              sets curriculum.band (default: the sampler's, 0.1 0.9)
    bandit    as band, with curriculum.sampler=bandit: each draw goes to the cell of tasks (per level: drawn in the
              last few steps and still in the band, the rest of the band, the solved, the hopeless) whose groups
              varied most lately
    distill   stages=[distill] from the fresh model, the teacher ``--teacher`` (default: uniform seed 0's final
              weights, so run that arm first); ``--distill-samples`` per prompt (default 4: distillation needs no
              groups to compare, and each token carries its own signal)

Each run evaluates the first ``--eval-tasks`` test tasks every ``--eval-every`` steps, ``--eval-samples`` each at
temperature 1; the evaluation's wall time is taken from the run's start, so engine start-up (and the teacher's
load) counts. "Hard" test tasks are those whose starting pass rate, pooled over every run's step-0 evaluation,
is 5-30%. The report prints flat groups per step and held-out accuracy (all tasks, hard ones) against wall time
per run, the wall time at which each run first reached 90% of the teacher's final held-out accuracy (interpolated
between evaluations), and writes OUT/compare.json, OUT/compare-curriculum.png and OUT/compare-distill.png.

The RL arms write every step's rollouts (``logging.rollouts=true``). From them the report counts, after step
``--after``, how often each kind of draw was flat: a task drawn for the first time (per group of ``--group-by``), or
drawn again after k of its last group's samples passed. It also bounds what any sampler choosing among those kinds
could do: keep the redraws that were flat less often than the best group's new tasks, as many as there were, and
draw every other group from that best group.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("uniform", "band", "bandit", "distill")
RL_ARMS = ("uniform", "band", "bandit")
HARD = (0.05, 0.30)
COLORS = {"uniform": "tab:gray", "band": "tab:blue", "bandit": "tab:orange", "distill": "tab:green"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=60, help="RL steps per run (default: 60)")
    parser.add_argument("--distill-steps", type=int, default=30, help="distillation steps per run (default: 30)")
    parser.add_argument("--distill-samples", type=int, default=4, help="distill's samples per prompt (default: 4)")
    parser.add_argument("--teacher", help="distill's teacher (default: OUT/uniform-0, its final weights)")
    parser.add_argument("--level", nargs="+", type=int, default=[3],
                        help="arithmetic's level, or several: a mixture taking tasks from each in turn (default: 3)")
    parser.add_argument("--train-tasks", type=int, default=1000, help="the train pool (default: 1000)")
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (default: 10)")
    parser.add_argument("--band", nargs=2, type=float, metavar=("LOW", "HIGH"),
                        help="the band arm's curriculum.band (default: the sampler's, 0.1 0.9)")
    parser.add_argument("--group-by", nargs="+", metavar="FIELD",
                        help="band's and bandit's curriculum.group_by: task fields naming a group (default: level, on "
                             "a mixture; arithmetic's tasks also name their operators: --group-by level ops)")
    parser.add_argument("--after", type=int, default=20,
                        help="the report's draws are counted after this step (default: 20)")
    parser.add_argument("--report", action="store_true", help="only report the runs in OUT")
    args = parser.parse_args()
    if args.group_by is None:
        args.group_by = ["level"] if len(args.level) > 1 else []
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for seed in args.seeds:
            for arm in args.arms:
                run_arm(args, arm, seed)
    report(args.out, Path(args.teacher) if args.teacher else args.out / "uniform-0")
    draws(args)


def run_arm(args: argparse.Namespace, arm: str, seed: int) -> None:
    """One ``python -m trainer`` run, its start and end times beside it; skipped if it finished before."""
    out = args.out / f"{arm}-{seed}"
    if (out / "summary.json").is_file():
        return
    extra: list[str] = []
    steps = args.steps
    if arm in ("band", "bandit"):
        extra = [f"curriculum.sampler={arm}", f"curriculum.pass_rates=[{profile(args)}]", "curriculum.window=8",
                 *([f"curriculum.group_by=[{','.join(args.group_by)}]"] if args.group_by else []),
                 *([f"curriculum.band=[{args.band[0]},{args.band[1]}]"] if args.band else [])]
    elif arm == "distill":
        extra = ["stages=[distill]", f"distill.teacher={args.teacher or args.out / 'uniform-0'}",
                 f"generator.samples_per_prompt={args.distill_samples}"]
        steps = args.distill_steps
    env = [f"+env.kwargs.level={_level(args)}", f"+env.kwargs.num_train={args.train_tasks}"]
    command = [sys.executable, "-m", "trainer", *env, f"trainer.seed={seed}", f"trainer.steps={steps}",
               f"trainer.eval_every={args.eval_every}", f"trainer.eval_tasks={args.eval_tasks}",
               f"trainer.eval_samples={args.eval_samples}", "trainer.eval_greedy=false", "trainer.save_every=1000",
               f"trainer.output_dir={out}", "logging.progress=false",
               *(["logging.rollouts=true"] if arm in RL_ARMS else []), *extra]
    print(f"{arm} seed {seed}: {' '.join(command[1:])}", flush=True)
    (args.out / f"{arm}-{seed}.start").write_text(str(time.time()))
    with (args.out / f"{arm}-{seed}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    (args.out / f"{arm}-{seed}.end").write_text(str(time.time()))


def _level(args: argparse.Namespace) -> str:
    """``--level`` as the env's kwarg: one level, or a JSON list of them."""
    return str(args.level[0]) if len(args.level) == 1 else json.dumps(args.level).replace(" ", "")


def profile(args: argparse.Namespace) -> Path:
    """The train split's pass rates at the start (4 samples per task at temperature 1), made once."""
    out, tasks = args.out, args.train_tasks
    rates = out / "train-rates.json"
    if not rates.is_file():
        start = time.time()
        subprocess.run([sys.executable, "-m", "envkit", "eval", "arithmetic", "--env-arg", f"level={_level(args)}",
                        "--env-arg", f"num_train={tasks}", "--split", "train", "-n", str(tasks), "--samples", "4",
                        "--temperature", "1", "--pass-rates", str(rates), "--out", str(out / "profile")], check=True)
        print(f"train-split profile: {time.time() - start:.0f} s (paid once per task set)")
    return rates


def report(out: Path, teacher: Path) -> None:
    """Flat groups per step and held-out accuracy against wall time for every run in ``out``, and when each first
    reached 90% of the ``teacher`` run's final accuracy; the plot."""
    runs = sorted(p for p in out.iterdir() if p.is_dir() and (p / "evals").is_dir() and p.name.split("-")[0] in ARMS)
    start: dict[str, list[bool]] = {}
    for run in runs:
        for t in _rollouts(run / "evals" / "step-000000.jsonl"):
            start.setdefault(t["task_id"], []).append(t["reward"] >= 1.0)
    rates = {task: sum(v) / len(v) for task, v in start.items()}
    hard = {task for task, rate in rates.items() if HARD[0] <= rate <= HARD[1]}
    print(f"{len(rates)} test tasks, starting pass rate {statistics.mean(rates.values()):.3f} "
          f"({len(next(iter(start.values())))} samples each, pooled); hard (5-30%): {len(hard)}")
    finals = sorted((teacher / "evals").glob("step-*.jsonl"))
    target = 0.9 * _passed(_rollouts(finals[-1])) if finals else None
    if target is not None:
        print(f"teacher {teacher}: final held-out accuracy {target / 0.9:.3f}; 90% of it: {target:.3f}")
    summary = {"hard_tasks": sorted(hard), "target": target, "runs": {}}
    for run in runs:
        t0 = float((out / f"{run.name}.start").read_text())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = list({r["step"]: r for r in rows if "reward/mean" in r}.values())
        flat = [r.get("rollout/zero_variance_groups", 0) for r in steps]
        evals = []
        for file in sorted((run / "evals").glob("step-*.jsonl")):
            trajs = _rollouts(file)
            evals.append({"step": int(file.stem[5:]), "wall_s": round(file.stat().st_mtime - t0),
                          "accuracy": _passed(trajs), "hard_accuracy": _passed([t for t in trajs
                                                                                 if t["task_id"] in hard])})
        reached = _reached(evals, target) if target is not None else None
        # the flat groups whose every rollout passed, the rest failed every time (runs before the metric: none)
        solved = [r["rollout/zero_variance_groups_passed"] for r in steps if "rollout/zero_variance_groups_passed" in r]
        split = f" ({statistics.mean(solved):.2f} all passed)" if solved and len(solved) == len(steps) else ""
        summary["runs"][run.name] = {"flat_groups_per_step": flat, "flat_passed_per_step": solved, "evals": evals,
                                     "reached_target_s": reached}
        print(f"{run.name}: {len(steps)} steps, flat groups per step {statistics.mean(flat):.2f}{split}, "
              f"90% of the teacher at {'never' if reached is None else f'{reached:.0f} s'}")
        for e in evals:
            print(f"  step {e['step']:3d}  {e['wall_s']:5d} s  all {e['accuracy']:.3f}  hard {e['hard_accuracy']:.3f}")
    equal_time(summary["runs"])
    (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, len(hard), out)


def equal_time(runs: dict[str, dict]) -> None:
    """Uniform against the curricula at equal wall time: each run's hard-task accuracy interpolated at the time of the
    earliest final evaluation among them, and its flat groups per step."""
    rl = {name: run for name, run in runs.items() if name.split("-")[0] in RL_ARMS and run["evals"]}
    if not rl:
        return
    t = min(run["evals"][-1]["wall_s"] for run in rl.values())
    print(f"at equal wall time ({t / 60:.1f} min, the earliest final evaluation):")
    for arm in RL_ARMS:
        runs_of_arm = {n: r for n, r in rl.items() if n.startswith(f"{arm}-")}
        if runs_of_arm:
            hard = [_at(r["evals"], t, "hard_accuracy") for r in runs_of_arm.values()]
            flat = [statistics.mean(r["flat_groups_per_step"]) for r in runs_of_arm.values()]
            print(f"  {arm:8s} hard-task accuracy {' / '.join(f'{h:.3f}' for h in hard)}, "
                  f"flat groups per step {' / '.join(f'{f:.2f}' for f in flat)}")


def _at(evals: list[dict], t: float, key: str) -> float:
    """``key`` at wall time ``t``, linear between the evaluations around it."""
    for before, after in itertools.pairwise(evals):
        if before["wall_s"] <= t <= after["wall_s"]:
            share = (t - before["wall_s"]) / max(1, after["wall_s"] - before["wall_s"])
            return before[key] + share * (after[key] - before[key])
    return evals[-1][key]


def draws(args: argparse.Namespace) -> None:
    """Per run with rollouts: after step ``--after``, the share of flat groups per kind of draw, and the bound on a
    sampler that drew in hindsight from the kinds flat least often (the module's docstring)."""
    import envkit

    env = envkit.make("arithmetic", level=json.loads(_level(args)), num_train=args.train_tasks)
    group_of = {str(t["id"]): ",".join(str(t[f]) for f in args.group_by) or "all" for t in env.tasks("train")}
    runs = {rollouts.parent.name: _groups(rollouts) for rollouts in sorted(args.out.glob("*-*/rollouts"))}
    uniform = [statistics.mean(_flat_per_step(steps)) for name, steps in runs.items() if name.startswith("uniform-")]
    for name, steps in runs.items():
        kinds: dict[str, list[bool]] = {}
        last: dict[str, int] = {}
        for step, groups in enumerate(steps, start=1):
            for task, passed, n, flat in groups:
                if step > args.after:
                    kind = f"new {group_of[task]}" if task not in last else f"again after {last[task]}/{n}"
                    kinds.setdefault(kind, []).append(flat)
                last[task] = passed
        late = len(steps) - args.after
        if late <= 0:
            continue
        print(f"{name}: draws after step {args.after}, flat share (groups)")
        for kind, flat in sorted(kinds.items()):
            print(f"  {kind:24s} {sum(flat) / len(flat):.2f} ({len(flat)})")
        new = {k: sum(f) / len(f) for k, f in kinds.items() if k.startswith("new ") and len(f) >= MIN_CELL}
        if not new:
            continue
        best = min(new, key=new.__getitem__)
        kept = [f for k, f in kinds.items() if k.startswith("again") and sum(f) / len(f) < new[best]]
        groups_per_step = sum(len(f) for f in kinds.values()) / late
        kept_per_step = sum(len(f) for f in kept) / late
        bound = sum(sum(f) for f in kept) / late + (groups_per_step - kept_per_step) * new[best]
        early = sum(_flat_per_step(steps[:args.after])) / len(steps)
        whole = early + bound * late / len(steps)
        ratio = f", {whole / statistics.mean(uniform):.2f}x uniform's" if uniform else ""
        print(f"  in hindsight: the best group's new tasks ({best[4:]}, {new[best]:.2f} flat) and the redraws flat "
              f"less often: {bound:.2f} flat groups a step after step {args.after}, {whole:.2f} over the run{ratio}")


MIN_CELL = 20
"""New tasks of a group drawn fewer times than this are not taken as the best group (too few to tell)."""


def _groups(rollouts: Path) -> list[list[tuple[str, int, int, bool]]]:
    """Each step's groups, from a run's ``rollouts/``: (task id, samples passed, samples, flat) per group, of the
    rollouts the trainer kept, flat as the trainer counts it (trainer.sources.flat_groups)."""
    from generators import read_jsonl
    from trainer.sources import flat_groups

    steps = []
    for file in sorted(rollouts.glob("step-*.jsonl")):
        kept = [t for t in read_jsonl(file) if not t.failed and t.response_ids]
        flat = flat_groups(kept)
        by_group: dict[str, list] = {}
        for t in kept:
            by_group.setdefault(t.group_id, []).append(t)
        steps.append([(str(g[0].task_id), sum(t.reward >= 1.0 for t in g), len(g), group in flat)
                      for group, g in by_group.items()])
    return steps


def _flat_per_step(steps: list[list[tuple[str, int, int, bool]]]) -> list[int]:
    return [sum(flat for *_, flat in groups) for groups in steps]


def plot(summary: dict, hard: int, out: Path) -> None:
    """OUT/compare-curriculum.png (uniform and the curricula: hard-task accuracy against wall time, flat groups per
    step) and OUT/compare-distill.png (uniform and distill: accuracy against wall time, and 90% of the teacher's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {"curriculum": (RL_ARMS, ("hard_accuracy", "flat")),
               "distill": (("uniform", "distill"), ("accuracy",))}
    for name, (arms, panels) in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
        for run_name, run in summary["runs"].items():
            arm, seed = run_name.split("-")
            if arm not in arms:
                continue
            style = {"color": COLORS[arm], "linestyle": "-" if seed == "0" else "--", "label": f"{arm}, seed {seed}"}
            minutes = [e["wall_s"] / 60 for e in run["evals"]]
            for ax, panel in zip(axes[0], panels, strict=True):
                if panel == "flat":
                    flat = run["flat_groups_per_step"]
                    ax.plot(range(1, len(flat) + 1), flat, **style)
                else:
                    ax.plot(minutes, [e[panel] for e in run["evals"]], marker="o", **style)
        for ax, panel in zip(axes[0], panels, strict=True):
            if panel == "flat":
                ax.set_xlabel("step")
                ax.set_ylabel("flat groups per step")
            else:
                ax.set_xlabel("wall time (min, engine start-up included)")
                ax.set_ylabel(f"held-out accuracy, {hard} hard tasks" if panel == "hard_accuracy"
                              else "held-out accuracy, all tasks")
            if panel == "accuracy" and summary["target"] is not None:
                ax.axhline(summary["target"], color="black", linewidth=0.8, linestyle=":",
                           label="90% of the teacher's")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"compare-{name}.png", dpi=90)
        plt.close(fig)
        print(f"plot: {out / f'compare-{name}.png'}")


def _reached(evals: list[dict], target: float) -> float | None:
    """The wall time at which held-out accuracy first reached ``target``, linear between evaluations."""
    for before, after in itertools.pairwise(evals):
        if after["accuracy"] >= target > before["accuracy"]:
            share = (target - before["accuracy"]) / (after["accuracy"] - before["accuracy"])
            return before["wall_s"] + share * (after["wall_s"] - before["wall_s"])
    return None


def _rollouts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _passed(trajs: list[dict]) -> float:
    return round(sum(t["reward"] >= 1.0 for t in trajs) / max(1, len(trajs)), 3)


if __name__ == "__main__":
    main()
