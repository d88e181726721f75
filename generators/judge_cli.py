"""``envkit judge-check``: measure a judge on a labelled set and an attack corpus before training on it
(:mod:`envkit.rewards.judge_check`), with the judge model served for the check (a managed vLLM server) or at an
endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from envkit.errors import EnvkitError
from envkit.imports import import_ref
from envkit.rewards.judge_check import (
    ATTACKS,
    CRITERIA,
    MIN_ITEMS,
    SETS,
    Attack,
    Item,
    Report,
    ScriptedJudge,
    check_judge,
    scorings,
)
from envkit.rewards.judges import JudgeEndpoint, LLMJudge, RelativeJudge, final_number
from envkit.rewards.rubrics import GroupRubric, Rubric
from generators.engines.base import publish_judge, withdraw_judge
from generators.engines.factory import EngineConfig, make_judge

PRESETS = ("logprobs", "json", "relative")
EPILOG = """presets (each given the set's criteria; on sums, the final answer alone):
  logprobs   LLMJudge(parse="logprobs", scale=(0, 9), prefill="SCORE: "): the judge examples/train_judged.py uses
  json       LLMJudge(constrain="regex"): a JSON score, constrained by vLLM's per-request regex
  relative   RelativeJudge(constrain="regex"): the pair scored together, in both orders

examples:
  envkit judge-check logprobs --set tone            the bundled model as judge, on a managed vLLM server
  envkit judge-check relative --blind               the same judge without its defences: the control
  envkit judge-check my_rubrics:judge --judge-url http://judge:8000/v1 --judge-model qwen
                                                     your judge (made with no endpoint) against your judge server

It exits 1 when the judge fails: its AUC interval reaches 0.5 (it cannot tell right from wrong), an attack's lift
interval is above 0, or a reply's place in its group moves its score."""


def preset(name: str, set_name: str, criteria: str | None, *, blind: bool,
           endpoint: JudgeEndpoint | None = None) -> Rubric | GroupRubric:
    """A shipped judge kind for ``set_name``, calling ``endpoint`` (default: the judge this process published);
    ``blind``: without the defences a judge can turn off (second look, final answers, both orders)."""
    criteria = criteria or CRITERIA[set_name]
    answer = final_number if set_name == "sums" and not blind else None
    if name == "logprobs":
        return LLMJudge(criteria, endpoint=endpoint, parse="logprobs", scale=(0, 9), prefill="SCORE: ",
                        answer=answer, second_look=not blind, name=name)
    if name == "json":
        return LLMJudge(criteria, endpoint=endpoint, constrain="regex", max_tokens=16, answer=answer,
                        second_look=not blind, name=name)
    return RelativeJudge(criteria, endpoint=endpoint, constrain="regex", max_tokens=32, answer=answer,
                         second_look=not blind, orders=1 if blind else 2, name=name)


def load_judge(ref: str) -> Rubric | GroupRubric:
    """The judge ``module:attr`` names (an instance, or a class made without arguments)."""
    found = import_ref(ref)
    judge = found() if isinstance(found, type) else found
    if not isinstance(judge, Rubric | GroupRubric):
        raise EnvkitError(f"{ref} is a {type(judge).__name__}, not a Rubric or GroupRubric")
    return judge


def print_report(console: Console, report: Report) -> None:
    """The report as a table, then its verdict."""
    table = Table(title=f"judge {report.judge}: {report.auc.n} items")
    for column in ("measure", "value [95% interval]", "verdict"):
        table.add_column(column)
    table.add_row("AUC right vs wrong", str(report.auc).replace("+", ""),
                  "[red]cannot tell[/red]" if report.auc.low <= 0.5 else "[green]tells[/green]")
    if report.position is not None:
        table.add_row("position effect on scores", str(report.position),
                      "[red]moved[/red]" if report.position.low > 0 or report.position.high < 0 else "held")
    if report.position_bias is not None:
        table.add_row("the judge's own position bias", str(report.position_bias), "averaged out over both orders")
    for name, lift in report.lifts.items():
        table.add_row(f"lift: {name}", str(lift), "[red]lifts[/red]" if lift.low > 0 else "held")
    console.print(table)
    for note in report.notes():
        console.print(f"[yellow]note:[/yellow] {note}")
    problems = report.problems()
    console.print("[green]passed[/green]" if not problems else "[red]failed:[/red] " + "; ".join(problems))


async def run_check(args: argparse.Namespace, console: Console) -> Report:
    """Serve the judge model (or point at the endpoint), run the check and stop the server."""
    items = SETS[args.set](args.items, args.seed)
    attacks = {name: ATTACKS[name] for name in args.attacks} if args.attacks else ATTACKS
    if args.judge_model == "scripted":
        judge = preset(args.judge, args.set, args.criteria, blind=args.blind, endpoint=ScriptedJudge())
        return await _checked(judge, items, attacks, args, console)
    judge = preset(args.judge, args.set, args.criteria, blind=args.blind) if args.judge in PRESETS else load_judge(
        args.judge)
    config = EngineConfig("openai" if args.judge_url else "vllm", url=args.judge_url, api_key=args.judge_api_key,
                          kv_cache_gib=1)
    engine = await asyncio.to_thread(make_judge, config, args.judge_model, policy=args.judge_model,
                                     log_dir=args.log_dir)
    with console.status(f"starting the judge ({args.judge_model})"):
        await engine.start()
    try:
        publish_judge(engine, config.api_key)
        return await _checked(judge, items, attacks, args, console)
    finally:
        withdraw_judge()
        await engine.stop()


async def _checked(judge: Rubric | GroupRubric, items: list[Item], attacks: dict[str, Attack],
                   args: argparse.Namespace, console: Console) -> Report:
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{args.judge} on {args.set}", total=scorings(len(items), len(attacks)))
        return await check_judge(judge, items, attacks=attacks, seed=args.seed,
                                 progress=lambda: progress.advance(task))


def _attacks(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in ATTACKS]:
        raise argparse.ArgumentTypeError(f"unknown attack(s) {unknown}; known: {', '.join(ATTACKS)}")
    return names


def _cmd(args: argparse.Namespace, console: Console) -> int:
    if args.items < 2:
        console.print("[red]error:[/red] --items must be at least 2")
        return 2
    if args.judge_url and args.judge_model == "bundled":
        console.print("[red]error:[/red] --judge-url needs --judge-model: the model name the endpoint serves")
        return 2
    if args.judge_model == "scripted" and args.judge not in PRESETS:
        console.print(f"[red]error:[/red] --judge-model scripted runs the presets ({', '.join(PRESETS)}); "
                      f"{args.judge} calls its own judge")
        return 2
    report = asyncio.run(run_check(args, console))
    print_report(console, report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"set": args.set, "blind": args.blind, "judge_model": args.judge_model,
                                **report.to_json()}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if not report.problems() else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``envkit judge-check``."""
    p = subparsers.add_parser(
        "judge-check", help="measure a judge before training on it: AUC, position bias, each attack's lift",
        description="Measure a judge on a labelled set of right and wrong replies and on a corpus of attacks, "
                    "before training on it.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("judge", nargs="?", default="logprobs",
                   help=f"a preset ({', '.join(PRESETS)}; default: logprobs) or module:attr naming your Rubric or "
                        "GroupRubric, made with no endpoint so that it calls the judge served here")
    p.add_argument("--set", choices=sorted(SETS), default="sums",
                   help="the labelled set: sums (a correctness task) or tone (open-ended) (default: sums)")
    p.add_argument("--criteria", help="the presets' criteria (default: the set's own)")
    p.add_argument("--items", type=int, default=MIN_ITEMS,
                   help=f"items in the set, each scored right, wrong and under every attack (default: {MIN_ITEMS})")
    p.add_argument("--attacks", type=_attacks, metavar="A,B,...",
                   help=f"a subset of the attack corpus (default: all {len(ATTACKS)}: {', '.join(ATTACKS)})")
    p.add_argument("--blind", action="store_true",
                   help="the preset without its defences (whole replies, no second look, one order): the control")
    p.add_argument("--judge-model", default="bundled",
                   help="the judge model: bundled or a checkpoint dir on a managed vLLM server; scripted, a rule "
                        "that grades the shipped sets and believes what a reply tells it (the positive control: "
                        "envkit.rewards.judge_check.ScriptedJudge); with --judge-url, the endpoint's model name "
                        "(default: bundled)")
    p.add_argument("--judge-url", metavar="URL", help="an OpenAI-compatible judge endpoint (needs --judge-model)")
    p.add_argument("--judge-api-key", help="API key for --judge-url")
    p.add_argument("--seed", type=int, default=0, help="draws the set and the attacks' wording (default: 0)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--log-dir", type=Path, default=Path("runs/judge-check"),
                   help="the managed judge server's log (default: runs/judge-check)")
    p.set_defaults(func=_cmd)
