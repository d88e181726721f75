"""The supervised stage: chat rows rendered with only the assistant's tokens trained, bad rows and foreign
tokenizers refused at start, the rejection-sampling filter, and `python -m trainer stages=[sft]` lowering the
held-out loss and resuming exactly (FSDP2 with LoRA), and training on DeepSpeed. Full fine-tuning on FSDP2 is the
agent recipe's test (tests/test_agent_recipe.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from tiny import tiny_model_dir
from weights import changed_tensors

from generators import ChatTokenizer, Generator, GeneratorConfig, Trajectory, write_jsonl
from trainer.config import ConfigError, SFTConfig
from trainer.sft_data import _chat_rows, _recorded, drop_reason, rejection_sample, render_chat

REPO = Path(__file__).resolve().parent.parent
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run a Python program.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
SECRET = "TOOLOUTPUTXYZ"
LORA = ("model.lora.r=16", "sft.lr=3e-2")


def _row(a: int, b: int) -> dict:
    code = f"print({a} * {b})"
    return {"messages": [
        {"role": "system", "content": "Use the tool, then answer."},
        {"role": "user", "content": f"What is {a} times {b}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "python",
                                                             "arguments": json.dumps({"code": code})}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "python", "content": f"{a * b} {SECRET}"},
        {"role": "assistant", "content": f"The answer is {a * b}."},
    ], "tools": [PYTHON]}


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt(chat_tokenizer: ChatTokenizer):
    return Generator(None, chat_tokenizer, GeneratorConfig()).tool_prompt


def test_only_the_assistant_turns_are_trained_on(chat_tokenizer: ChatTokenizer) -> None:
    row = _row(12, 34)
    t = render_chat(row["messages"], row["tools"], chat_tokenizer, _prompt(chat_tokenizer))
    t.check()
    trained = chat_tokenizer.tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m])
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(12 * 34)"}}\n</tool_call>'
    assert trained == f"{call}<|im_end|>The answer is 408.<|im_end|>"
    assert SECRET not in trained and "12 times 34" not in trained and "Use the tool" not in trained
    # the ids are the template's rendering of the whole conversation, tools written into the system message
    chat = [{"role": m["role"], "content": m["content"]} for m in t.messages]
    assert "# Tools" in chat[0]["content"] and chat[2]["content"] == call
    assert t.prompt_ids + t.response_ids == chat_tokenizer.render(chat, generation_prompt=False)[:-1]
    assert t.tokenizer == chat_tokenizer.fingerprint and t.num_turns == 2


def test_the_rows_of_a_chat_dataset_are_checked_before_any_is_used(chat_tokenizer, tmp_path) -> None:
    prompt = _prompt(chat_tokenizer)
    good = _row(2, 3)
    bad = {
        "no messages": ({"text": "hi"}, "row 1: no 'messages'"),
        "assistant first": ({"messages": [{"role": "assistant", "content": "hi"}]},
                            "row 1: message 0 is assistant; the conversation must open with a user message"),
        "tool without a call": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                              {"role": "tool", "content": "out"}]},
                                "row 1: message 2 is a tool result, but no assistant tool call precedes it"),
        "late system": ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                                      {"role": "assistant", "content": "a"}]},
                        "row 1: message 1 is a system message"),
        "nothing to train": ({"messages": [{"role": "user", "content": "q"}]}, "row 1: no assistant message"),
        "unknown role": ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]},
                         "row 1: message 1 has role 'robot'"),
    }
    for name, (row, message) in bad.items():
        path = _write_rows(tmp_path / f"{name.replace(' ', '_')}.jsonl", [good, row])
        with pytest.raises(ConfigError, match=message):
            _chat_rows(str(path), chat_tokenizer, prompt)
    [t0, t1] = _chat_rows(str(_write_rows(tmp_path / "ok.jsonl", [good, _row(4, 5)])), chat_tokenizer, prompt)
    assert t1.messages[-1]["content"] == "The answer is 20." and sum(t0.loss_mask) > 0


def test_a_chat_dataset_reads_the_same_from_parquet_and_a_saved_dataset_dir(chat_tokenizer, tmp_path) -> None:
    import datasets

    prompt = _prompt(chat_tokenizer)
    # a row without tools, and rows whose messages differ in fields: the columnar formats fill those with nulls
    rows = [_row(2, 3), {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
            _row(4, 5)]
    want = _chat_rows(str(_write_rows(tmp_path / "chat.jsonl", rows)), chat_tokenizer, prompt)
    assert want[1].messages[0]["role"] == "user"
    assert "# Tools" not in chat_tokenizer.tokenizer.decode(want[1].prompt_ids)  # a row without tools gets none
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "chat.parquet", tmp_path / "saved"):
        got = _chat_rows(str(path), chat_tokenizer, prompt)
        assert [(t.prompt_ids, t.response_ids, t.loss_mask) for t in got] == [
            (t.prompt_ids, t.response_ids, t.loss_mask) for t in want], path


def _traj(**fields) -> Trajectory:
    defaults = {"prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 1], "rollout_logprobs": [0.0, 0.0],
                "reward": 1.0, "env_name": "compute", "stop_reason": "done"}
    return Trajectory(**{**defaults, **fields})


def test_the_rejection_sampling_filter_keeps_exactly_what_it_says() -> None:
    ok = [{"turn": 1, "name": "python", "status": "ok"}]
    cases = {
        "kept": _traj(tool_log=ok),
        "failed": _traj(stop_reason="error", error="boom"),
        "stop_reason": _traj(stop_reason="max_turns"),
        "env": _traj(env_name="arithmetic"),
        "reward": _traj(reward=0.5),
        "tool_failure": _traj(tool_log=[*ok, {"turn": 2, "name": "python", "status": "timeout"}]),
    }
    cfg = SFTConfig(data="trajectories", paths=["x"], envs=["compute"], min_reward=1.0)
    for reason, t in cases.items():
        assert drop_reason(t, cfg, clean_tools=True) == (None if reason == "kept" else reason), reason
    kept, counts = rejection_sample(list(cases.values()), cfg, prefix="trajectories")  # rollouts: tool errors stay
    assert kept == [cases["kept"], cases["tool_failure"]]
    assert dict(counts) == {"trajectories/read": 6, "trajectories/kept": 2, "trajectories/dropped_failed": 1,
                            "trajectories/dropped_stop_reason": 1, "trajectories/dropped_env": 1,
                            "trajectories/dropped_reward": 1}
    everything = SFTConfig(data="trajectories", paths=["x"], min_reward=None, stop_reasons=["done", "max_turns"])
    assert rejection_sample(list(cases.values()), everything, prefix="t")[0] == [
        t for name, t in cases.items() if name != "failed"]


def test_trajectories_of_another_tokenizer_are_refused(chat_tokenizer, tmp_path) -> None:
    mine = _traj(tokenizer=chat_tokenizer.fingerprint)
    path = write_jsonl([mine, _traj(tokenizer="Qwen2.5-7B@0123456789abcdef")], tmp_path / "t.jsonl")
    cfg = SFTConfig(data="trajectories", paths=[str(path)])
    with pytest.raises(ConfigError, match=r"t.jsonl line 2: its token ids are the tokenizer Qwen2.5-7B@0123456789abcdef"
                                          r"'s, not this model's"):
        _recorded(cfg, chat_tokenizer)
    unrecorded = write_jsonl([_traj()], tmp_path / "old.jsonl")
    with pytest.raises(ConfigError, match="a tokenizer it does not record"):
        _recorded(SFTConfig(data="trajectories", paths=[str(unrecorded)]), chat_tokenizer)
    path = write_jsonl([mine], tmp_path / "mine.jsonl")
    assert _recorded(SFTConfig(data="trajectories", paths=[str(path)]), chat_tokenizer)[0] == [mine]


def test_a_captured_agent_episode_trains_each_of_its_sequences(chat_tokenizer, tmp_path) -> None:
    """An episode the capture gateway recorded in two segments (a compressed context) is two SFT sequences, read
    back from the JSONL a run or `envkit eval` writes."""
    segment = {"prompt_ids": [7, 8, 9], "response_ids": [10, 11], "loss_mask": [1, 1],
               "rollout_logprobs": [-0.5, -0.25], "version_spans": [[0, 0]]}
    episode = _traj(tokenizer=chat_tokenizer.fingerprint, segments=[segment])
    path = write_jsonl([episode], tmp_path / "captured.jsonl")
    sequences, counts = _recorded(SFTConfig(data="trajectories", paths=[str(path)]), chat_tokenizer)
    assert [(s.prompt_ids, s.response_ids, s.segments) for s in sequences] == [([1, 2], [3, 4], []),
                                                                              ([7, 8, 9], [10, 11], [])]
    assert counts["trajectories/kept"] == 1


@pytest.mark.parametrize(("override", "message"), [
    ("sft.data=chat", "sft.data=chat needs sft.paths"),
    ("sft.epochs=0", "sft.epochs must be >= 1"),
    ("stages=[sft,sft]", "stages must list each stage once"),
    ("stages=[dpo]", "stages='dpo' is not one of: sft, rl"),
    ("stages=[sft,rl] trainer.resume=runs/x/checkpoints/step-000002", "resume with trainer.resume=latest"),
])
def test_bad_sft_settings_fail_before_anything_starts(override: str, message: str, tmp_path) -> None:
    stages = [] if override.startswith("stages=") else ["stages=[sft]"]
    result = _trainer([*stages, *override.split(), f"trainer.output_dir={tmp_path}"], timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def _trainer(overrides: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *overrides], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def _sft(out: Path, data: Path, *more: str) -> dict:
    """``python -m trainer stages=[sft]`` on the tiny model (tests/tiny.py): what is checked is that the loss falls
    and the resume is exact, which needs no knowledge the bundled model has."""
    result = _trainer(["stages=[sft]", f"model.path={tiny_model_dir()}", "sft.data=chat", f"sft.paths=[{data}]",
                       f"trainer.output_dir={out}",
                       "sft.eval_fraction=0.25", "sft.batch_size=3", "trainer.eval_tasks=0", "trainer.save_every=3",
                       "trainer.warmup_steps=0", "logging.progress=false", *more])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _train_rows(out: Path) -> list[dict]:
    """The training steps' rows of ``out/metrics.jsonl``, in the order they were logged."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    rows = [_row(a, b) for a, b in zip(range(11, 23), range(40, 52), strict=True)]  # 12 rows: 9 train, 3 held out
    return _write_rows(tmp_path_factory.mktemp("sft") / "rows.jsonl", rows)


