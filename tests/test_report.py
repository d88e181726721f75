"""Eval results and the ``envkit eval`` command without a model server: summary statistics on hand-made
trajectories, the self-contained HTML report (escaping, every trajectory, histogram, tool calls), argument
parsing and validation, and the whole run_eval pipeline on a real env with a scripted chat engine."""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import math
import re
import signal
import socket
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import envkit
from envkit import EnvRef
from envkit.cli import build_parser, main
from generators.engines.base import ChatCompletion, InferenceEngine, SamplingParams
from generators.engines.factory import EngineConfig
from generators.eval import EvalConfig, EvalInputError, _engine, _env_arg, config_from_args, run_eval
from generators.report import EvalSummary, passed, summarize, write_html_report
from generators.rollout import GeneratorConfig
from generators.trajectory import STOP_REASONS, Trajectory, read_jsonl

XSS = "<script>alert('x')</script>"


def traj(reward: float = 0.0, stop: str = "done", *, error: str | None = None, model_tokens: int = 0,
         turns: int = 1, **kw) -> Trajectory:
    """A finished rollout with ``model_tokens`` sampled tokens after a 3-token prompt (chat mode when 0)."""
    ids = dict(prompt_ids=[1, 2, 3], response_ids=[7] * (model_tokens + 1), loss_mask=[1] * model_tokens + [0],
               rollout_logprobs=[-0.5] * model_tokens + [0.0]) if model_tokens else {}
    return Trajectory(reward=reward, stop_reason=stop, error=error, num_turns=turns, **ids, **kw)


# ---- summarize ----------------------------------------------------------------------------------------------------

def test_summarize_hand_computed() -> None:
    trajs = [traj(1.0, model_tokens=10), traj(0.0, model_tokens=20), traj(1.0, model_tokens=5, turns=3),
             traj(0.5, "max_turns", turns=8), traj(0.7, "error", error="EngineError: boom", turns=0),
             traj(0.0, "timeout", error="rollout exceeded 300 s", turns=2)]
    s = summarize(trajs, wall_s=5.0)
    assert (s.n, s.n_passed, s.n_failed) == (6, 2, 2)
    assert s.pass_rate == pytest.approx(2 / 6)
    # Failed rollouts score 0 whatever they had earned: scores 1, 0, 1, .5, 0, 0 → mean 2.5/6 = 5/12.
    assert s.mean_reward == pytest.approx(5 / 12)
    # Sample variance: (2·(7/12)² + 3·(5/12)² + (1/12)²) / 5 = (174/144) / 5; half-width 1.96·sqrt(var/6).
    assert s.reward_ci95 == pytest.approx(1.959964 * math.sqrt(174 / 144 / 5 / 6), rel=1e-6)
    assert s.reward_ci95 == pytest.approx(0.39335, abs=1e-5)
    assert s.stop_reasons == {"done": 3, "max_turns": 1, "max_tokens": 0, "timeout": 1, "error": 1}
    assert list(s.stop_reasons) == list(STOP_REASONS)
    assert (s.model_tokens, s.tokens_counted, s.tokens_per_s) == (35, True, 7.0)
    assert s.mean_turns == pytest.approx(15 / 6)
    assert s.errors == ["EngineError: boom", "rollout exceeded 300 s"]
    assert json.loads(json.dumps(s.to_json())) == s.to_json()


def test_summarize_pass_threshold_and_degenerate_sizes() -> None:
    trajs = [traj(1.0), traj(0.5), traj(0.2), traj(2.0, "timeout", error="t")]
    assert summarize(trajs, wall_s=1, pass_threshold=0.5).n_passed == 2  # the timeout never passes
    assert not passed(trajs[3], 0.5) and passed(trajs[1], 0.5) and not passed(trajs[1])

    one = summarize([traj(0.8)], wall_s=1)
    assert (one.mean_reward, one.reward_ci95, one.pass_rate) == (0.8, 0.0, 0.0)  # n < 2: no spread, zero width
    empty = summarize([], wall_s=0)
    assert (empty.n, empty.pass_rate, empty.mean_reward, empty.reward_ci95, empty.tokens_per_s) == (0, 0, 0, 0, 0)
    assert summarize([traj(1.0), traj(1.0)], wall_s=1).reward_ci95 == 0.0


