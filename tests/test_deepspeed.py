"""The DeepSpeed ZeRO backend: one update with 2 ranks (ZeRO-2, ZeRO-3) matching the FSDP2 backend on 1 rank, and
(1 rank, fp32 and bf16) weight export plus save_state/load_state round trips that check bf16 against FSDP too.

Every DeepSpeed run is a subprocess (``torchrun`` or this file run as a script): DeepSpeed keeps process-wide state
(its communication backend, LOCAL_RANK, compiled ops) that should not leak into the pytest process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from required import require_module
from updates import LORA_PPO, export_logprob_sum, run_env, run_update

pytestmark = [pytest.mark.e2e, pytest.mark.deepspeed]

REPO = Path(__file__).resolve().parent.parent

require_module("deepspeed", "`make install` installs it (pip install 'deepspeed>=0.19')")
ROUND_TRIP_LR = 1e-3
"""The round trip's peak LR: one warmup step (a third of it) moves the tiny model's logprobs by more than 1."""


def _run(command: list[str], timeout: float = 600) -> None:
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=run_env(), timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def fsdp_one_rank(tmp_path_factory) -> dict:
    return run_update(tmp=tmp_path_factory.mktemp("fsdp"))  # the defaults: FSDP, fp32


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_two_ranks_match_fsdp_one_rank(zero_stage, fsdp_one_rank, tmp_path):
    ds = run_update("--backend", "deepspeed", "--zero-stage", str(zero_stage), "--dtype", "fp32", ranks=2,
                    tmp=tmp_path)
    assert (ds["world_size"], fsdp_one_rank["world_size"]) == (2, 1)
    assert ds["train/lr"] == fsdp_one_rank["train/lr"] == 3e-4
    # fp32, same data, same AdamW: what may differ is rounding, i.e. the order of sums (the gradient reduction
    # over 2 ranks, the micro-batch accumulation) at fp32's ~1e-7. Seen: loss and entropy within 1e-6 relative;
    # grad_norm within 3e-5, all of it FSDP's side: clip_grad_norm_ sums in fp32, ZeRO in fp64 (an fp64 norm of
    # FSDP's gradients gives DeepSpeed's value to 1e-7). rel 1e-4 catches any wrong scaling (a loss divided by the
    # world size or the micro-batch count twice is off by 2x or more).
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert math.isclose(ds[key], fsdp_one_rank[key], rel_tol=1e-4), (key, ds[key], fsdp_one_rank[key])
    # The update moves this sum by ~11 (-4558.62 before, -4569.75 after), so relative 1e-4 (0.46) would barely
    # see it; an absolute 0.01 is 0.1% of the update's effect and 50x the differences seen (<= 2e-4).
    assert abs(ds["logprob_sum_after"] - fsdp_one_rank["logprob_sum_after"]) < 0.01, (
        ds["logprob_sum_after"], fsdp_one_rank["logprob_sum_after"])
    # and the update happened: two runs that changed nothing would match too
    assert abs(ds["logprob_sum_after"] - ds["logprob_sum_before"]) > 1.0, (ds["logprob_sum_before"],
                                                                          ds["logprob_sum_after"])


def test_lora_on_zero_three_two_ranks_matches_fsdp(tmp_path):
    """LoRA on DeepSpeed (PPO, a KL term, two updates), ZeRO-3 over 2 ranks: only the adapters and the value head
    train and hold Adam state, the numbers are FSDP's, the KL reference is the base model, and the export is a
    plain HF model (the adapters merged) computing the policy."""
    fsdp = run_update(*LORA_PPO, ranks=2, tmp=tmp_path)  # the LoRA test's own FSDP run (computed once a session)
    ds = run_update("--backend", "deepspeed", "--zero-stage", "3", *LORA_PPO, "--export", str(tmp_path / "export"),
                    ranks=2, tmp=tmp_path)
    assert ds["requires_grad"] == fsdp["requires_grad"]
    assert all(".lora_A." in n or ".lora_B." in n or ".value_head." in n for n in ds["requires_grad"])
    # Adam state for the adapters alone (ZeRO pads each partition by a few elements); the frozen base is ~100x more
    assert ds["trainable_numel"] <= ds["adam_numel"] < ds["trainable_numel"] + 1024, ds
    for key in ("train/loss", "train/kl", "train/value_loss", "train/grad_norm", "logprob_sum_after",
                "reference_logprob_sum_after"):
        assert math.isclose(ds[key], fsdp[key], rel_tol=1e-4, abs_tol=1e-9), (key, ds[key], fsdp[key])
    assert abs(ds["logprob_sum_after"] - ds["logprob_sum_before"]) > 1.0  # the adapters moved the policy
    assert math.isclose(ds["reference_logprob_sum_after"], ds["logprob_sum_before"], rel_tol=1e-6)  # still the base
    assert math.isclose(export_logprob_sum(tmp_path / "export"), ds["logprob_sum_after"], rel_tol=1e-4)


@pytest.mark.parametrize(("zero_stage", "dtype"), [(2, "fp32"), (3, "bf16")])
def test_one_rank_export_and_state_round_trip(zero_stage, dtype, tmp_path):
    """Also: clipping, the LR schedule and micro-batch accumulation against FSDP, and the frozen reference."""
    out = tmp_path / "result.json"
    _run([sys.executable, __file__, str(zero_stage), dtype, str(tmp_path), str(out)])
    r = json.loads(out.read_text())
    print(f"round trip, ZeRO-{zero_stage} {dtype}: {r['seconds']}")
    # The fp32 master weights are the checkpoint's, bit for bit, bf16 included (DeepSpeed's own bf16 setup would
    # have rounded them to bf16).
    assert r["initial_masters_max_abs_diff"] == 0.0

    # Step 1 (two micro-batches) against FSDP's. Warmup of 3 steps: the LR this step used is lr/3.
    assert r["lrs"][0] == r["fsdp_lr"] == pytest.approx(ROUND_TRIP_LR / 3)
    assert math.isclose(r["grad_norms"][0], r["fsdp_grad_norm"], rel_tol=1e-4), (r["grad_norms"], r["fsdp_grad_norm"])
    # fp32 clips (grad_clip 1e-3 below the norm), bf16 does not (why: below).
    assert (r["grad_norms"][0] > r["grad_clip"]) == (dtype == "fp32")
    # Per-token logprobs after the step vs FSDP's, where the step moved them by >1. fp32: seen 2e-5, from FSDP's
    # fp32 gradient norm (3e-5 relative off the fp64 one ZeRO computes) entering the clip factor. In bf16 any
    # master-weight difference that straddles a bf16 rounding boundary reaches the compute weights (that same norm
    # error gave 0.2 with clipping, 0.0 with FSDP patched to an fp64 norm), so bf16 runs unclipped, where DeepSpeed
    # matches FSDP bit for bit (seen: 0.0).
    assert r["max_abs_diff_vs_fsdp"] < 1e-3, r["max_abs_diff_vs_fsdp"]
    assert r["update_moved_logprobs"] > 1.0  # the step did something the comparison can see

    # export_weights: a loadable HF checkpoint whose logprobs are the policy's, written atomically
    assert set(r["export_files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not r["leftover_tmp"]
    assert r["export_max_abs_diff"] < (1e-5 if dtype == "fp32" else 1e-3), r["export_max_abs_diff"]

    # save_state after step 1, step 2, load_state, step 2 again: weights restored exactly, and the optimizer and
    # the schedule too, since the repeated step gives the same norm, LR (2/3 of lr; a fresh schedule would be at
    # 1/3, one that kept going at 1) and weights.
    assert r["restored_max_abs_diff"] == 0.0
    assert r["lrs"][1:] == pytest.approx([2 * ROUND_TRIP_LR / 3, 2 * ROUND_TRIP_LR / 3])
    assert r["step_after_load"] == r["step_after_save"]
    assert r["logprobs_after_load_step_max_abs_diff"] == 0.0
    # the frozen reference still gives the initial policy's logprobs
    assert r["reference_max_abs_diff"] == 0.0
    # A NaN gradient stops the run at that step instead of making the policy NaN: FSDP before its update (the
    # weights stay as they were), DeepSpeed after its engine's (the run stops before they are sent or saved).
    assert r["fsdp_nan_update"] == r["deepspeed_nan_update"] == "refused"
    assert r["fsdp_after_nan_update_max_abs_diff"] == 0.0


# ----------------------------------------------------------------------------- the 1-rank scenario (a subprocess)


def _round_trip(zero_stage: int, dtype: str, tmp: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from dist_update import synthetic_trajectories
    from tiny import tiny_model_dir

    from trainer.backends.base import BackendConfig, NonFiniteGradientError
    from trainer.backends.common import model_logprobs
    from trainer.backends.deepspeed import DeepSpeedBackend
    from trainer.backends.fsdp import FSDPBackend
    from trainer.batching import to_padded

    model_dir = tiny_model_dir()
    grad_clip = 1e-3 if dtype == "fp32" else 1e3  # clip in fp32 only: see the test for why
    config = BackendConfig(model_path=str(model_dir), lr=ROUND_TRIP_LR, warmup_steps=3, total_steps=10,
                           grad_clip=grad_clip, dtype=dtype, reference=True)
    trajs = synthetic_trajectories()[:6]
    batch = to_padded(trajs, pad_id=2)
    mask = batch["loss_mask"]
    micro_batches = [to_padded(trajs[:3], pad_id=2), to_padded(trajs[3:], pad_id=2)]

    def update(backend) -> tuple[float, float]:
        """One optimizer step raising the batch's mean token logprob, accumulated over two micro-batches."""
        for mb in micro_batches:
            logprobs = backend.forward(mb).logprobs
            backend.backward(-(logprobs * mb["loss_mask"]).sum() / mask.sum())
        stats = backend.step()
        return stats.grad_norm, stats.lr

    def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    r: dict = {"seconds": {}, "grad_clip": grad_clip}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        r["seconds"][name] = round(now - clock[0], 1)
        clock[0] = now

    def nan_update(backend) -> str:
        """A step whose loss is NaN (as a bf16 overflow or a broken kernel gives): what the backend did with it."""
        logprobs = backend.forward(micro_batches[0]).logprobs
        backend.backward((logprobs * micro_batches[0]["loss_mask"]).sum() * float("nan"))
        try:
            backend.step()
        except NonFiniteGradientError:
            return "refused"
        return "stepped"

    fsdp = FSDPBackend(dataclasses.replace(config, reference=False))
    r["fsdp_grad_norm"], r["fsdp_lr"] = update(fsdp)
    fsdp_after = fsdp.logprobs(batch)
    r["fsdp_nan_update"] = nan_update(fsdp)
    r["fsdp_after_nan_update_max_abs_diff"] = max_diff(fsdp.logprobs(batch) * mask, fsdp_after * mask)
    del fsdp
    lap("fsdp: build, 1 step")

    backend = DeepSpeedBackend(config, zero_stage=zero_stage)
    original, masters = load_file(model_dir / "model.safetensors"), backend.full_state_dict()
    r["initial_masters_max_abs_diff"] = max(max_diff(original[k], masters[k]) for k in original)
    before = backend.logprobs(batch)
    reference = backend.logprobs(batch, reference=True)
    lap("deepspeed: build")

    steps = [update(backend)]
    after = backend.logprobs(batch)
    r["max_abs_diff_vs_fsdp"] = max_diff(after * mask, fsdp_after * mask)
    r["update_moved_logprobs"] = max_diff(after * mask, before * mask)
    lap("deepspeed: 1 step")

    backend.export_weights(tmp / "export")
    r["export_files"] = sorted(p.name for p in (tmp / "export").iterdir())
    r["leftover_tmp"] = [p.name for p in tmp.iterdir() if p.name.endswith(".tmp")]
    lap("export_weights")
    # The attention kernel the backend uses on CPU (attention=auto), so only the weights can differ.
    model = AutoModelForCausalLM.from_pretrained(tmp / "export", dtype=torch.float32, attn_implementation="eager")
    if dtype == "bf16":  # compute weights in bf16, buffers (rotary frequencies) in fp32, as the backend runs
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    with torch.no_grad():
        loaded = model_logprobs(model, batch, torch.device("cpu"), config.temperature)[0]
    r["export_max_abs_diff"] = max_diff(loaded * mask, after * mask)
    del model
    lap("load the export")

    backend.save_state(tmp / "state")
    lap("save_state")
    steps.append(update(backend))
    after_save = backend.logprobs(batch)
    lap("deepspeed: 1 step")
    backend.load_state(tmp / "state")
    lap("load_state")
    r["restored_max_abs_diff"] = max_diff(backend.logprobs(batch), after)
    steps.append(update(backend))
    r["step_after_save"], r["step_after_load"] = steps[1], steps[2]
    r["logprobs_after_load_step_max_abs_diff"] = max_diff(backend.logprobs(batch), after_save)
    r["grad_norms"], r["lrs"] = [n for n, _ in steps], [lr for _, lr in steps]
    r["reference_max_abs_diff"] = max_diff(backend.logprobs(batch, reference=True), reference)
    r["deepspeed_nan_update"] = nan_update(backend)  # last: DeepSpeed has applied it by the time it says so
    lap("deepspeed: 1 step, checks")
    return r


if __name__ == "__main__":
    # python tests/test_deepspeed.py ZERO_STAGE DTYPE TMP_DIR OUT_JSON
    stage, dtype_arg, tmp_dir, out_json = sys.argv[1:5]
    result = _round_trip(int(stage), dtype_arg, Path(tmp_dir))
    Path(out_json).write_text(json.dumps(result))
    from trainer.distributed import shutdown_distributed

    shutdown_distributed()