@pytest.mark.e2e
@pytest.mark.ray
def test_sft_lowers_the_held_out_loss_and_resumes_exactly_here_or_on_ray(chat_data, cluster, tmp_path) -> None:
    # on FSDP2 with LoRA (full fine-tuning is the agent recipe's test): its checkpoints are the adapters' state
    whole = _sft(tmp_path / "whole", chat_data, "sft.epochs=2", *LORA)
    assert whole["eval_loss_after"] < 0.7 * whole["eval_loss_before"], whole
    assert whole["sft/chat/rows"] == 12 and whole["sft/held_out"] == 3
    weights = Path(whole["weights"])
    assert weights.name == "v6" and changed_tensors(weights, tiny_model_dir()) > 0
    steps = _train_rows(tmp_path / "whole")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and all(r["train/model_tokens"] > 0 for r in steps)
    assert (tmp_path / "whole" / "report.html").is_file() and any((tmp_path / "whole" / "tensorboard").iterdir())

    # the run as if killed after its step-3 checkpoint (the end of its first epoch), then resumed as a trainer rank
    # of the Ray cluster (a stage is placed as RL is): the same last three steps, the same weights, bit for bit
    checkpoints = tmp_path / "whole" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000006"]
    shutil.rmtree(checkpoints / "step-000006")
    weights = weights.rename(tmp_path / "whole-v6")
    resumed = _sft(tmp_path / "whole", chat_data, "sft.epochs=2", *LORA, "trainer.resume=latest",
                   "placement.backend=ray", f"placement.address={cluster}")
    assert changed_tensors(Path(resumed["weights"]), weights) == 0
    assert resumed["eval_loss_after"] == whole["eval_loss_after"]
    # it trained steps 4-6 again, not from the start
    assert [r["step"] for r in _train_rows(tmp_path / "whole")] == [1, 2, 3, 4, 5, 6, 4, 5, 6]


