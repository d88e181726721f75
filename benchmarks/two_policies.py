"""Two policies against one: what training several policies in one run costs per step, on the referential game.

Both runs are ``python -m trainer +recipe=referential`` for ``--steps`` steps with one seed, batch and setting, and
no held-out evaluation (so no engine for the starting model):

    two   speaker and listener bound to two policies: two models, two optimizers, two vLLM engines, two weight syncs
    one   both seats bound to one policy: one model, one engine (self-play's layout), the same episodes per step

Per step, over the steps after the first (its warm-up is not the steady state): wall time and its generate, train
and weight-sync parts, from each run's metrics; and the peak resident memory of the run's whole process tree (the
trainer and its engines), sampled every second. Prints two/one ratios.

The other way to serve two policies, two LoRA adapters on one vLLM server, is measured on the serving side alone
(``--serving``, the training side is benchmarks/lora_vs_full.py): one step's generation, ``--requests`` completions
of ``--tokens`` tokens each (half per policy, all at once), served by

    full    two servers, one model each (what the runs above do)
    lora    one server with ``--enable-lora``, both policies as rank-``--rank`` adapters on every linear layer
    one     one server, one model: the floor

with each layout's wall time, the servers' resident memory, and for lora the time to load a new adapter in place
(its weight sync, once the trainer has written it).

    python benchmarks/two_policies.py [--steps 4] [--serving] [--out runs/bench/two_policies]
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


def adapters(model: Path, out: Path, rank: int) -> list[Path]:
    """Two LoRA adapters of ``model`` (random, so that each changes what the model says), saved as peft writes them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model)
        lora = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                               init_lora_weights=False))
        paths.append(out / f"adapter-{seed}")
        lora.save_pretrained(paths[-1])
    return paths


async def serve_step(layout: str, model: Path, lora: list[Path], requests: int, tokens: int, rank: int
                     ) -> dict[str, float]:
    """One step's generation in ``layout``: its wall time, the servers' memory, and (lora) an in-place reload."""
    import asyncio
    import os

    import httpx

    from generators.engines.managed import ServerOptions
    from generators.engines.vllm import VLLMEngine

    extra = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(rank)) if layout == "lora" else ()
    if layout == "lora":
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    engines = [VLLMEngine(model, ServerOptions(extra_args=extra), kv_cache_gib=1)
               for _ in range(2 if layout == "full" else 1)]
    await asyncio.gather(*(e.start() for e in engines))
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            names = ["policy", "policy"]
            reload_s = 0.0
            if layout == "lora":
                names = ["speaker", "listener"]
                for name, path in zip(names, lora, strict=True):
                    await client.post(f"{engines[0].base_url}/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": str(path)})
                t0 = time.perf_counter()
                answer = await client.post(f"{engines[0].base_url}/v1/load_lora_adapter",
                                           json={"lora_name": "speaker", "lora_path": str(lora[1]),
                                                 "load_inplace": True})
                reload_s = time.perf_counter() - t0
                answer.raise_for_status()

            async def complete(i: int) -> None:
                engine = engines[i % len(engines)]
                body = {"model": names[i % 2], "prompt": f"Name an animal for your partner, number {i}.",
                        "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.7}
                (await client.post(f"{engine.base_url}/v1/completions", json=body)).raise_for_status()

            await asyncio.gather(*(complete(i) for i in range(4)))  # warm-up
            t0 = time.perf_counter()
            await asyncio.gather(*(complete(i) for i in range(requests)))
            wall = time.perf_counter() - t0
        rss = sum(tree_rss(e.server.process.pid) for e in engines)  # type: ignore[union-attr]
    finally:
        await asyncio.gather(*(e.stop() for e in engines))
    return {"wall_s": wall, "rss_gib": rss / 2**30, "reload_s": reload_s}


def serving(args: argparse.Namespace) -> None:
    """The ``--serving`` comparison: two full models, two adapters on one server, one model."""
    import asyncio

    from generators.models import bundled_model_dir

    model = bundled_model_dir()
    lora = adapters(model, args.out, args.rank)
    results = {layout: asyncio.run(serve_step(layout, model, lora, args.requests, args.tokens, args.rank))
               for layout in ("full", "lora", "one")}
    print(f"serving one step: {args.requests} completions of {args.tokens} tokens, half per policy")
    print(f"{'':<24}{'wall s':>8}{'tokens/s':>10}{'RSS GiB':>9}")
    for layout, label in (("full", "two models, two servers"), ("lora", "two adapters, one server"),
                          ("one", "one model, one server")):
        r = results[layout]
        print(f"{label:<24}{r['wall_s']:>8.1f}{args.requests * args.tokens / r['wall_s']:>10.0f}{r['rss_gib']:>9.2f}")
    print(f"lora/full wall {results['lora']['wall_s'] / results['full']['wall_s']:.2f}, memory "
          f"{results['lora']['rss_gib'] / results['full']['rss_gib']:.2f}; an adapter reloaded in place in "
          f"{results['lora']['reload_s']:.2f} s")
    (args.out / "serving.json").write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "two_policies")
    parser.add_argument("--serving", action="store_true", help="only the serving comparison (full, lora, one)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.serving:
        serving(args)
        return
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