def test_summarize_chat_mode_tokens_and_error_samples() -> None:
    trajs = [traj(1.0)] + [traj(0.0, "error", error=f"E{i % 7}") for i in range(20)]
    s = summarize(trajs, wall_s=2.0)
    assert (s.model_tokens, s.tokens_counted, s.tokens_per_s) == (0, False, 0.0)
    assert s.errors == ["E0", "E1", "E2", "E3", "E4"]  # the first few distinct ones, in order


# ---- HTML report --------------------------------------------------------------------------------------------------

def conversation_trajectories() -> list[Trajectory]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": "2 + 3"})}}
    bad_call = {"id": "call_2", "type": "function", "function": {"name": "calculate", "arguments": "{not json"}}
    tool_turn = [
        envkit.system("Use the calculator."), envkit.user(f"What is 2 + 3? {XSS}"),
        envkit.assistant(None, [call]), envkit.tool_result("5", "call_1", name="calculate"),
        envkit.assistant("The answer is 5 </pre></details><b>bold</b>", [bad_call]),
    ]
    return [
        traj(1.0, task_id="test-0", group_id="test-0", messages=tool_turn, step_rewards=[0.0, 1.0], turns=2,
             model_tokens=12),
        traj(0.0, task_id=f"test-1{XSS}", group_id="test-1", sample_index=1,
             messages=[envkit.user("What is 1 + 1?"), envkit.assistant("3")]),
        traj(0.0, "error", task_id="test-2", group_id="test-2", error=f"EngineError: {XSS}"),
    ]


VOID_TAGS = frozenset({"meta", "input", "br"})


