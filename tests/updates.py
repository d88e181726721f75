"""One policy update of tests/dist_update.py in a subprocess (``torchrun`` for several ranks), as the trainer, LoRA
and DeepSpeed tests run it. A run without ``--export`` is computed once per test session: several tests compare
against the same 1-rank FSDP update."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LORA_PPO = ("--lora", "8", "--kl-coef", "0.1", "--algorithm", "ppo", "--updates", "2", "--lr", "1e-3",
            "--micro-batch-tokens", "300")
"""PPO with LoRA, a KL term, several micro-batches and two updates: the LoRA tests' update, on either backend."""

_done: dict[tuple[tuple[str, ...], int], dict] = {}


def run_env() -> dict[str, str]:
    """The environment a subprocess that may build DeepSpeed's ops runs in."""
    cache = Path(os.environ.get("ENVKIT_CACHE_DIR") or REPO / ".cache")
    # DeepSpeed compiles its CPU comm op on first use (~25 s); keep the build in the project cache.
    return {**os.environ, "ENVKIT_CACHE_DIR": str(cache),
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache / "torch_extensions")}


def run_update(*args: str, ranks: int = 1, tmp: Path) -> dict:
    """The metrics rank 0 wrote after one update with ``args`` on ``ranks`` ranks (``tmp`` holds its output)."""
    key = (args, ranks)
    if key in _done:
        return _done[key]
    name = f"update-{ranks}-{hashlib.sha1(' '.join(args).encode()).hexdigest()[:12]}.json"
    if "--export" in args:  # an export's files belong to the test that asked for them
        return _run_update(args, ranks, tmp / name)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        _done[key] = _run_update(args, ranks, tmp / name)
        return _done[key]
    # Under xdist the first worker to need a run computes it and the other reads its result, in the run's base temp
    # dir that the workers share (``tmp`` is <base>/popen-gwN/<test>).
    shared = tmp.parent.parent / "updates"
    shared.mkdir(exist_ok=True)
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / name).is_file():
            (shared / name).write_text(json.dumps(_run_update(args, ranks, tmp / name)))
    _done[key] = json.loads((shared / name).read_text())
    return _done[key]


def _run_update(args: tuple[str, ...], ranks: int, out: Path) -> dict:
    """Run tests/dist_update.py with ``args`` on ``ranks`` ranks, writing ``out``; its metrics."""
    launcher = [sys.executable]
    if ranks > 1:  # --standalone: a free rendezvous port, so concurrent jobs never collide on 29500
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command = [*launcher, str(REPO / "tests" / "dist_update.py"), "--out", str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=run_env(), timeout=600)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return json.loads(out.read_text())


def export_logprob_sum(path: Path) -> float:
    """The loss-masked logprob sum of tests/dist_update.py's batch under the plain HF model exported at ``path`` (no
    peft involved): what it reports as ``logprob_sum_after`` when the export computes the policy."""
    import torch
    from dist_update import synthetic_trajectories
    from transformers import AutoModelForCausalLM

    from trainer.batching import to_padded

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = to_padded(synthetic_trajectories(), pad_id=2)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    picked = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return float((picked * batch["loss_mask"][:, 1:]).sum())
