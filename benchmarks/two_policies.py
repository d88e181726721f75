"""Two policies against one: what training several policies in one run costs per step, on the referential game.

Both runs are ``python -m trainer +recipe=referential`` for ``--steps`` steps with one seed, batch and setting, and
no held-out evaluation (so no engine for the starting model):

    two   speaker and listener bound to two policies: two models, two optimizers, two vLLM engines, two weight syncs
    one   both seats bound to one policy: one model, one engine (self-play's layout), the same episodes per step

Per step, over the steps after the first (its warm-up is not the steady state): wall time and its generate, train
and weight-sync parts, from each run's metrics; and the peak resident memory of the run's whole process tree (the
trainer and its engines), sampled every second. Prints two/one ratios.

    python benchmarks/two_policies.py [--steps 4] [--out runs/bench/two_policies]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "two": [],
    "one": ["seats.listener.policy=speaker"],
}


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def run(layout: str, steps: int, out: Path) -> dict[str, float]:
    """One run of ``layout``: mean seconds per step (and per part) after the first, and the peak tree RSS."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "trainer", "+recipe=referential", f"trainer.steps={steps}", "trainer.eval_tasks=0",
            f"trainer.output_dir={out}", "logging.progress=false", "trainer.save_every=1000", *LAYOUTS[layout]]
    peak = 0
    with (out.parent / f"{layout}.log").open("w") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_rss(process.pid))
                time.sleep(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        done.set()
        sampler.join()
    if code:
        raise SystemExit(f"the {layout} run failed ({code}): see {out.parent / f'{layout}.log'}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "time/step_s" in r and r["step"] > 1]
    result = {key: statistics.mean(r[f"time/{key}"] for r in steps_rows)
              for key in ("step_s", "generate_s", "train_s", "sync_s")}
    return {**result, "peak_rss_gib": peak / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "two_policies")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {layout: run(layout, args.steps, args.out / layout) for layout in LAYOUTS}
    print(f"referential, {args.steps} steps each, steps 2..{args.steps} averaged")
    print(f"{'':<14}{'two policies':>14}{'one policy':>12}{'two/one':>9}")
    for key, label in (("step_s", "step s"), ("generate_s", "generate s"), ("train_s", "train s"),
                       ("sync_s", "sync s"), ("peak_rss_gib", "peak RSS GiB")):
        two, one = results["two"][key], results["one"][key]
        print(f"{label:<14}{two:>14.2f}{one:>12.2f}{two / one if one else float('nan'):>9.2f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