class _TagBalance(HTMLParser):
    """Tracks open elements that must be closed, to catch markup broken by unescaped content."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()


def test_html_report_is_self_contained_escaped_and_complete(tmp_path: Path) -> None:
    trajs = conversation_trajectories()
    summary = summarize(trajs, wall_s=1.0)
    path = write_html_report(trajs, summary, tmp_path / "sub" / "report.html", title=f"eval {XSS}",
                             config={"env": "calculator", "model": "bundled", "base_url": "https://example.com/v1",
                                     "env_args": {"note": XSS}})
    page = path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]  # written via a temp file, renamed

    # Self-contained: no external resources, no script at all (the filter is CSS).
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "url(" not in page
    assert "&lt;script&gt;" in page and page.count("&lt;script&gt;") >= 5  # title, config, task id, message, error
    checker = _TagBalance()
    checker.feed(page)
    checker.close()
    assert checker.stack == []

    # Every trajectory, each in a <details>, classed by outcome.
    assert len(re.findall(r'<details class="traj ', page)) == 3
    assert '<details class="traj passed">' in page and '<details class="traj notpassed">' in page
    assert '<details class="traj failed">' in page
    for t in ("test-0", "test-1", "test-2"):
        assert t in page
    text = html.unescape(page)
    assert "EngineError: " + XSS in text and "[0.0, 1.0]" in text  # error and per-turn rewards

    # The conversation, with tool calls (name + pretty JSON args; bad JSON as written) and the tool result.
    for role in ("system", "user", "assistant", "tool"):
        assert f'class="msg role-{role}"' in page
    assert '{\n  "expression": "2 + 3"\n}' in text and "{not json" in text
    assert "<b>calculate</b>" in page and "answers call_1" in text
    assert "The answer is 5 </pre></details><b>bold</b>" in text and "<b>bold</b>" not in page

    # The histogram counts the 2 finished rollouts (reward 0 and 1), labelled; the failed one is noted.
    svg = page[page.index("<svg"):page.index("</svg>")]
    assert re.findall(r"class=count>(\d+)<", svg) == ["1", "1"]
    assert re.findall(r"class=label>([^<]+)<", svg) == ["0", "1"]
    assert "1 failed (error/timeout) are not shown" in page


def test_tool_use_is_counted_from_the_tool_log_and_shown_beside_each_output(tmp_path: Path) -> None:
    def rollout(log: list[dict], **fields) -> Trajectory:
        return Trajectory(tool_log=log, num_turns=len({e["turn"] for e in log}) + 1, **fields)

    ran = {"name": "python", "status": "ok", "sandbox": "docker", "exec_s": 0.021}
    trajs = [rollout([{"turn": 1, **ran}, {"turn": 2, **ran, "status": "timeout"}]),
             rollout([{"turn": 1, "name": "bash", "status": "error", "sandbox": "docker"},
                      {"turn": 1, "name": None, "status": "unparsed"}]),
             rollout([]), rollout([{"turn": 1, **ran}], stop_reason="error", error="boom")]  # failed: not counted
    stats = summarize(trajs, wall_s=1.0).tools
    assert stats == {"calls_per_episode": 1.0, "episodes_with_call": 2 / 3, "turns_per_episode": 2.0, "calls": 3,
                     "unparsed": 1, "errors": 1, "timeouts": 1, "unknown": 0, "calls/bash": 1, "calls/python": 2,
                     "execs/docker": 3}
    assert summarize([rollout([])], wall_s=1.0).tools == {}  # nobody called a tool: no tool section
    trajs[0].messages = [envkit.assistant("run it"), envkit.tool_result("42", "call_0", "python"),
                         envkit.assistant("again"), envkit.tool_result("[killed after 10 s]", "call_0", "python")]
    page = html.unescape(write_html_report(trajs, summarize(trajs, wall_s=1.0), tmp_path / "r.html", title="t",
                                           config={}).read_text())
    assert "3 calls: 1 failed, 1 timed out, 1 more unreadable" in page and "ran in sandboxes: docker 3" in page
    assert "answers call_0 · python ok in docker (0.021 s)" in page
    assert "answers call_0 · python timeout in docker (0.021 s)" in page
    assert "turn 1: unreadable call unparsed" in page


def test_html_histogram_bins_many_distinct_rewards(tmp_path: Path) -> None:
    trajs = [traj(i / 10) for i in range(31)]  # 0.0 .. 3.0, 31 distinct values
    page = write_html_report(trajs, summarize(trajs, wall_s=1), tmp_path / "r.html", title="t", config={}).read_text()
    counts = [int(c) for c in re.findall(r"class=count>(\d+)<", page)]
    assert len(counts) == 10 and sum(counts) == 31
    assert re.findall(r"class=label>([^<]+)<", page)[0] == "0–0.3"


# ---- the eval CLI -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("level=2", ("level", 2)), ("ops=+-", ("ops", "+-")), ("xs=[1, 2]", ("xs", [1, 2])),
    ("flag=true", ("flag", True)), ('name="a=b"', ("name", "a=b")), ("prompt=a=b", ("prompt", "a=b")),
    ("empty=", ("empty", "")),
])
def test_env_arg_values_are_json_when_they_parse(text: str, expected: tuple) -> None:
    assert _env_arg(text) == expected


@pytest.mark.parametrize("bad", ["level", "=2", "1x=2", "a-b=1"])
def test_bad_env_arg_exits_2_with_a_message(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _env_arg(bad)
    with pytest.raises(SystemExit) as e:
        main(["eval", "arithmetic", "--env-arg", bad])
    assert e.value.code == 2
    assert "argument --env-arg: expected KEY=VALUE" in capsys.readouterr().err


def test_sigterm_mid_rollout_ends_eval_cleanly(tmp_path: Path) -> None:
    """SIGTERM while a rollout waits on the model unwinds as Ctrl-C does: the rollout is cancelled, nothing is
    written, and the exit status says which signal (143); before, the process died where it stood."""
    with socket.socket() as endpoint:  # an OpenAI-compatible endpoint that takes requests and never answers
        endpoint.bind(("127.0.0.1", 0))
        endpoint.listen()
        url = f"http://127.0.0.1:{endpoint.getsockname()[1]}/v1"
        proc = subprocess.Popen([sys.executable, "-m", "envkit.cli", "eval", "arithmetic", "--base-url", url,
                                 "--model", "m", "--num-tasks", "1", "--out", str(tmp_path / "out")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        endpoint.settimeout(120)
        connection, _ = endpoint.accept()  # the rollout's request is in flight
        with connection:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted: stopped before writing results" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_cli_input_errors_exit_2_before_any_model_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "arithmetic", "--base-url", "http://localhost:1/v1"]) == 2
    assert "--base-url needs --model" in capsys.readouterr().err
    assert main(["eval", "arithmtic"]) == 2
    err = capsys.readouterr().err
    assert "No environment named 'arithmtic'" in err and "Did you mean: 'arithmetic'?" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["eval", "arithmetic", "--split", "dev"]) == 2
    assert "has no split 'dev'" in capsys.readouterr().err
    assert main(["eval", "arithmetic", "--env-arg", "colour=1"]) == 2
    assert "unexpected keyword argument 'colour'" in capsys.readouterr().err
    assert main(["eval", "arithmetic", "--model", "./no/such/checkpoint"]) == 2
    assert "model directory ./no/such/checkpoint does not exist" in capsys.readouterr().err


def test_parsed_arguments_become_an_eval_config(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "eval", "arithmetic", "-n", "3", "--samples", "2", "--temperature", "0.7", "--env-arg", "level=2",
        "--env-arg", "ops=+-", "--out", str(tmp_path), "--max-tokens", "64", "--pass-threshold", "0.5",
        "--sandbox", "local",
    ])
    config = config_from_args(args)
    assert (config.env, config.model, config.num_tasks, config.rollout.samples_per_prompt,
            config.rollout.temperature) == (EnvRef("arithmetic", {"level": 2, "ops": "+-"}, sandbox="local"),
                                            "bundled", 3, 2, 0.7)
    assert (config.out, config.rollout.max_tokens, config.pass_threshold) == (tmp_path, 64, 0.5)
    defaults = config_from_args(build_parser().parse_args(["eval", "gym:Blackjack-v1"]))
    r = defaults.rollout
    assert (defaults.num_tasks, defaults.split, r.samples_per_prompt, r.concurrency, r.temperature, r.max_tokens,
            r.max_turns, r.timeout_s, r.seed, defaults.engine.engine, defaults.engine.server_seed) == \
        (64, "test", 1, 64, 0.0, 256, 8, 300.0, None, "vllm", None)
    endpoint = config_from_args(build_parser().parse_args(
        ["eval", "arithmetic", "--base-url", "http://h/v1", "--model", "m", "--seed", "7"]))
    assert (endpoint.engine.engine, endpoint.engine.url, endpoint.rollout.seed, endpoint.engine.server_seed) == \
        ("openai", "http://h/v1", 7, None)
    assert re.fullmatch(r"runs/eval/gym_Blackjack-v1-\d{8}-\d{6}", str(defaults.out))


@pytest.mark.parametrize(("argv", "message"), [
    (["-n", "0"], "num_tasks must be >= 1"),
    (["--concurrency", "0"], "concurrency must be >= 1"),
    (["--samples", "0"], "samples_per_prompt must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--timeout", "0"], "timeout_s must be > 0"),
    (["--pass-threshold", "nan"], "pass_threshold must be a finite number"),
    (["--base-url", "http://h/v1"], "--base-url needs --model"),
    (["--env-arg", "not_valid=1", "--env-arg", "x-y=2"], "KEY a Python identifier"),
    (["--env-arg", "sandbox=\"docker\""], "sandbox cannot be env kwargs"),
])
def test_eval_config_validation(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        config_from_args(build_parser().parse_args(["eval", "arithmetic", *argv]))
    except EvalInputError as e:
        assert message in str(e)
    except SystemExit:  # argparse rejected it, with the message on stderr
        assert message in capsys.readouterr().err
    else:
        pytest.fail(f"{argv} was accepted")
    with pytest.raises(ValueError, match="not a valid Python identifier"):
        EvalConfig(EnvRef("arithmetic", {"not valid": 1}))


def test_eval_config_json_never_holds_the_api_key() -> None:
    config = EvalConfig("arithmetic", model="m", engine=EngineConfig("openai", url="http://h/v1", api_key="sk-secret"))
    assert "sk-secret" not in json.dumps(config.to_json())


def test_eval_help_in_a_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "envkit.cli", "eval", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for option in ("--model", "--base-url", "--api-key", "--num-tasks", "--split", "--samples", "--concurrency",
                   "--temperature", "--max-tokens", "--max-turns", "--timeout", "--pass-threshold", "--env-arg",
                   "--out", "--seed", "examples:"):
        assert option in out
    top = subprocess.run([sys.executable, "-m", "envkit.cli", "--help"], capture_output=True, text=True).stdout
    assert "eval" in top


# ---- run_eval with a scripted engine ------------------------------------------------------------------------------

class ScriptedChat(InferenceEngine):
    """A chat-mode engine that answers even-numbered questions right; ``hang`` makes every request wait."""

    supports_token_ids = False
    model_name = "scripted"

    def __init__(self, answers: dict[str, tuple[int, float]], hang: bool = False) -> None:
        self.answers, self.hang = answers, hang
        self.started = self.stopped = False
        self.requests = asyncio.Event()
        self.seeds: set[int | None] = set()

    @property
    def base_url(self) -> str:
        return "scripted://"

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def chat(self, messages, sampling: SamplingParams, tools=None) -> ChatCompletion:
        self.requests.set()
        self.seeds.add(sampling.seed)
        if self.hang:
            await asyncio.Event().wait()
        index, answer = self.answers[messages[-1]["content"]]
        return ChatCompletion(f"The answer is {answer if index % 2 == 0 else answer + 1} <b>", finish_reason="stop")


def scripted(monkeypatch: pytest.MonkeyPatch, n: int, hang: bool = False) -> ScriptedChat:
    tasks = envkit.make("arithmetic").tasks("test")[:n]
    engine = ScriptedChat({t["question"]: (i, t["answer"]) for i, t in enumerate(tasks)}, hang)

    async def fake_engine(config: EvalConfig):
        return engine, None, "scripted chat engine"

    monkeypatch.setattr("generators.eval._engine", fake_engine)
    return engine


async def test_run_eval_writes_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = scripted(monkeypatch, 8)
    config = EvalConfig("arithmetic", num_tasks=8, out=tmp_path / "out",
                        rollout=GeneratorConfig(samples_per_prompt=2, temperature=0.0, concurrency=3))
    summary, trajectories, out = await run_eval(config)
    assert engine.started and engine.stopped and out == tmp_path / "out"
    assert isinstance(summary, EvalSummary) and (summary.n, summary.n_passed, summary.n_failed) == (16, 8, 0)
    assert summary.tokens_counted is False and summary.stop_reasons["done"] == 16
    assert [t.task_id for t in trajectories] == [f"test-1-{i // 2}" for i in range(16)]  # level-1 ids
    assert [t.to_json() for t in read_jsonl(out / "trajectories.jsonl")] == [t.to_json() for t in trajectories]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["pass_rate"] == 0.5 and saved["config"]["env"]["name"] == "arithmetic"
    assert saved["config"]["tasks"] == "the first 8 test tasks"
    assert saved["config"]["engine_note"] == "scripted chat engine" and saved["config"]["engine"]["engine"] == "vllm"
    page = (out / "report.html").read_text()
    assert len(re.findall(r'<details class="traj ', page)) == 16 and "The answer is" in page


async def test_run_eval_takes_all_tasks_when_fewer_and_says_so(tmp_path: Path, monkeypatch) -> None:
    n_test = len(envkit.make("arithmetic").tasks("test"))
    scripted(monkeypatch, n_test)
    summary, _, out = await run_eval(EvalConfig("arithmetic", num_tasks=n_test + 50, out=tmp_path))
    assert summary.n == n_test
    assert f"all {n_test} test tasks (fewer than the {n_test + 50} asked for)" in (out / "summary.json").read_text()


async def test_run_eval_stops_the_engine_when_cancelled(tmp_path: Path, monkeypatch) -> None:
    engine = scripted(monkeypatch, 4, hang=True)
    run = asyncio.create_task(run_eval(EvalConfig("arithmetic", num_tasks=4, out=tmp_path / "out")))
    await asyncio.wait_for(engine.requests.wait(), 30)
    run.cancel()  # what Ctrl-C does to asyncio.run's main task
    with pytest.raises(asyncio.CancelledError):
        await run
    assert engine.stopped and not (tmp_path / "out").exists()


async def test_seed_goes_to_the_managed_server_or_to_each_endpoint_request(tmp_path: Path, monkeypatch,
                                                                          bundled_model: Path) -> None:
    def config(*argv: str, out: str) -> EvalConfig:
        return config_from_args(build_parser().parse_args(
            ["eval", "arithmetic", "-n", "2", "--seed", "7", "--out", str(tmp_path / out), *argv]))

    engine, tokenizer, _ = await _engine(config(out="built"))  # built, not started
    assert engine.options.extra_args == ("--seed", "7") and tokenizer is not None
    assert engine.server.log_path == tmp_path / "built" / "vllm.log"

    scripted_engine = scripted(monkeypatch, 2)
    await run_eval(config(out="a"))
    assert scripted_engine.seeds == {None}  # a managed server was seeded at launch instead
    scripted_engine.seeds.clear()
    await run_eval(config("--base-url", "http://h/v1", "--model", "m", out="b"))
    derived = set(scripted_engine.seeds)
    assert len(derived) == 2 and None not in derived  # one seed per rollout, derived from 7
    scripted_engine.seeds.clear()
    await run_eval(config("--base-url", "http://h/v1", "--model", "m", out="c"))
    assert scripted_engine.seeds == derived  # and the same ones again: reproducible
