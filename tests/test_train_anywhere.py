"""Training on every kind of env `envkit.make` builds, in a few wide runs of `python -m trainer` that each check
everything they can show (per env, through the per-env metrics and each env's rollouts):

- every env kind at once, on the tiny model (tests/tiny.py) served by the session's tiny vLLM server: an env served
  over ws://, Docker sandboxes from a warm pool, an OpenEnv server, a gymnasium env drawn by seed, dataset rows, a
  multi-turn env, reasoning-gym, skyrl-gym, two textarena games (one self-play), and an LLM judge's score from a
  judge server the run starts;
- agents that run their own loop, on the bundled model and the session's vLLM server, through the capture gateway:
  an openai-SDK loop, a Docker-contained program, LangGraph, a CLI process, the OpenAI Agents SDK (the README's
  example), a verifiers package; beside them the bundled reward head and a relative judge over each group;
- the trainer's other modes on vLLM at once (tiny model): async, LoRA and groups that branch from one mid-episode
  state, resumed at the next step.

What the bundled model knows matters only where text it wrote is read back: agents' calls are linked by re-rendering
the chat, which near-random tokens would not survive. The runs' exact-reproduction checks are in test_trainer.py,
test_async.py and test_lora.py (seeded HF engine).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from remote_envs import envkit_serve, openenv_server
from test_trainer import _metrics
from tiny import env_with_tests, tiny_model_dir
from weights import changed_tensors, nonfinite_tensors

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
SMALL = ["generator.samples_per_prompt=4", "generator.max_tokens=16", "trainer.warmup_steps=0",
         "logging.progress=false", "trainer.eval_tasks=0"]


def train(out: Path, url: str, model: Path, *overrides: str, steps: int = 2, timeout: float = 1200,
          env: dict[str, str] | None = None) -> tuple[dict[int, dict], int, str]:
    """Run ``python -m trainer`` on the server at ``url`` (serving ``model``) for ``steps`` steps; returns the
    per-step metrics, the run's pid and its output, after checking that every step trained on an update that
    reached the exported weights, and that no rollout failed."""
    process = subprocess.Popen([sys.executable, "-m", "trainer", f"inference.url={url}", f"model.path={model}",
                                f"trainer.output_dir={out}", f"trainer.steps={steps}", *SMALL, *overrides],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent,
                               env=env or env_with_tests())
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-6000:]
    metrics = _metrics(out)
    assert sorted(metrics) == list(range(1, steps + 1)), output[-4000:]
    # the trainer logs "step N: k of n rollouts failed ...; first errors: ..." when some did
    failures = [line for line in output.splitlines() if "rollouts failed" in line]
    assert all(m["rollout/failed"] == 0 for m in metrics.values()), "\n".join(failures) or metrics  # in full
    for step, m in metrics.items():
        assert "train/skipped_update" not in m and m["rollout/trained"] > 0 and m["train/grad_norm"] > 0, (step, m)
    last = out / "weights" / f"v{steps}"
    assert changed_tensors(last, model) > 0 and nonfinite_tensors(last) == []  # moved, and not to NaN
    return metrics, process.pid, output


def _rollouts(out: Path) -> list[dict]:
    """The last step's rollouts and the final evaluation's."""
    return [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]


def _write_skyrl_rows(out: Path) -> dict[str, str]:
    """skyrl-gym rows (ground truth a number), train and test; the kwargs naming them."""
    for split, firsts in (("train", range(1, 6)), ("test", range(6, 8))):
        (out / f"{split}.jsonl").write_text("".join(
            json.dumps({"id": f"sum-{a}-{b}", "reward_spec": {"ground_truth": a + b},
                        "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer as #### N."}]}) + "\n"
            for a in firsts for b in range(1, 4)))
    return {"tasks": str(out / "train.jsonl"), "test_tasks": str(out / "test.jsonl")}


def _hydra(value: object) -> str:
    """``value`` in Hydra's override syntax (strings quoted, so that URLs and paths stay whole)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_hydra, value)) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def _mixture(members: dict[str, dict]) -> str:
    """The ``env.mixture`` override of ``members`` (label: entry), one weight each."""
    return "env.mixture=" + _hydra([{**entry, "label": label} for label, entry in members.items()])


