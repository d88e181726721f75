"""`envkit check`: it passes on every env in envs/ and on the gym adapter, and fails, naming the row, on envs that
each break one promise (tests/broken_envs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envkit.cli.check import CHECKS, check, failed

TESTS = Path(__file__).resolve().parent
WITH_TESTS = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
"""The environment of an `envkit check` (and of the `envkit serve` it starts) that imports broken_envs."""


SNAPSHOTTED = {"arithmetic", "guess-number", "frozenlake", "gym:Blackjack-v1", "textarena:GuessTheNumber-v0",
               "textarena:2048-v0", "textarena:TicTacToe-v0", "skyrl:gsm8k_multi_turn"}
"""The envs among them whose state is plain data: their snapshot row passes where they play several turns (the
others skip it, saying why)."""


@pytest.mark.parametrize(("name", "kwargs"), [
    ("arithmetic", {}), ("arithmetic", {"level": 3, "followups": 2}), ("calculator", {}),
    ("compute", {"code_sandbox": "local"}),  # its own demonstrations run: no need for the Docker image here
    ("guess-number", {}), ("frozenlake", {}), ("gym:Blackjack-v1", {}), ("broken_envs:GuessEnv", {}),
    ("reasoning_gym:leg_counting", {"num_train": 50, "num_test": 10}), ("textarena:GuessTheNumber-v0", {}),
    ("textarena:2048-v0", {}), ("textarena:TicTacToe-v0", {"opponent": "test_adapters:lowest_free_cell"}),
    (f"mcp+stdio:{sys.executable} {TESTS / 'mcp_server.py'}",  # an MCP server's tools, tasks and grading ours
     {"tasks": [{"id": f"t{n}", "question": f"What is {n} + 3?", "answer": n + 3} for n in range(2)]}),
    ("skyrl:gsm8k_multi_turn", {"tasks": [{"id": f"sum-{n}", "question": f"What is {n} + 1?", "answer": n + 1}
                                          for n in range(4)], "max_turns": 3})])
def test_every_env_here_passes_every_check(name: str, kwargs: dict, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", WITH_TESTS["PYTHONPATH"])
    rows = check(name, kwargs)
    assert [r.check for r in rows] == list(CHECKS)
    assert not failed(rows), rows
    ran = {r.check for r in rows if r.status == "pass"}
    assert {"contract", "same start", "close twice", "isolated sessions", "ws round trip", "reward range"} <= ran
    if name in SNAPSHOTTED and (name != "arithmetic" or "followups" in kwargs):
        assert "snapshot" in ran, rows


@pytest.mark.openenv
def test_the_openenv_adapter_passes_every_check_that_applies():
    from remote_envs import openenv_server

    with openenv_server() as server:
        rows = {r.check: r for r in check(f"openenv:{server.url}")}
    assert not failed(rows.values()), rows
    assert rows["isolated sessions"].status == "pass" and rows["ws round trip"].status == "skip"


BROKEN = [
    ("NondeterministicEnv", "same start", "opened differently in a fresh env"),
    ("CloseTwiceEnv", "close twice", "RuntimeError: already closed"),
    ("LeakyEnv", "isolated sessions", "instances share state"),
    ("OverlappingSplitsEnv", "disjoint splits", "0 ids and 1 tasks are in both train and test"),
    ("OutOfRangeEnv", "reward range", "rewards seen 0 .. 2, outside the declared reward_range [0, 1]"),
    ("ForgetfulRestoreEnv", "snapshot",
     "seed 0, snapshotted after step 1: a fresh env restored from it went differently at step 3"),
]
"""Each env of tests/broken_envs.py, the one row it fails, and what that row says."""


@pytest.mark.parametrize(("env", "row", "says"), BROKEN, ids=[env for env, _, _ in BROKEN])  # short node ids
def test_a_broken_env_fails_the_row_it_breaks_and_only_that_one(env: str, row: str, says: str):
    out = subprocess.run([sys.executable, "-m", "envkit", "check", f"broken_envs:{env}", "--no-serve", "--json"],
                         capture_output=True, text=True, timeout=120, env=WITH_TESTS)
    assert out.returncode == 1, out.stderr
    rows = {r["check"]: r for r in json.loads(out.stdout)}
    assert [name for name, r in rows.items() if r["status"] == "fail"] == [row], rows
    assert says in rows[row]["detail"], rows[row]


def test_state_shared_between_instances_fails_isolation_and_still_crosses_the_wire():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", WITH_TESTS["PYTHONPATH"])
        rows = {r.check: r.status for r in check("broken_envs:LeakyEnv")}
    assert rows["isolated sessions"] == "fail" and rows["ws round trip"] == "pass"


@pytest.mark.parametrize(("name", "kwargs"), [
    ("agent_envs:sums", {}),
    pytest.param("verifiers:sophistry_bench_sprint", {"env_args": {"n_items": 5, "passage_chars": 200}},
                 marks=pytest.mark.verifiers)])
def test_an_agent_env_passes_with_its_resets_checked_and_no_step_taken(name: str, kwargs: dict):
    """Its agent (an SDK loop of its own; a verifiers package's rollout loop) plays through a generator: check opens
    episodes (by seed and by task, in-process and over ws://) and steps none, where stepping would raise."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", WITH_TESTS["PYTHONPATH"])
        rows = {r.check: r for r in check(name, kwargs)}
    assert not failed(rows.values()), rows
    assert {"contract", "same start", "isolated sessions", "ws round trip", "disjoint splits"} <= {
        name for name, r in rows.items() if r.status == "pass"}
    assert "0 steps (an agent env" in rows["contract"].detail and rows["reward range"].status == "skip"


def test_the_table_names_the_failing_check():
    out = subprocess.run([sys.executable, "-m", "envkit", "check", "broken_envs:LeakyEnv", "--no-serve"],
                         capture_output=True, text=True, timeout=120, env={**WITH_TESTS, "COLUMNS": "200"})
    assert out.returncode == 1
    assert "isolated sessions │ fail" in out.stdout and "1 check(s) failed: isolated sessions" in out.stderr
