"""Learning from live traffic, end to end (docs/serving.md): ``python -m trainer +recipe=online`` serves the bundled
model on arithmetic questions while simulated users (generators/serving/users.py, each in a process of its own) ask
at a steady rate and send feedback by a preference the model is never told; the run trains rounds on that feedback
and promotes what its gate passes. When ``--duration`` is up the users stop and the run is sent SIGTERM (it drains).

Prints, and writes to OUT/report.json: every call counted by outcome (any but 200 is a failure: 4xx, 429, 5xx,
timeout), p50/p99 latency in the minute before, during and the minute after each swap, the users' mean score per
weight version (with its standard error), and each gate decision with its numbers.

    python examples/online/demo.py [--users 4] [--rate 0.25] [--duration 720] [--invert] [--out runs/online-demo]
    python examples/online/demo.py --invert     # users who reward wrong answers: the gate must refuse what they teach
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from generators.serving.users import User, mean_and_error, percentiles, run_users, summarize


def swap_latencies(events: list[dict[str, Any]], decisions: list[dict[str, Any]], window_s: float = 60.0
                   ) -> list[dict[str, Any]]:
    """p50/p99 latency of the calls answered in the ``window_s`` before each swap, those in flight during it, and
    those in the ``window_s`` after."""
    answered = [e for e in events if e["status"] == 200]
    out = []
    for d in decisions:
        if "swap" not in d:
            continue
        start, end = d["swap"]
        spans = {"before": (start - window_s, start), "during": (start, end), "after": (end, end + window_s)}
        row: dict[str, Any] = {"round": d["round"], "version": d["candidate"], "swap_s": round(end - start, 2)}
        for name, (lo, hi) in spans.items():
            hit = sorted(e["latency_s"] for e in answered
                         if e["t_abs"] < hi and e["t_abs"] + e["latency_s"] > lo)
            row[name] = percentiles(hit)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.25, help="calls per second per user (default: 0.25)")
    p.add_argument("--duration", type=float, default=720.0, metavar="SECONDS", help="of traffic (default: 720)")
    p.add_argument("--preference", default="correct")
    p.add_argument("--invert", action="store_true", help="users score 1 - their preference")
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--out", type=Path, default=Path("runs/online-demo"))
    p.add_argument("overrides", nargs="*", help="more python -m trainer overrides")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    clients = [{"name": f"user{i}", "key": secrets.token_urlsafe(16)} for i in range(args.users)]
    (args.out / "clients.json").write_text(json.dumps(clients))
    os.chmod(args.out / "clients.json", 0o600)
    run_dir = args.out / "run"
    command = [sys.executable, "-m", "trainer", "+recipe=online", f"online.clients={args.out / 'clients.json'}",
               f"online.port={args.port}", f"trainer.output_dir={run_dir}", "logging.progress=false",
               *args.overrides]
    log = open(args.out / "trainer.log", "w")  # noqa: SIM115 - the run's output, kept open while it runs
    trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    print(f"started {' '.join(command)} (log: {args.out / 'trainer.log'})", flush=True)
    url = f"http://127.0.0.1:{args.port}"
    while not re.search(r"serving weight version \d+ at", (args.out / "trainer.log").read_text()):
        if trainer.poll() is not None:
            print((args.out / "trainer.log").read_text()[-3000:])
            return 1
        time.sleep(1)
    print(f"serving at {url}: {args.users} users x {args.rate} calls/s for {args.duration:.0f} s", flush=True)
    users = [User(c["name"], c["key"], args.preference, rate=args.rate, invert=args.invert, seed=i)
             for i, c in enumerate(clients)]
    events: list[dict[str, Any]] = []
    stop = multiprocessing.get_context("spawn").Event()
    traffic = threading.Thread(target=lambda: events.extend(run_users(users, url, args.duration, args.out / "users",
                                                                      stop=stop)))
    traffic.start()
    traffic.join()
    trainer.send_signal(signal.SIGTERM)
    trainer.wait(timeout=300)
    gate = run_dir / "gate.jsonl"
    decisions = [json.loads(line) for line in gate.read_text().splitlines()] if gate.is_file() else []
    t0 = min((e["t_abs"] for e in events), default=0.0)
    minutes: dict[int, list[float]] = {}
    for e in events:
        if "score" in e:
            minutes.setdefault(int((e["t_abs"] - t0) // 60), []).append(e["score"])
    report = {"users": args.users, "rate_per_user": args.rate, "duration_s": args.duration,
              "preference": args.preference, "inverted": args.invert, **summarize(events),
              "score_by_minute": {m: mean_and_error(s) for m, s in sorted(minutes.items())},
              "swaps": swap_latencies(events, decisions),
              "decisions": [{k: v for k, v in d.items() if k not in ("time", "test")} for d in decisions]}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
