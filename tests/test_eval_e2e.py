"""`envkit eval` end to end, as a user runs it: a managed vLLM server with the bundled model, a running vLLM server
attached to (`--server-url`, the session's), and an external OpenAI-compatible endpoint (the session's vLLM server)
in chat mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.curriculum import PassRates

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent


def _envkit(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envkit.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "160", **(env or {})}, timeout=900)


def _envkit_pid(*args: str, cwd: Path) -> tuple[int, int, str]:
    """``_envkit``, saying also which process it was: its pid, exit status and output."""
    process = subprocess.Popen([sys.executable, "-m", "envkit.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=cwd, env={**os.environ, "COLUMNS": "160"})
    output, _ = process.communicate(timeout=900)
    return process.pid, process.returncode, output


def _outputs(out: Path) -> tuple[dict, list[dict], str]:
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return summary, trajectories, (out / "report.html").read_text()


@pytest.mark.vllm
def test_eval_arithmetic_with_the_bundled_model_on_a_managed_server(tmp_path):
    out = tmp_path / "run"
    rates = tmp_path / "pass-rates.json"
    result = _envkit("eval", "arithmetic", "-n", "64", "--out", str(out), "--pass-rates", str(rates), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary, trajectories, html = _outputs(out)
    n_test = 19  # level 1 has 100 problems; the test split owns 19 of them, and -n 64 takes them all
    assert summary["n"] == len(trajectories) == n_test and summary["n_failed"] == 0
    assert summary["stop_reasons"]["done"] == n_test and 0.0 <= summary["pass_rate"] <= 1.0
    assert summary["model_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert all(t["response_ids"] and len(t["rollout_logprobs"]) == len(t["response_ids"]) for t in trajectories)
    assert html.count("<details") >= n_test and "pass rate" in html
    assert "pass rate" in result.stdout and str(out / "report.html") in result.stdout.replace("\n", "")
    assert "arithmetic: all 19 test tasks" in result.stdout
    # the difficulty profile, in the form the trainer's curriculum reads: each task's rollouts passed and tried
    profile = json.loads(rates.read_text())
    assert profile["split"] == "test" and sorted(profile["tasks"]) == sorted(t["task_id"] for t in trajectories)
    assert sum(row["passed"] for row in profile["tasks"].values()) == summary["n_passed"]
    seen = PassRates(window=4)
    assert seen.seed_from(rates) == n_test
    assert {key: seen.rate(key) for key in profile["tasks"]} == {
        t["task_id"]: float(t["reward"] >= 1.0) for t in trajectories}


@pytest.mark.agent_frameworks
async def test_eval_an_agent_env_through_the_capture_gateway(vllm_engine, tmp_path):
    """An agent env (an openai-SDK loop, tests/agent_envs.py) evaluates as any env: its two calls an episode are
    captured as one token sequence, written to trajectories.jsonl. `--server-url` attaches to the session's vLLM
    server (token mode, as a managed server gives) instead of starting one."""
    out = tmp_path / "agent"
    result = _envkit("eval", "agent_envs:sums", "-n", "4", "--max-tokens", "24", "--server-url", vllm_engine.base_url,
                     "--out", str(out), cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join(filter(None, [
                         str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"on the vllm server at {vllm_engine.base_url}" in result.stdout.replace("\n", "")
    summary, trajectories, _ = _outputs(out)
    assert summary["n"] == len(trajectories) == 4 and summary["n_failed"] == 0
    assert all(t["num_turns"] == 2 and t["loss_mask"].count(1) > 0 and t["loss_mask"].count(0) > 0
               for t in trajectories)


@pytest.mark.verifiers
async def test_eval_a_verifiers_package_through_the_capture_gateway(vllm_engine, tmp_path):
    """A verifiers env package from PyPI (sophistry-bench-sprint, in the venv `make install` builds for verifiers)
    evaluates as any env: its own rollout loop calls the policy through the gateway, its rubric scores the replies,
    and its held-out rows are the test split."""
    out = tmp_path / "verifiers"
    result = _envkit("eval", "verifiers:sophistry_bench_sprint", "--env-arg",
                     'env_args={"n_items": 5, "passage_chars": 200}', "-n", "2", "--samples", "2", "--max-tokens",
                     "32", "--server-url", vllm_engine.base_url, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary, trajectories, _ = _outputs(out)
    assert summary["n"] == len(trajectories) == 4 and summary["n_failed"] == 0
    assert {t["task_id"] for t in trajectories} == {"test-8", "test-9"}  # 10 rows, the last 2 held out
    # the rubric's aggregate: a reply without <claim> tags scores 0.5, one with them otherwise
    assert all(t["num_turns"] == 1 and t["response_ids"] and 0 <= t["reward"] <= 1 for t in trajectories)


async def test_eval_external_endpoint_in_chat_mode(vllm_engine, tmp_path):
    out = tmp_path / "chat"
    result = _envkit("eval", "calculator", "-n", "4", "--max-turns", "2", "--max-tokens", "48",
                     "--base-url", vllm_engine.base_url + "/v1", "--model", vllm_engine.model_name,
                     "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary, trajectories, _ = _outputs(out)
    assert summary["n"] == 4 and summary["n_failed"] == 0
    assert all(t["messages"][0]["role"] == "system" and t["response_ids"] == [] for t in trajectories)
    assert "chat mode" in result.stdout


async def test_eval_an_llm_judged_env_with_the_judge_it_names(vllm_engine, tmp_path):
    """`--judge-model` gives an env's LLM judge (examples/train_judged.py's, made with no endpoint) its judge: the
    evaluated endpoint itself (`policy`), or an external one (`--judge-url`). Every rollout is scored through it
    (graded scores, the judge's expected digit); without a judge each rollout fails, counted and said why."""
    url, model = vllm_engine.base_url + "/v1", vllm_engine.model_name
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "examples"), os.environ.get("PYTHONPATH")]))}
    common = ["eval", "arithmetic", "--env-arg", "rubric=train_judged:rubric", "-n", "3", "--samples", "2",
              "--temperature", "1", "--max-tokens", "24", "--base-url", url, "--model", model]
    judges = {"self": ["--judge-model", "policy"], "external": ["--judge-url", url, "--judge-model", model], "none": []}
    for name, judge in judges.items():
        out = tmp_path / name
        result = _envkit(*common, *judge, "--out", str(out), cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        summary, trajectories, _ = _outputs(out)
        if name == "none":
            assert summary["n_failed"] == 6 and "judge.model=bundled" in " ".join(summary["errors"]), summary
            continue
        assert summary["n"] == 6 and summary["n_failed"] == 0, summary
        rewards = [t["reward"] for t in trajectories]
        assert all(0 < r < 1 for r in rewards) and len(set(rewards)) > 1, rewards
        assert summary["rubric"]["polite"] == pytest.approx(summary["mean_reward"]) and "env" in summary["rubric"]
        assert f"at {url}" in summary["config"]["judge_note"]


async def test_eval_records_its_rollouts_and_they_replay_the_same(vllm_engine, tmp_path):
    """`--env-arg record=FILE`: each of the policy's guess-number rollouts (several turns, sampled) is recorded as
    it runs, and `envkit replay FILE` plays every one again against the env, the same at each step."""
    path = tmp_path / "episodes.jsonl"
    result = _envkit("eval", "guess-number", "--env-arg", f"record={path}", "-n", "4", "--max-turns", "3",
                     "--max-tokens", "16", "--temperature", "1", "--base-url", vllm_engine.base_url + "/v1",
                     "--model", vllm_engine.model_name, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _, trajectories, _ = _outputs(tmp_path / "out")
    replayed = _envkit("replay", str(path), "--json", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    results = json.loads(replayed.stdout)
    assert len(results) == 4 and all(r["difference"] is None for r in results), results
    assert sorted(r["steps"] for r in results) == sorted(t["num_turns"] for t in trajectories)


def test_eval_bad_input_exits_2_before_starting_anything(tmp_path):
    result = _envkit("eval", "arithmetc", cwd=tmp_path)
    assert result.returncode == 2 and "Did you mean: 'arithmetic'?" in result.stderr
    result = _envkit("eval", "arithmetic", "--judge-url", "http://127.0.0.1:9/v1", cwd=tmp_path)
    assert result.returncode == 2 and "--judge-url needs --judge-model" in result.stderr
    result = _envkit("eval", "arithmetic", "--server-url", "http://127.0.0.1:9", "--base-url", "http://127.0.0.1:9/v1",
                     "--model", "m", cwd=tmp_path)
    assert result.returncode == 2 and "name two engines: give one" in result.stderr
    result = _envkit("eval", "arithmetic", "--server-url", "http://127.0.0.1:9", "--seed", "3", cwd=tmp_path)
    assert result.returncode == 2 and "the server at --server-url is running already" in result.stderr
    assert not (tmp_path / "runs").exists()


async def test_eval_other_ecosystems_envs_by_name(vllm_engine, tmp_path):
    """`envkit eval` takes a reasoning-gym dataset, a skyrl-gym env and a textarena game by name, as it takes any
    env."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"sum-{n}", "question": f"What is {n} + 1? End with '#### N'.",
                                        "answer": n + 1}) + "\n" for n in range(3)))
    for name, args in (("reasoning_gym:leg_counting", ["--env-arg", "num_test=3"]),
                       ("skyrl:gsm8k", ["--env-arg", f"test_tasks={rows}", "--split", "test"]),
                       ("textarena:GuessTheNumber-v0", ["--env-arg", "max_turns=2", "--split", "train"])):
        out = tmp_path / name.replace(":", "-")
        result = _envkit("eval", name, *args, "-n", "3", "--max-tokens", "32", "--base-url",
                         vllm_engine.base_url + "/v1", "--model", vllm_engine.model_name, "--out", str(out),
                         cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        summary, trajectories, _ = _outputs(out)
        assert summary["n"] == len(trajectories) == 3 and summary["n_failed"] == 0, name
        assert all(t["stop_reason"] == "done" for t in trajectories), name
        if name.startswith("textarena"):  # "within 2 turns": 2 guesses, each after at most one rejected reply
            assert all(1 <= t["num_turns"] <= 4 for t in trajectories)
        else:
            assert all(t["messages"][-1]["role"] == "assistant" for t in trajectories)


async def test_eval_runs_each_rollout_in_a_sandbox(vllm_engine, docker_client, arithmetic_image, tmp_path):
    """`--sandbox docker`: the task list comes from one container of the env's image and each rollout from one of
    its own; the eval removes them all."""
    from sandboxes.docker import OWNER_LABEL

    def started_by(pid: int, labels: dict[str, str]) -> bool:
        return labels.get(OWNER_LABEL, "").split(":")[1:2] == [str(pid)]

    out = tmp_path / "sandboxed"
    since = int(time.time()) - 1
    pid, status, output = _envkit_pid(
        "eval", "arithmetic", "--sandbox", "docker", "-n", "3", "--max-tokens", "32", "--base-url",
        vllm_engine.base_url + "/v1", "--model", vllm_engine.model_name, "--out", str(out), cwd=tmp_path)
    assert status == 0, output
    events = docker_client.events(since=since, until=int(time.time()) + 1, decode=True,
                                  filters={"type": "container", "event": "create", "label": OWNER_LABEL})
    assert sum(started_by(pid, e["Actor"]["Attributes"]) for e in events) == 1 + 3
    assert not [c.name for c in docker_client.containers.list(all=True, filters={"label": OWNER_LABEL})
                if started_by(pid, c.labels)]
    summary, trajectories, _ = _outputs(out)
    assert summary["n"] == len(trajectories) == 3 and summary["n_failed"] == 0
    assert summary["config"]["env"] == {"name": "arithmetic", "kwargs": {}, "sandbox": "docker", "label": None}
    assert all(t["stop_reason"] == "done" for t in trajectories)