def _word_problems(out: Path) -> Path:
    """examples/train_dataset.py's rows (``problem``, ``solution``), written by its own function."""
    spec = importlib.util.spec_from_file_location("train_dataset", REPO / "examples" / "train_dataset.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.write_word_problems(out / "word_problems.jsonl")


def _owned_by(pid: int, labels: dict[str, str]) -> bool:
    from sandboxes.docker import OWNER_LABEL

    return labels.get(OWNER_LABEL, "").split(":")[1:2] == [str(pid)]


@pytest.mark.docker
@pytest.mark.openenv
def test_trains_on_every_kind_of_env_at_once(tiny_url, docker_client, arithmetic_image, tmp_path):
    """One mixture, one prompt of each env a step: each env's rollouts are sampled, scored and trained on beside the
    others', and what each kind of env promises holds in its own rollouts. The tiny model's replies earn little from
    the envs' own graders, so each env's reward is its own plus a graded part (``tiny:graded``) and no group is flat;
    the judged entry's reward is a judge's score alone: the expected digit of the bundled model's answer, from a
    judge server the run starts (examples/train_judged.py's rubric)."""
    from sandboxes.docker import OWNER_LABEL

    server = envkit_serve("arithmetic")
    try:
        with openenv_server() as openenv:
            members = {
                "remote": {"name": f"ws://127.0.0.1:{server.port}/arithmetic",
                           "kwargs": {"num_train": 40, "num_test": 7}},
                "docker": {"name": "arithmetic", "sandbox": "docker", "pool_size": 2},
                "openenv": {"name": f"openenv:{openenv.url}"},
                "gym": {"name": "gym:Blackjack-v1", "kwargs": {"max_invalid": 2}},
                "dataset": {"name": "arithmetic", "tasks": {
                    "source": "dataset", "dataset": str(_word_problems(tmp_path)), "eval_rows": 16,
                    "columns": {"question": "problem", "answer": "solution"}}},
                "guess": {"name": "guess-number", "kwargs": {"high": 8, "max_turns": 4}},
                "rg": {"name": "reasoning_gym:basic_arithmetic", "kwargs": {
                    "num_train": 40, "num_test": 8, "answer": "last_number", "config": {
                        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                        "allow_negation": False, "allow_parentheses": False}}},
                "skyrl": {"name": "skyrl:gsm8k", "kwargs": _write_skyrl_rows(tmp_path)},
                "ta": {"name": "textarena:GuessTheNumber-v0", "kwargs": {"max_turns": 2}},
                "ttt": {"name": "textarena:TicTacToe-v0", "kwargs": {"opponent": {"max_tokens": 16}, "seat": 1}},
                "judged": {"name": "arithmetic", "kwargs": {"rubric": "train_judged:rubric"}},
            }
            # The tiny model's replies earn next to nothing from the envs' graders: a graded part beside it. (A rubric
            # scores an episode the env ends; OpenEnv's echo never ends, and its own reward varies with every reply.)
            for label, entry in members.items():
                if label not in ("judged", "openenv"):
                    entry.setdefault("kwargs", {})["rubric"] = "tiny:graded"
            since = int(time.time()) - 1
            metrics, pid, _ = train(
                tmp_path / "run", tiny_url, tiny_model_dir(), _mixture(members),
                f"generator.prompts_per_step={len(members)}", "generator.max_turns=4",
                "generator.max_total_tokens=2048", "judge.model=bundled", "judge.kv_cache_gib=1",
                "trainer.eval_tasks=2", "trainer.eval_samples=1", "trainer.eval_greedy=false",
                env=env_with_tests(REPO / "examples"))
    finally:
        server.stop()
    out = tmp_path / "run"
    for step, m in metrics.items():
        for label in members:  # one group of 4 from each env, every rollout scored and trained on
            assert m[f"env/{label}/rollouts"] == m[f"env/{label}/trained"] == 4, (step, label, m)
        assert -1 <= m["env/ttt/reward/mean"] <= 1.1 and 0 < m["rubric/polite"] < 1, m  # a game, and a tenth
    rollouts = _rollouts(out)
    trained = {label: [t for t in rollouts if t["env_name"] == label and t["policy_version"] == 1]
               for label in members}
    held_out = {label: [t for t in rollouts if t["env_name"] == label and t["policy_version"] == 2]
                for label in members}
    for label, trajs in trained.items():
        assert len(trajs) == 4 and all(t["loss_mask"].count(1) > 0 for t in trajs), label
        assert held_out[label], label  # the held-out evaluation played every env
    # the served env's task lists are the ones its sessions are made with (not the served default's 10000 and 19)
    assert {t["task_id"] for t in trained["remote"]} <= {f"train-1-{i}" for i in range(40)}
    assert {t["task_id"] for t in held_out["remote"]} <= {f"test-1-{i}" for i in range(7)}
    # dataset rows: trained on training rows, evaluated on held-out ones
    assert all(t["task_id"].startswith("word_problems-") for t in trained["dataset"] + held_out["dataset"])
    assert not {t["task_id"] for t in trained["dataset"]} & {t["task_id"] for t in held_out["dataset"]}
    # the Docker pool: containers of this run were started, and none is left
    events = docker_client.events(since=since, until=int(time.time()) + 1, decode=True,
                                  filters={"type": "container", "event": "create", "label": OWNER_LABEL})
    assert any(_owned_by(pid, e["Actor"]["Attributes"]) for e in events), "the run started no sandbox container"
    assert not [c.name for c in docker_client.containers.list(all=True, filters={"label": OWNER_LABEL})
                if _owned_by(pid, c.labels)]
    # OpenEnv's echo env never ends before "bye": every episode runs to the turn limit
    assert all(t["num_turns"] == 4 and t["stop_reason"] == "max_turns" for t in trained["openenv"])
    # the gym env is drawn by seed: seeds 0 and 1, in order, one a step; replies it cannot read end an episode
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    gym = state["data"]["gym"]
    assert {k: gym[k] for k in ("epoch", "pos", "drawn")} == {"epoch": 0, "pos": 2, "drawn": 2}
    assert sorted(gym["rates"]) == ["seed-0", "seed-1"] and all(len(v) == 4 for v in gym["rates"].values())
    assert all(t["stop_reason"] == "done" for t in trained["gym"]), trained["gym"]
    assert all(t["num_turns"] > 1 for t in trained["guess"])  # wrong guesses get hints and another turn
    assert all(t["num_turns"] <= 4 for t in trained["ta"])  # 2 guesses, each after at most one rejected reply
    # as player 1, the policy first sees what its opponent, the policy on the same server, did
    seen = [t["messages"][0]["content"] for t in trained["ttt"]]
    assert all("You are Player 1" in s for s in seen)
    assert all("Player 0 placed their symbol" in s or "The game ended before your move" in s for s in seen)
    assert (out / "judge" / "vllm.log").stat().st_size > 0  # the run's own judge server scored the judged entry
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(all(f"eval/{label}/accuracy" in r for label in members) for r in evals)


async def test_an_env_over_websocket_yields_the_trajectories_it_yields_in_process():
    """Where an env runs must not change what the trainer learns from: the same seeded rollouts of multi-turn
    arithmetic (the tiny model on the in-process HF engine, reproducible per request; scored by ``tiny:graded`` so
    that rewards differ) give identical token ids, masks, logprobs, per-turn rewards and messages in-process and
    through `envkit serve` over ws://."""
    import envkit
    from generators import ChatTokenizer, Generator, GeneratorConfig
    from generators.engines.hf import HFEngine

    server = envkit_serve("arithmetic")
    try:
        tasks = list(envkit.make("arithmetic").tasks("train"))[:4]
        async with HFEngine(tiny_model_dir()) as engine:
            generator = Generator(engine, ChatTokenizer.from_pretrained(tiny_model_dir()),
                                  GeneratorConfig(samples_per_prompt=2, seed=3, max_turns=3, max_tokens=24))
            runs = [await generator.generate(lambda name=name: envkit.make(name, followups=1, rubric="tiny:graded"),
                                             tasks=tasks)
                    for name in ("arithmetic", f"ws://127.0.0.1:{server.port}/arithmetic")]
    finally:
        server.stop()
    fields = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "reward", "step_rewards", "num_turns",
              "stop_reason", "messages")
    local, remote = ([{f: getattr(t, f) for f in fields} for t in run] for run in runs)
    assert all(t["stop_reason"] == "done" and t["num_turns"] == 2 for t in local), local
    assert len({t["reward"] for t in local}) > 1  # graded episodes, not all alike
    assert remote == local


