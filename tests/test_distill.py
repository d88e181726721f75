"""On-policy distillation (``stages=[distill]``, trainer/distill.py): a teacher with another tokenizer is refused
at start; a run trains on the teacher's per-token KL, on groups RL would drop as flat; a vLLM server's prompt
logprobs score the policy's tokens as the checkpoint does here."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tiny import env_with_tests, on_tiny_model, tiny_model_dir
from weights import changed_tensors

import trainer
from generators import ChatTokenizer, Trajectory
from trainer.config import ConfigError
from trainer.distill import LocalTeacher, ServedTeacher, check_served_tokenizer, check_tokenizers, teacher_checkpoint
from trainer.placement import RunFailed
from trainer.report import RunRecord, write_run_report

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _sharpened(out: Path) -> Path:
    """The tiny model with its final norm doubled: its next-token distributions are the tiny model's at half the
    temperature, so each model's logprobs of the other's tokens differ everywhere."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model_dir(), out)  # its tokenizer and config; the weights are written over
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    model.save_pretrained(out)
    return out


def _retokenized(out: Path, *, extra_token: bool = False, template: bool = False) -> Path:
    """The tiny model's weights with a tokenizer made here: one special token more, or another chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir(), out, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    if extra_token:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|teacher|>"]})
    if template:
        tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    tokenizer.save_pretrained(out)
    return out


def _trainer(*overrides: str, ranks: int = 1, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # --standalone: a free rendezvous port, so concurrent jobs never collide on 29500
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "trainer", *overrides], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=env_with_tests())


def test_a_teacher_with_another_tokenizer_fails_at_start_with_a_clear_message(tmp_path: Path):
    policy = ChatTokenizer.from_pretrained(tiny_model_dir())
    check_tokenizers(policy, ChatTokenizer.from_pretrained(_sharpened(tmp_path / "same")), "same")  # control: passes
    for name, kwargs, message in (("vocab", {"extra_token": True}, r"vocabularies differ \(49152 vs 49153 tokens"),
                                  ("template", {"template": True}, "chat templates differ")):
        other = ChatTokenizer.from_pretrained(_retokenized(tmp_path / name, **kwargs))
        with pytest.raises(ConfigError, match=message):
            check_tokenizers(policy, other, name)
    # a run's output dir names its final weights; a dir with none is refused by name
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (tmp_path / "same").rename(run / "weights" / "v12")
    assert teacher_checkpoint(str(run)) == str((run / "weights" / "v12").resolve())
    with pytest.raises(ConfigError, match="neither a checkpoint dir"):
        teacher_checkpoint(str(tmp_path))
    for overrides, message in ((["stages=[distill]"], "needs distill.teacher"),
                               (["stages=[distill]", "distill.teacher=http://127.0.0.1:1", "generator.temperature=0.7"],
                                "prompt logprobs are at temperature 1"),
                               (["stages=[distill]", "distill.teacher=x", "distill.kl_weight=0"], "not both 0")):
        with pytest.raises(ConfigError, match=message):
            trainer.compose(overrides)
    # from the front door: refused before the policy is loaded or an engine started
    out = tmp_path / "out"
    result = _trainer("stages=[distill]", f"distill.teacher={tmp_path / 'vocab'}", *on_tiny_model(),
                      f"trainer.output_dir={out}", timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "config error: distill.teacher=" in result.stderr
    assert "does not share the policy's tokenizer" in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def _distill(out: Path, student: Path, teacher: str, ranks: int = 1) -> None:
    """Three distillation steps of ``student`` from ``teacher`` through the front door on ``ranks`` trainer ranks
    (rank 0 scores the teacher and sends its logprobs to the others), on two-turn episodes, and
    what every step must show: all groups flat under the env's own grade (the tiny models never answer arithmetic
    right, so RL would skip every update), all of them trained, on a loss that is the mean reverse KL per token
    (the advantage is ``log p_teacher − log p_policy``; with one update per batch the ratio is 1), sign included."""
    result = _trainer("stages=[distill]", f"distill.teacher={teacher}", "inference.engine=hf", f"model.path={student}",
                      "generator.seed=7", "trainer.steps=3",
                      "+env.kwargs.followups=1",  # two model turns, the env's between them: masked as in RL
                      "generator.prompts_per_step=2", "generator.samples_per_prompt=4", "generator.max_tokens=16",
                      "trainer.eval_tasks=0", "logging.progress=false", f"trainer.output_dir={out}", ranks=ranks)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3
    assert all(r["reward/mean"] == 0 and r["rollout/zero_variance_groups"] == 2 for r in steps)  # all flat
    assert all(r["rollout/zero_variance_groups_passed"] == 0 for r in steps)  # flat by failing every time
    assert all(r["rollout/turns"] == 2 for r in steps)
    assert all(r["rollout/trained"] == 8 and r["train/grad_norm"] > 0 for r in steps)  # and all trained
    for r in steps:  # the sampler's and the trainer's logprobs differ a little (TIS weights near 1)
        assert r["distill/teacher_kl"] > 0.5 and r["train/loss"] == pytest.approx(r["distill/teacher_kl"], rel=0.05)
        assert r["time/teacher_s"] > 0
    assert changed_tensors(student, out / "weights" / "v3") > 0
    assert list((out / "checkpoints").glob(f"step-*/dcp/__{ranks - 1}_0.distcp"))  # the last rank held a shard


@pytest.mark.e2e
def test_distillation_trains_on_the_teachers_kl_and_on_groups_rl_drops_as_flat(tmp_path: Path):
    """A checkpoint as the teacher, scored in the trainer, on two FSDP2 ranks. That the student moves toward its
    teacher is measured on the bundled model (docs/training/distillation.md): the tiny model's near-uniform replies
    learn nothing in a few steps."""
    _distill(tmp_path / "out", tiny_model_dir(), str(_sharpened(tmp_path / "teacher")), ranks=2)


@pytest.mark.e2e
def test_a_run_with_seats_distills_each_policy_from_the_teacher_on_two_ranks(tmp_path: Path):
    """Two policies playing GradedPair's seats, distilled from one teacher on two torchrun ranks: each policy's
    update follows the teacher's per-token KL on its own seats' tokens (its batch scored by the teacher before it
    trains), each policy's weights move, and the last rank holds a shard of each policy's checkpoint."""
    out = tmp_path / "out"
    result = _trainer("stages=[distill]", f"distill.teacher={_sharpened(tmp_path / 'teacher')}", *on_tiny_model(),
                      "env.name=seat_envs:GradedPair", "++seats={first: {policy: a}, second: {policy: b}}",
                      "trainer.steps=2", "generator.prompts_per_step=2", "generator.samples_per_prompt=2",
                      "generator.max_turns=2", "generator.max_tokens=8", "trainer.eval_tasks=0",
                      "logging.progress=false", f"trainer.output_dir={out}", ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for policy in ("a", "b"):
        for r in steps:
            assert r[f"policy/{policy}/train/grad_norm"] > 0 and r[f"policy/{policy}/time/teacher_s"] > 0
            assert r[f"policy/{policy}/distill/teacher_kl"] > 0.5, r  # the teacher's signal, as in the run above
        weights = out / "policies" / policy / "weights" / "v2"
        assert changed_tensors(tiny_model_dir(), weights) > 0
        assert list((out / "policies" / policy / "checkpoints").glob("step-*/dcp/__1_0.distcp"))


def test_a_teacher_server_that_fails_or_lies_ends_the_run_clearly_and_one_that_wants_a_key_gets_it(tmp_path: Path):
    """A teacher server on loopback that wants a bearer key, then answers /v1/completions as the test sets: each
    broken or hostile answer (an error status, no logprobs, another token's, a positive or NaN logprob that the
    update would follow anywhere) is a RunFailed naming it; an unreachable server is a config error. The key never
    shows in the run's report."""
    answer: dict[str, tuple[int, str]] = {}
    token = {2: "-0.5", 3: "-1.0", 4: "-2.0"}

    class Teacher(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def _keyed(self) -> bool:
            if self.headers.get("Authorization") == "Bearer sesame":
                return True
            self._reply(401, '{"error": "a key is needed"}')
            return False

        def do_GET(self) -> None:
            if self._keyed():
                self._reply(200, '{"data": [{"id": "teacher"}]}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if self._keyed():
                self._reply(*answer["completions"])

        def log_message(self, *args: object) -> None:
            pass

    def logprobs(entries: dict[int, str]) -> str:
        rows = ", ".join(f'{{"{t}": {{"logprob": {lp}}}}}' for t, lp in entries.items())
        return f'{{"choices": [{{"prompt_logprobs": [null, {rows}]}}]}}'

    server = ThreadingHTTPServer(("127.0.0.1", 0), Teacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(ConfigError, match=r"answered 401 to /v1/models: set distill.teacher_api_key"):
        ServedTeacher(url, None)
    teacher = ServedTeacher(url, None, api_key="sesame")
    assert teacher.model == "teacher"
    trajs = [Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0])]
    answer["completions"] = (200, logprobs(token))
    assert teacher.logprobs(trajs)[0].tolist() == [0.0, 0.0, -1.0, -2.0]
    for status, body, message in (
            (500, '{"error": "out of memory"}',
             r"answered 500 to /v1/completions: .*out of memory.*rerun with trainer.resume=latest"),
            (200, '{"choices": [{"prompt_logprobs": null}]}', r"did not return a prompt logprob for each"),
            (200, logprobs({2: "-0.5", 3: "-1.0", 7: "-2.0"}), r"did not return a prompt logprob .*KeyError: '4'"),
            (200, "not json", r"did not return a prompt logprob"),
            (200, logprobs({**token, 4: "1e9"}), r"log-probabilities that are not <= 0: \[1000000000.0\]"),
            (200, logprobs({**token, 3: "NaN"}), r"log-probabilities that are not <= 0: \[nan\]")):
        answer["completions"] = (status, body)
        with pytest.raises(RunFailed, match=message):
            teacher.logprobs(trajs)
    server.shutdown()
    server.server_close()
    with pytest.raises(ConfigError, match=rf"distill.teacher={url} cannot be reached \(ConnectError"):
        ServedTeacher(url, None, api_key="sesame")
    config = {"distill": {"teacher": url, "teacher_api_key": "sesame"}, "judge": {"api_key": None}}
    page = write_run_report(RunRecord("a run", config, {}), tmp_path / "report.html").read_text()
    assert "sesame" not in page and "(set, not shown)" in page


@pytest.mark.vllm
async def test_a_served_teacher_scores_the_policys_tokens_as_the_checkpoint_does(tiny_url: str, tmp_path: Path):
    """vLLM's prompt logprobs of a multi-turn rollout's model tokens (env tokens between them) against the same
    checkpoint's forward pass here; the served tokenizer check, which refuses a policy of other tokens; and a
    distillation run whose teacher is the server."""
    tokenizer = ChatTokenizer.from_pretrained(tiny_model_dir())
    prompt = tokenizer.render([{"role": "user", "content": "What is 3 + 5?"}])
    model = tokenizer.tokenizer.encode("The answer is 8.", add_special_tokens=False)
    env = tokenizer.tokenizer.encode("<|im_end|>\n<|im_start|>user\nNow add 2.<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    response = [*model, *env, *model[:3]]
    mask = [1] * len(model) + [0] * len(env) + [1] * 3
    trajs = [Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                        rollout_logprobs=[0.0] * len(response)),
             Trajectory(prompt_ids=prompt[:-2], response_ids=model, loss_mask=[1] * len(model),
                        rollout_logprobs=[0.0] * len(model))]
    served = await asyncio.to_thread(ServedTeacher, tiny_url, None)
    await asyncio.to_thread(check_served_tokenizer, tokenizer, served)
    remote = await asyncio.to_thread(served.logprobs, trajs)
    local = LocalTeacher(str(tiny_model_dir()), temperature=1.0, pad_id=tokenizer.pad_id, budget=4096).logprobs(trajs)
    for i, t in enumerate(trajs):
        on = [len(t.prompt_ids) + j for j, m in enumerate(t.loss_mask) if m]
        off = [p for p in range(len(t.prompt_ids) + len(t.response_ids)) if p not in on]
        assert remote[i].shape == local[i].shape == (len(t.prompt_ids) + len(t.response_ids),)
        assert (remote[i][off] == 0).all() and (local[i][off] == 0).all()
        assert (local[i][on] < 0).all()
        # vLLM computes in bf16: about 1% of a logprob's size apart; one token out of place is nats apart
        torch.testing.assert_close(remote[i][on], local[i][on], rtol=0.03, atol=0.05)
        assert (remote[i][on][1:] - local[i][on][:-1]).abs().max() > 1.0
    other = ChatTokenizer.from_pretrained(_retokenized(tmp_path / "other", template=True))
    with pytest.raises(ConfigError, match="renders a probe chat to other token ids"):
        await asyncio.to_thread(check_served_tokenizer, other, served)
    # and a run from the front door with the server as its teacher
    await asyncio.to_thread(_distill, tmp_path / "out", _sharpened(tmp_path / "student"), tiny_url)