@pytest.mark.e2e
@pytest.mark.deepspeed
def test_sft_trains_lora_on_deepspeed_and_resumes_exactly(chat_data, tmp_path) -> None:
    """LoRA adapters trained on DeepSpeed from the front door: the eval loss falls, the served weights moved only in
    the adapted linear layers, and a run resumed from its step-3 checkpoint (the adapters' state alone) ends with
    the same weights."""
    run = (chat_data, "sft.epochs=2", *LORA, "trainer.backend=deepspeed")
    whole = _sft(tmp_path / "run", *run)
    assert whole["eval_loss_after"] < 0.7 * whole["eval_loss_before"], whole
    weights = Path(whole["weights"])
    with safe_open(weights / "model.safetensors", "pt") as f, \
            safe_open(tiny_model_dir() / "model.safetensors", "pt") as g:
        changed = {k for k in f.keys() if not f.get_tensor(k).equal(g.get_tensor(k))}  # noqa: SIM118
    assert changed and all(re.search(r"_proj\.weight$", k) for k in changed), changed
    checkpoints = tmp_path / "run" / "checkpoints"
    frozen = (tiny_model_dir() / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in (checkpoints / "step-000003").rglob("*") if p.is_file()) < frozen / 2
    shutil.rmtree(checkpoints / "step-000006")
    weights = weights.rename(tmp_path / "whole-v6")
    resumed = _sft(tmp_path / "run", *run, "trainer.resume=latest")
    assert changed_tensors(Path(resumed["weights"]), weights) == 0
    assert [r["step"] for r in _train_rows(tmp_path / "run")] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
