"""``envkit eval`` of a multi-agent env: the cross-play matrix, every given policy in every seat against every other.

    envkit eval referential --policy speaker=runs/referential/policies/speaker/weights/v12 \\
        --policy listener=runs/referential/policies/listener/weights/v12 --policy initial=bundled -n 50

Each policy is served by an engine of its own; every assignment of policies to seats plays the same tasks. The
results per assignment and seat (pass rate, mean reward), and per policy and seat over every opponent it met, are
printed, and written with the trajectories (``trajectories.jsonl``, each with its seat) to the output dir.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from generators.engines.factory import make_engine
from generators.eval import EvalConfig, EvalInputError, _load_model, _load_tasks, _write_json
from generators.report import passed
from generators.rollout import Generator
from generators.seats import local_seats, play_starts
from generators.trajectory import Trajectory, write_jsonl


async def run_seat_eval(config: EvalConfig, policies: dict[str, str], *, console: Console | None = None
                        ) -> tuple[list[dict[str, Any]], Path]:
    """Every assignment of ``policies`` (name -> model) to the env's seats on the config's tasks; returns one row per
    assignment (``players``, and per seat ``accuracy`` and ``reward``) and the output dir."""
    from envkit.multi_agent import MultiAgentEnv

    say = console.print if console is not None else (lambda *a, **k: None)
    probe = config.env.make()
    await probe.close()
    if not isinstance(probe, MultiAgentEnv):
        raise EvalInputError(f"--policy is for multi-agent envs; {config.env.name!r} has no seats")
    seats = list(probe.seats)
    tasks, note = await _load_tasks(config)
    starts = [(t, None) for t in tasks] if tasks is not None else [(None, s) for s in range(config.num_tasks)]
    out = config.out
    assert out is not None  # set by EvalConfig
    generators: dict[str, Generator] = {}
    for name, model in policies.items():
        path, tokenizer = await asyncio.to_thread(_load_model, model)
        engine = make_engine(config.engine, path, log_dir=out / name)
        generators[name] = Generator(engine, tokenizer, config.rollout)
    assignments = list(itertools.product(policies, repeat=len(seats)))
    say(f"[bold]{config.env.name}[/bold]: seats {', '.join(seats)}; {note}; {len(assignments)} assignments of "
        f"{len(policies)} policies", highlight=False)
    rows: list[dict[str, Any]] = []
    everything: list[Trajectory] = []
    try:
        await asyncio.gather(*(g.engine.start() for g in generators.values()))  # type: ignore[union-attr]
        for assignment in assignments:
            t0 = time.perf_counter()
            players = {seat: generators[name] for seat, name in zip(seats, assignment, strict=True)}
            episodes = await play_starts(local_seats(config.env.make), players, starts,
                                         samples=config.rollout.samples_per_prompt,
                                         concurrency=config.rollout.concurrency, env_name=config.env.name,
                                         timeout_s=config.rollout.timeout_s)
            row: dict[str, Any] = {"players": dict(zip(seats, assignment, strict=True)),
                                   "wall_s": round(time.perf_counter() - t0, 1)}
            for seat in seats:
                trajs = [e[seat] for e in episodes if seat in e]
                for t in trajs:
                    t.outcome = {**t.outcome, "policy": row["players"][seat], "pairing": len(rows)}
                n = max(len(trajs), 1)
                row[seat] = {"accuracy": sum(passed(t, config.pass_threshold) for t in trajs) / n,
                             "reward": sum(t.reward for t in trajs if not t.failed) / n,
                             "failed": sum(t.failed for t in trajs)}
                everything += trajs
            rows.append(row)
            say("  " + ", ".join(f"{s}={p}" for s, p in row["players"].items()) + ": "
                + ", ".join(f"{s} {row[s]['accuracy']:.1%}" for s in seats), highlight=False)
    finally:
        await asyncio.gather(*(g.engine.stop() for g in generators.values()))  # type: ignore[union-attr]
    write_jsonl(everything, out / "trajectories.jsonl")
    _write_json({"env": config.env.name, "seats": seats, "policies": policies, "matrix": rows,
                 "by_policy": by_policy(rows, seats), "config": config.to_json(), "tasks": note},
                out / "summary.json")
    if console is not None:
        print_matrix(console, rows, seats, out)
    return rows, out


def by_policy(rows: list[dict[str, Any]], seats: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Each policy's mean accuracy in each seat, against each assignment of the other seats (``vs``), and over all."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        for seat in seats:
            policy = row["players"][seat]
            others = ", ".join(f"{s}={p}" for s, p in row["players"].items() if s != seat)
            out.setdefault(policy, {}).setdefault(seat, {})[f"vs {others}"] = row[seat]["accuracy"]
    for seats_of in out.values():
        for results in seats_of.values():
            results["overall"] = sum(results.values()) / len(results)
    return out


def print_matrix(console: Console, rows: list[dict[str, Any]], seats: list[str], out: Path) -> None:
    """The cross-play matrix as a table."""
    table = Table(title="cross-play: pass rate (mean reward) per seat", title_justify="left")
    for seat in seats:
        table.add_column(f"{seat} played by")
    for seat in seats:
        table.add_column(f"{seat} result", justify="right")
    for row in rows:
        table.add_row(*(row["players"][s] for s in seats),
                      *(f"{row[s]['accuracy']:.1%} ({row[s]['reward']:.2f})" for s in seats))
    console.print(table)
    console.print(f"results: {out / 'summary.json'}  trajectories: {out / 'trajectories.jsonl'}", highlight=False)


def parse_policies(values: list[str], default_model: str) -> dict[str, str]:
    """``--policy NAME=MODEL`` values as a dict (``{"policy": default_model}`` without any)."""
    policies: dict[str, str] = {}
    for value in values:
        name, sep, model = value.partition("=")
        if not sep or not name or not model:
            raise EvalInputError(f"--policy takes NAME=MODEL (a checkpoint dir or 'bundled'), got {value!r}")
        if name in policies:
            raise EvalInputError(f"--policy {name} is given twice")
        policies[name] = model
    return policies or {"policy": default_model}

