"""SFT throughput: this trainer's supervised stage vs TRL's ``SFTTrainer``, same data, model, lengths and batch.

The data: ``--rows`` tool-calling conversations shaped like the agent recipe's (compute's questions, a ``python``
call with the program that answers, its output, the answer), rendered once by the chat template with the tools written
into the system message (trainer/sft_data.py): the same token ids and the same assistant-only loss masks go to both
trainers (TRL's ``input_ids`` + ``assistant_masks`` columns of a pre-tokenized dataset). The model: the bundled
SmolLM2-135M-Instruct, both in the precision our ``auto`` picks (bf16 autocast over fp32 weights on a CPU with native
bfloat16). ``--batch`` sequences per optimizer step, one forward/backward per step on both sides, AdamW at a constant
learning rate, one epoch. Each trainer runs in a process of its own, ``--rounds`` times, alternating.

Measured per optimizer step (the first step of each run is a warm-up and is not counted):
    seconds   ours: ``time/step_s`` (forward, backward, optimizer step); TRL: on_step_begin -> on_step_end
    tokens    the non-padding tokens of the step's sequences (prompt, tools, tool outputs and answers)
It prints tokens/s of both and their ratio (target: ours >= 1.5x TRL's).

    python benchmarks/sft_vs_trl.py [--rows 96] [--batch 8] [--rounds 2]

Needs ``trl==1.16.0`` in the venv (``make install`` installs it, the trl extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_rows(n: int) -> list[dict]:
    """Chat rows like the recipe's demonstrations (the program's output is the known answer)."""
    from envkit_compute.env import _KINDS, ComputeEnv

    prompt = "Answer the question. Use the python tool to compute it, then end with 'The answer is N.'"
    env = ComputeEnv()
    tools = [t.to_openai() for t in env.tools]
    rows = []
    for task in env.tasks("train")[:n]:
        code = _KINDS[task["kind"]].program(*task["args"])
        call = {"id": "call_0", "type": "function", "function": {"name": "python",
                                                                 "arguments": json.dumps({"code": code})}}
        rows.append({"messages": [
            {"role": "system", "content": prompt}, {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "python", "content": str(task["answer"])},
            {"role": "assistant", "content": f"The answer is {task['answer']}."}], "tools": tools})
    return rows


def run_ours(data: Path, out: Path, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(seconds, tokens) of each optimizer step of ``python -m trainer stages=[sft]`` on ``data``."""
    overrides = ["stages=[sft]", "sft.data=chat", f"sft.paths=[{data}]", "sft.eval_fraction=0", "sft.epochs=1",
                 f"sft.batch_size={args.batch}", "sft.lr=1e-4", "trainer.lr_schedule=constant",
                 "trainer.warmup_steps=0", "trainer.eval_tasks=0", "trainer.save_every=100000",
                 "trainer.micro_batch_tokens=100000", f"trainer.output_dir={out}", "logging.progress=false",
                 "logging.tensorboard=false"]
    subprocess.run([sys.executable, "-m", "trainer", *overrides], cwd=REPO, check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["time/step_s"], r["train/tokens"]) for r in rows if "train/tokens" in r]


def run_trl(data: Path, args: argparse.Namespace) -> list[tuple[float, float]]:
    """In a child process: TRL's SFTTrainer on the same sequences; (seconds, tokens) of each optimizer step."""
    out = subprocess.run([sys.executable, __file__, "--trl-child", str(data), "--batch", str(args.batch)], cwd=REPO,
                         check=True, capture_output=True, text=True)
    return [tuple(step) for step in json.loads(out.stdout.strip().splitlines()[-1])]


def trl_child(data: Path, batch: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from generators import read_jsonl
    from generators.models import bundled_model_dir
    from trainer.backends import train_dtype

    model_dir = bundled_model_dir()
    sequences = list(read_jsonl(data))
    dataset = Dataset.from_dict({
        "input_ids": [t.prompt_ids + t.response_ids for t in sequences],
        "assistant_masks": [[0] * len(t.prompt_ids) + t.loss_mask for t in sequences]})
    steps: list[list[float]] = []
    tokens: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: object, **__: object) -> None:
            steps.append([time.perf_counter() - self.t0, tokens[-1]])

    class Counted(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            tokens.append(float(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, num_items_in_batch)

    bf16 = train_dtype("auto") == "bf16"
    config = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, num_train_epochs=1,
                       learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, use_cpu=True, bf16=bf16,
                       max_length=None, report_to="none", save_strategy="no", logging_steps=1_000_000,
                       gradient_checkpointing=False, dataloader_num_workers=0, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    trainer = Counted(model=model, args=config, train_dataset=dataset,
                      processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Timer()])
    trainer.train()
    print(json.dumps(steps))


def tokens_per_s(steps: list[tuple[float, float]]) -> float:
    timed = steps[1:]  # the first step warms up allocations and kernels
    return sum(n for _, n in timed) / sum(s for s, _ in timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.trl_child, args.batch)
        return

    from generators import ChatTokenizer, Generator, GeneratorConfig, read_jsonl, write_jsonl
    from generators.models import bundled_model_dir
    from trainer.sft_data import render_chat

    tmp = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    rows = make_rows(args.rows)
    chat = tmp / "rows.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = ChatTokenizer.from_pretrained(bundled_model_dir())
    prompt = Generator(None, tokenizer, GeneratorConfig()).tool_prompt
    sequences = write_jsonl([render_chat(r["messages"], r["tools"], tokenizer, prompt) for r in rows],
                            tmp / "sequences.jsonl")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in read_jsonl(sequences)]
    print(f"{len(rows)} conversations, {statistics.mean(lengths):.0f} tokens each on average "
          f"({min(lengths)}-{max(lengths)}), batch {args.batch}: {len(rows) // args.batch} steps per run")
    ours, trl = [], []
    for r in range(args.rounds):
        ours.append(tokens_per_s(run_ours(chat, tmp / f"ours-{r}", args)))
        trl.append(tokens_per_s(run_trl(sequences, args)))
        print(f"round {r + 1}: envkit {ours[-1]:.0f} tokens/s, TRL SFTTrainer {trl[-1]:.0f} tokens/s "
              f"({ours[-1] / trl[-1]:.2f}x)")
    ratio = statistics.median(o / t for o, t in zip(ours, trl, strict=True))
    print(f"median over {args.rounds} rounds: envkit {statistics.median(ours):.0f} tokens/s, TRL "
          f"{statistics.median(trl):.0f} tokens/s: {ratio:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
