"""Do two checkouts train the same? Run the same seeded tiny training runs from each (a refactor's before and after)
and compare every number they log, step for step.

    git worktree add /tmp/before REV
    .venv/bin/python tests/same_runs.py /tmp/before            # every run below
    .venv/bin/python tests/same_runs.py /tmp/before rl seats   # some of them

Each run is ``python -m trainer`` started in the checkout's own directory (its packages first on the path; this
venv's installs otherwise) on the tiny model: the in-process HF engine with seeded requests, fp32 on both sides and
one thread, so a run reproduces bit for bit and any difference is the code's. Times and throughputs are left out.
Async mode is not here: its batches depend on which rollouts finish first, so two runs of one checkout differ too.
Exits 1 if any number differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tiny import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
UNTIMED = ("time/", "tokens_per_s", "_s")
"""Keys whose values are wall-clock times or rates: they differ run to run."""


def runs(tiny: Path, chat: Path) -> dict[str, list[str]]:
    """Each run's overrides, by name: RL (GRPO and PPO), distillation, SFT and a run with seats."""
    common = ["inference.engine=hf", f"model.path={tiny}", "generator.seed=7", "trainer.dtype=fp32",
              "inference.dtype=float32", "logging.progress=false", "logging.tensorboard=false",
              "trainer.warmup_steps=0", "trainer.lr=1e-3", "generator.prompts_per_step=2",
              "generator.samples_per_prompt=4", "generator.max_tokens=16", "trainer.micro_batch_tokens=2048"]
    graded = [*common, "+env.kwargs.rubric=tiny:graded"]
    return {
        "rl": [*graded, "trainer.steps=3", "trainer.eval_tasks=4"],
        "rl_ppo": [*graded, "trainer.steps=3", "trainer.eval_tasks=0", "algorithm=ppo"],
        "distill": [*graded, "stages=[distill]", f"distill.teacher={tiny}", "distill.reward_weight=0.5",
                    "trainer.steps=2", "trainer.eval_tasks=0"],
        "sft": [*common, "stages=[sft]", "sft.data=chat", f"sft.paths=[{chat}]", "sft.batch_size=4", "sft.epochs=1",
                "trainer.eval_tasks=0"],
        "seats": [*common, "algorithm=ppo", "env.name=seat_envs:GradedPair",
                  "++seats={first: {policy: a}, second: {policy: b}}", "trainer.steps=2", "trainer.eval_tasks=2",
                  "trainer.eval_samples=1", "generator.max_turns=2", "generator.max_tokens=8"],
    }


def logged(checkout: Path, overrides: list[str], out: Path) -> list[dict]:
    """The metrics rows of ``python -m trainer`` run from ``checkout``."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "trainer", *overrides, f"trainer.output_dir={out}"], cwd=checkout,
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run from {checkout} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def differences(before: list[dict], after: list[dict]) -> tuple[int, list[tuple], list[str]]:
    """How many numbers were compared, those that differ (step, key, before, after), and the keys one side lacks."""
    if len(before) != len(after):
        return 0, [("rows", len(before), len(after))], []
    compared, differ = 0, []
    for a, b in zip(before, after, strict=True):
        for key in sorted(a.keys() & b.keys()):
            if any(part in key for part in UNTIMED) or not isinstance(a[key], int | float):
                continue
            compared += 1
            if a[key] != b[key]:
                differ.append((a.get("step"), key, a[key], b[key]))
    one_side = sorted({k for r in before for k in r} ^ {k for r in after for k in r})
    return compared, differ, one_side


def main() -> int:
    """Compare the runs named on the command line (default: all); 1 if any number differs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the other checkout (a git worktree of the revision before)")
    parser.add_argument("runs", nargs="*", help="which runs (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        chat = Path(tmp) / "chat.jsonl"
        chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                                         {"role": "assistant", "content": str(a + b)}]}) + "\n"
                                for a, b in zip(range(11, 23), range(40, 52), strict=True)))
        table = runs(tiny_model_dir(), chat)
        failed = False
        for name in args.runs or list(table):
            before = logged(args.before.resolve(), table[name], Path(tmp) / f"{name}-before")
            after = logged(ROOT, table[name], Path(tmp) / f"{name}-after")
            compared, differ, one_side = differences(before, after)
            failed |= bool(differ)
            print(f"{name}: {compared} numbers compared, {len(differ)} differ; keys one side lacks: {one_side}")
            for row in differ[:10]:
                print("   ", row)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
