"""The agent recipe for real: compute's demonstrations played in Docker sandboxes (train tasks only, failures dropped
and counted), and `python -m trainer +recipe=tool_agent` end to end on the tiny model (SFT, then GRPO from its
weights, evaluated before, after SFT and after RL)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from envkit_compute.env import ComputeEnv
from tiny import env_with_tests, on_tiny_model

import trainer
from generators import ChatTokenizer
from sandboxes.tools import close_code_pools
from trainer.sft_data import load_sft_data
from trainer.sources import Mixture

REPO = Path(__file__).resolve().parent.parent


class FlakyCompute(ComputeEnv):
    """Demonstrates like compute, but the program it writes for every task of one kind fails in the sandbox."""

    async def demonstrate(self, messages):
        shown = await super().demonstrate(messages)
        if self._task["kind"] == "digit_sum" and shown.get("tool_calls"):
            code = json.dumps({"code": "raise SystemExit('no answer today')"})
            shown["tool_calls"][0]["function"]["arguments"] = code
        return shown


def _demos(env: str, n: int, tokenizer: ChatTokenizer, max_tokens: int = 128):
    pool = ["+env.kwargs.pool_size=4"] if "compute" in env.lower() else []
    cfg = trainer.compose(["stages=[sft]", f"env.name={env}", f"sft.num_demos={n}", *pool,
                           f"generator.max_tokens={max_tokens}"])

    async def play():
        envs = Mixture(cfg.env, seed=0)
        await envs.open(pool_size=0)
        try:
            return await load_sft_data(cfg, tokenizer, envs)
        finally:
            await envs.close()
            await close_code_pools()

    return asyncio.run(play())


def test_compute_demonstrates_train_tasks_for_real_in_docker(docker_client, chat_tokenizer) -> None:
    data = _demos("compute", 12, chat_tokenizer)
    demos = data.train + data.held_out
    assert data.counts == {"demos/read": 12, "demos/kept": 12} and len(data.held_out) == 1
    test_questions = {t["question"] for t in ComputeEnv().tasks("test")}
    answers = {t["question"]: t["answer"] for t in ComputeEnv().tasks("train")[:12]}
    for t in demos:
        question = t.messages[1]["content"]
        assert question in answers and question not in test_questions  # train tasks only
        assert t.tool_log == [{"turn": 1, "name": "python", "status": "ok", "sandbox": "docker",
                               "exec_s": t.tool_log[0]["exec_s"]}]
        output = t.messages[3]
        assert output["role"] == "tool" and output["content"] == str(answers[question])  # printed in the sandbox
        assert t.messages[4]["content"] == f"The answer is {answers[question]}." and t.reward == 1.0
        assert t.policy_version == -1 and t.template_mismatches == 0 and sum(t.loss_mask) > 0


def test_a_demonstration_longer_than_a_turn_is_cut_like_one_and_dropped(docker_client, chat_tokenizer) -> None:
    data = _demos("compute", 12, chat_tokenizer, max_tokens=48)  # the shorter programs fit in 48 tokens
    cut = data.counts["demos/dropped_tool_failure"]
    assert 0 < cut < 12 and data.counts["demos/kept"] == 12 - cut
    for t in data.train + data.held_out:  # what was kept is what the tokens say
        assert t.template_mismatches == 0 and t.tool_log[0]["status"] == "ok"


def test_a_demonstration_whose_tool_call_fails_is_dropped_and_counted(docker_client, chat_tokenizer) -> None:
    kinds = [t["kind"] for t in ComputeEnv().tasks("train")[:16]]
    failing = kinds.count("digit_sum")
    assert 0 < failing < 16  # the first 16 train tasks hold some of that kind and some of others
    data = _demos("test_agent_recipe:FlakyCompute", 16, chat_tokenizer)
    assert data.counts == {"demos/read": 16, "demos/kept": 16 - failing, "demos/dropped_tool_failure": failing}
    assert all("SystemExit" not in json.dumps(t.messages) for t in data.train + data.held_out)


def test_an_env_without_demonstrations_fails_the_sft_stage_saying_so(chat_tokenizer) -> None:
    try:
        _demos("calculator", 2, chat_tokenizer)
    except trainer.config.ConfigError as e:
        assert "no demonstration could be played" in str(e) and "offers no demonstrations" in str(e)
    else:
        raise AssertionError("expected a ConfigError")


def test_the_recipe_from_the_front_door(docker_client, tmp_path) -> None:
    """`python -m trainer +recipe=tool_agent` on the tiny model, sampled in-process (what the recipe teaches the
    bundled model is measured in the README; a run on its own vLLM server is test_trainer's): demonstrations played
    in Docker, SFT on them lowers the held-out loss, the RL stage starts from the SFT weights and updates them, and
    the three evaluations and the report come out."""
    out = tmp_path / "agent"
    tiny = [*on_tiny_model(), "+env.kwargs.rubric=tiny:graded",
            "sft.num_demos=8", "sft.epochs=2", "sft.batch_size=4", "sft.lr=1e-3", "trainer.steps=1", "trainer.lr=1e-3",
            "trainer.eval_tasks=2", "trainer.eval_samples=1", "generator.prompts_per_step=2",
            "generator.samples_per_prompt=4", "env.kwargs.pool_size=4", "logging.progress=false"]
    result = subprocess.run([sys.executable, "-m", "trainer", "+recipe=tool_agent", f"trainer.output_dir={out}",
                             *tiny], capture_output=True, text=True, cwd=REPO, timeout=1200, env=env_with_tests())
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("accuracy", "tool_call_rate"):  # sampled; the recipe has no greedy evaluation
        assert {f"{name}_before", f"{name}_after_sft", f"{name}_after_rl"} <= set(summary), name
    assert summary["weights"] == str(out / "rl" / "weights" / "v1")
    assert "after sft" in result.stdout and "after rl" in result.stdout
    # SFT trained on demonstrations that ran in Docker, and learned from them
    demos = [json.loads(line) for line in (out / "sft" / "sft_data.jsonl").read_text().splitlines()]
    assert len(demos) == 8 and all(d["tool_log"][0]["sandbox"] == "docker" for d in demos)
    sft = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    held_out = [r["eval/loss"] for r in sft if "eval/loss" in r]
    assert len(held_out) == 2 and held_out[1] < held_out[0], held_out
    # the RL stage started from the SFT weights, and its step updated them
    rl = json.loads((out / "rl" / "summary.json").read_text())
    assert "accuracy_before" not in rl  # its starting policy is the one the SFT stage evaluated last
    assert str(out / "sft" / "weights" / "v4") in (out / "rl" / "report.html").read_text()  # model.path
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["stop/done"] + step.get("stop/max_turns", 0) + step.get("stop/max_tokens", 0) == 8
    assert step["train/grad_norm"] > 0
    report = (out / "report.html").read_text()
    assert "sft-eval-0" in report and "rl-eval-1" in report
