"""Two policies against one: what training several policies in one run costs per step, on the referential game.

Both runs are ``python -m trainer +recipe=referential`` for ``--steps`` steps with one seed, batch and setting, and
no held-out evaluation (so no engine for the starting model):

    two   speaker and listener bound to two policies: two models, two optimizers, two vLLM engines, two weight syncs
    one   both seats bound to one policy: one model, one engine (self-play's layout), the same episodes per step

Per step, over the steps after the first (its warm-up is not the steady state): wall time and its generate, train
and weight-sync parts, from each run's metrics; and the peak resident memory of the run's whole process tree (the
trainer and its engines), sampled every second. Prints two/one ratios.

With ``--lora`` it compares the two ways to serve two policies that train LoRA adapters (rank ``--rank`` on every
linear layer), in the same runs otherwise:

    adapters  one vLLM server serves the base model and both policies as adapters, each reloaded in place after every
              step from the few MB the trainer writes (``model.lora.serve=adapters``)
    merged    two servers, each serving its policy with the adapters merged into the base weights, sent from memory
              (``model.lora.serve=merged``)

    python benchmarks/two_policies.py [--steps 4] [--lora [--rank 16]] [--out runs/bench/two_policies]
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
PAIRS = {
    "full": {"two": [], "one": ["seats.listener.policy=speaker"]},
    "lora": {"adapters": ["model.lora.serve=adapters"], "merged": ["model.lora.serve=merged"]},
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


def run(layout: str, overrides: list[str], steps: int, out: Path) -> dict[str, float]:
    """One run of ``layout``: mean seconds per step (and per part) after the first, and the peak tree RSS."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "trainer", "+recipe=referential", f"trainer.steps={steps}", "trainer.eval_tasks=0",
            f"trainer.output_dir={out}", "logging.progress=false", "trainer.save_every=1000", *overrides]
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
    parser.add_argument("--lora", action="store_true", help="two LoRA policies: adapters of one server vs merged")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pair = PAIRS["lora" if args.lora else "full"]
    lora = [f"model.lora.r={args.rank}", f"model.lora.alpha={2 * args.rank}"] if args.lora else []
    results = {layout: run(layout, [*lora, *overrides], args.steps, args.out / layout)
               for layout, overrides in pair.items()}
    first, second = pair
    print(f"referential, {args.steps} steps each, steps 2..{args.steps} averaged"
          + (f", LoRA rank {args.rank}" if args.lora else ""))
    print(f"{'':<14}{first:>10}{second:>10}{f'{first}/{second}':>16}")
    for key, label in (("step_s", "step s"), ("generate_s", "generate s"), ("train_s", "train s"),
                       ("sync_s", "sync s"), ("peak_rss_gib", "peak RSS GiB")):
        a, b = results[first][key], results[second][key]
        print(f"{label:<14}{a:>10.2f}{b:>10.2f}{a / b if b else float('nan'):>16.2f}")
    (args.out / f"results{'-lora' if args.lora else ''}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