# What each framework writes into its tool's schema (the request was the framework's own).
FRAMEWORKS = {"sdk": "agent_envs:sums", "docker_agent": "agent_envs:docker_sums",
              "langgraph": "agent_envs:langgraph_sums", "cli": "agent_envs:cli_sums",
              "agents_sdk": "train_agent_sdk:make_env"}
SCHEMA_MARKS = {"langgraph": '"description": "Add two integers."', "cli": '"required": ["a", "b"], "properties"',
                "agents_sdk": '"title": "add_args"'}


@pytest.mark.agent_frameworks
@pytest.mark.docker
@pytest.mark.verifiers
def test_trains_agents_that_run_their_own_loop(policy_url, bundled_model, tmp_path):
    """Agents that own their loop, named by entry point, unmodified from PyPI: an openai-SDK tool loop
    (tests/agent_envs.py), a program in a Docker container that reaches only its gateway, LangGraph's ReAct agent, a
    command-line agent process, the OpenAI Agents SDK over the Responses API (examples/train_agent_sdk.py's env, as
    the README runs it), and a verifiers package from PyPI (its own rollout loop); every call goes through the
    capture gateway and their rollouts train as any env's. Beside them arithmetic scored half by the bundled reward
    head (``rubric_parts:graded``), and a relative judge over each group (``generator.group_rubric``) on the run's
    judge, here an external one (``judge.engine=openai``: the policy's own server): half of each rollout's reward
    is the judge's. The reward head's score varies with every reply, so the step updates whatever the agents' are."""
    members = {label: {"name": name} for label, name in FRAMEWORKS.items()}
    members["verifiers"] = {"name": "verifiers:sophistry_bench_sprint", "kwargs": {"env_args": {
        "n_items": 10, "passage_chars": 300, "weights": [1, 0, 0, 0, 0, 0, 1, 0]}}}
    members["graded"] = {"name": "arithmetic", "kwargs": {"rubric": "rubric_parts:graded"}}
    metrics, _, _ = train(tmp_path / "run", policy_url, bundled_model, _mixture(members),
                          f"generator.prompts_per_step={len(members)}", "generator.max_tokens=24",
                          "generator.group_rubric=rubric_parts:relative", "judge.engine=openai",
                          f"judge.url={policy_url}/v1", "judge.model=policy", steps=1,
                          env=env_with_tests(REPO / "examples"))
    m = metrics[1]
    for label in members:
        assert m[f"env/{label}/rollouts"] == 4, (label, m)
    assert 0 < m["rubric/reward_model"] < 1 and 0 <= m["rubric/relative_judge"] <= 1, m
    rollouts = [t for t in _rollouts(tmp_path / "run") if t["policy_version"] == 0]
    by_env = {label: [t for t in rollouts if t["env_name"] == label] for label in members}
    for label in FRAMEWORKS:
        trajs = by_env[label]
        assert len(trajs) == 4 and all(t["num_turns"] >= 1 and t["loss_mask"].count(1) > 0 for t in trajs), label
        assert all(mark in t["messages"][0]["content"] for t in trajs) if (mark := SCHEMA_MARKS.get(label)) else True
    for label in ("sdk", "docker_agent"):  # two calls an episode, linked into one sequence; the tool output masked
        trajs = by_env[label]
        assert all(t["num_turns"] == 2 and t["segments"] == [] and t["template_mismatches"] <= 1 for t in trajs)
        assert all(t["loss_mask"].count(0) > 0 for t in trajs), label
    assert all(t["response_ids"] and 0 <= t["reward"] <= 1 for t in by_env["verifiers"])
    graded = by_env["graded"]  # half the env's own grade and the reward head, half the relative judge
    assert all(t["reward"] == pytest.approx(0.5 * t["scores"]["relative_judge"] + 0.5 * t["scores"]["weighted_sum"])
               for t in graded), graded


def test_the_trainers_modes_on_vllm_train_and_resume_at_the_next_step(tiny_url, tmp_path):
    """Async training one version behind, LoRA adapters merged into the weights the server samples with, and groups
    that branch from one mid-episode state (``generator.branch_at=1`` on guess-number: each group's first rollout
    plays the first guess once and snapshots its env, the group's other rollouts go on from there in restored envs),
    in one run on the tiny model; a second run resumes from its step-2 checkpoint and trains step 3 only. The secret
    is drawn from 1..10^6, so that no trunk finds it with its first guess (its group would branch at turn 0); the env
    ends each episode after 3 guesses, where the rubric scores it (``tiny:graded``: graded, so every step updates)."""
    out = tmp_path / "run"
    modes = ["trainer.mode=async", "trainer.max_staleness=1", "model.lora.r=8", "trainer.lr=1e-2",
             "trainer.save_every=1", "env.name=guess-number", "+env.kwargs.high=1000000", "+env.kwargs.max_turns=3",
             "+env.kwargs.rubric=tiny:graded", "generator.branch_at=1", "generator.max_turns=3",
             "generator.prompts_per_step=2"]
    steps, _, _ = train(out, tiny_url, tiny_model_dir(), *modes)
    # max_staleness=1: step 1 trains groups sampled by the initial policy; the groups drawn beside them (also version
    # 0, all in flight at once) are trained by step 2, one version behind, and counted as such
    assert [steps[s]["rollout/staleness"] for s in (1, 2)] == [0, 1], steps
    assert all(m["rollout/stale_dropped"] == 0 and m["rollout/branch_turn"] == 1 for m in steps.values()), steps
    groups: dict[str, list[dict]] = {}
    for t in _rollouts(out):
        groups.setdefault(t["group_id"], []).append(t)
    assert len(groups) == 2 and all(len(g) == 4 for g in groups.values())
    for group in groups.values():
        assert len({json.dumps(t["messages"][:4]) for t in group}) == 1  # the opening, turn 1 and the env's reply
        assert all(t["branch_turn"] == 1 and t["loss_mask"].count(1) > 0 for t in group)

    steps, _, _ = train(out, tiny_url, tiny_model_dir(), *modes, "trainer.resume=latest", steps=3)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # steps 1 and 2 were not trained again
    assert changed_tensors(out / "weights" / "v3", out / "weights" / "v2") > 0
