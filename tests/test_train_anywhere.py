"""Training on every kind of env `envkit.make` builds: served over ws://, Docker-sandboxed from a warm pool, an
OpenEnv server, a gymnasium env drawn by seed, dataset rows, a two-env mixture, and a multi-turn env; and async mode
and LoRA on vLLM. The ones the README shows run as its `examples/` scripts do; the others through `python -m trainer`.

Each is a real 2-step run against the session's one vLLM server (`inference.url`), and must make real updates:
no skipped update, and exported weights that differ from the initial ones. The server gets its initial weights
back after each run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from remote_envs import envkit_serve, openenv_server
from weights import changed_tensors, nonfinite_tensors

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
# 8 samples per prompt: a group is all-equal with p ~ 0.3^8 + 0.7^8 on arithmetic, so a step of 4 such groups
# (no update) is a 1e-5 event. Multi-turn envs with graded rewards vary more, and their long rollouts cost more:
# 2 prompts there.
SMALL = ["trainer.steps=2", "generator.samples_per_prompt=8", "generator.max_tokens=16", "trainer.eval_tasks=4",
         "trainer.eval_samples=2", "trainer.eval_greedy=false",
         "trainer.warmup_steps=0", "logging.progress=false"]


@pytest.fixture
async def policy_url(vllm_engine, bundled_model: Path):
    """The shared vLLM server's URL; the run changes its weights, so the initial ones are loaded back after."""
    yield vllm_engine.base_url
    await vllm_engine.load_weights(bundled_model, 0)


def train(out: Path, url: str, *overrides: str, example: str | None = None, prompts: int = 4,
          timeout: float = 900, every_step_updates: bool = True, env: dict[str, str] | None = None
          ) -> dict[int, dict]:
    """Run the trainer (or ``examples/<example>.py``) for 2 steps on the shared server; returns the per-step metrics
    after checking that both steps (or one, without ``every_step_updates``) made an update that reached the
    exported weights."""
    command = [str(REPO / "examples" / f"{example}.py")] if example else ["-m", "trainer"]
    result = subprocess.run([sys.executable, *command, f"inference.url={url}", f"trainer.output_dir={out}", *SMALL,
                             f"generator.prompts_per_step={prompts}", *overrides],
                            capture_output=True, text=True, cwd=out.parent, timeout=timeout,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "reward/mean" in r}
    assert sorted(steps) == [1, 2]
    updated = [step for step, m in steps.items() if "train/skipped_update" not in m and m["rollout/trained"] > 0]
    assert updated == [1, 2] if every_step_updates else updated, steps
    failures = [line for line in result.stderr.splitlines() if "rollouts failed" in line]
    assert all(m["rollout/failed"] == 0 for m in steps.values()), (failures, steps)
    assert changed_tensors(out / "weights" / "v2", _bundled()) > 0
    assert nonfinite_tensors(out / "weights" / "v2") == []  # moved, but not to NaN
    return steps


def _task_ids_by_version(out: Path) -> tuple[set[str], set[str]]:
    """Task ids of the last step's rollouts (policy v1) and of the final evaluation's (v2)."""
    trajs = [json.loads(line) for line in (out / "final_trajectories.jsonl").read_text().splitlines()]
    return ({t["task_id"] for t in trajs if t["policy_version"] == 1},
            {t["task_id"] for t in trajs if t["policy_version"] == 2})


def _bundled() -> Path:
    from generators.models import bundled_model_dir

    return bundled_model_dir()


def test_trains_on_an_env_served_over_websocket(policy_url, tmp_path):
    steps = train(tmp_path / "run", policy_url, "+env.kwargs.num_train=40", "+env.kwargs.num_test=7",
                  example="train_remote")
    assert all(m["stop/done"] == 32 for m in steps.values())
    # the server's task lists were drawn from, those of the env made with env.kwargs as its sessions are (not the
    # served default's 10000 and 19): its train split for training, its test split for evaluation
    last, held_out = _task_ids_by_version(tmp_path / "run")
    assert last and last <= {f"train-1-{i}" for i in range(40)}
    assert held_out and held_out <= {f"test-1-{i}" for i in range(7)}


async def test_an_env_over_websocket_yields_the_trajectories_it_yields_in_process(bundled_model, chat_tokenizer):
    """Where an env runs must not change what the trainer learns from: the same seeded rollouts of multi-turn
    arithmetic (in-process HF engine, reproducible per request) give identical token ids, masks, logprobs, per-turn
    rewards and messages in-process and through `envkit serve` over ws://."""
    import envkit
    from generators import Generator, GeneratorConfig
    from generators.engines.hf import HFEngine

    server = envkit_serve("arithmetic")
    try:
        tasks = list(envkit.make("arithmetic").tasks("train"))[:4]
        async with HFEngine(bundled_model) as engine:
            generator = Generator(engine, chat_tokenizer,
                                  GeneratorConfig(samples_per_prompt=2, seed=3, max_turns=3, max_tokens=24))
            runs = [await generator.generate(lambda name=name: envkit.make(name, followups=1), tasks=tasks)
                    for name in ("arithmetic", f"ws://127.0.0.1:{server.port}/arithmetic")]
    finally:
        server.stop()
    fields = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "reward", "step_rewards", "num_turns",
              "stop_reason", "messages")
    local, remote = ([{f: getattr(t, f) for f in fields} for t in run] for run in runs)
    assert all(t["stop_reason"] == "done" and t["num_turns"] == 2 for t in local), local
    assert len({t["reward"] for t in local}) > 1  # graded episodes, not all alike
    assert remote == local


def test_trains_on_a_docker_sandboxed_env_through_a_pool(policy_url, arithmetic_image, docker_client, tmp_path):
    from sandboxes.docker import SANDBOX_LABEL

    def sandboxes() -> set[str]:
        return {c.id for c in docker_client.containers.list(all=True, sparse=True, filters={"label": SANDBOX_LABEL})}

    before, since = sandboxes(), int(time.time())
    train(tmp_path / "run", policy_url, "env.pool_size=2", example="train_sandboxed")
    created = {e["id"] for e in docker_client.events(since=since, until=int(time.time()) + 1, decode=True,
                                                     filters={"type": "container", "event": "create",
                                                              "label": SANDBOX_LABEL})}
    assert created, "the run started no sandbox container"
    assert sandboxes() <= before  # the pool was drained at the end of the run


def test_trains_on_an_openenv_server(policy_url, tmp_path):
    with openenv_server() as server:
        steps = train(tmp_path, policy_url, f"env.name=openenv:{server.url}", "generator.max_turns=2", prompts=2)
    assert all(m["rollout/turns"] == 2 for m in steps.values())  # echo never ends before "bye": 2 turns each


def test_trains_on_a_gym_env_drawn_by_seed(policy_url, tmp_path):
    # A step updates only if some rollout's reward differs from -0.3 (three turns without a valid action). With
    # 16 tokens a turn, 18 of 128 rollouts of the bundled model did (`envkit eval`, 3 turns, temperature 1): all 32
    # of a step flat is a 0.8% event, so one of the two steps must update (both flat: 6e-5). 32 tokens made both
    # steps update (38 of 128 differ: (1 - 0.3)^32 ~ 1e-5) and the test 300 s long (a step generated in 61 s).
    train(tmp_path, policy_url, "env.name=gym:Blackjack-v1", "generator.max_turns=3", prompts=4,
          every_step_updates=False)
    state = json.loads((tmp_path / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["data"] == {"Blackjack-v1": {"epoch": 0, "pos": 8, "drawn": 8}}  # seeds 0..7, in order


def test_trains_on_dataset_rows(policy_url, tmp_path):
    train(tmp_path / "run", policy_url, example="train_dataset")
    assert (tmp_path / "word_problems.jsonl").is_file()
    # the last step's rollouts (sampled by policy v1) are on training rows, the evaluation after it (v2) on 4 of
    # the 16 held-out rows: never the same ones
    last, held_out = _task_ids_by_version(tmp_path / "run")
    assert len(held_out) == 4 and last and not last & held_out
    assert all(i.startswith("word_problems-") for i in last | held_out)


def test_trains_on_a_two_env_mixture_with_per_env_metrics(policy_url, tmp_path):
    steps = train(tmp_path / "run", policy_url, example="train_mixture")
    for m in steps.values():  # weights 3:1 of 4 prompts x 8 samples
        assert (m["env/sums/rollouts"], m["env/two_digit/rollouts"]) == (24, 8)
        assert 0 <= m["env/sums/reward/mean"] <= 1 and m["env/sums/stop/done"] == 24
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "state.json").read_text())
    assert {k: v["drawn"] for k, v in state["data"].items()} == {"sums": 6, "two_digit": 2}
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/sums/accuracy" in r and "eval/two_digit/accuracy" in r for r in evals)


def test_trains_on_a_multi_turn_env(policy_url, tmp_path):
    steps = train(tmp_path / "run", policy_url, example="train_multiturn", prompts=2)
    assert sum(m["rollout/turns"] for m in steps.values()) / 2 > 1.5


def test_trains_on_other_ecosystems_envs_by_name(policy_url, tmp_path):
    """A reasoning-gym dataset, a skyrl-gym env and two textarena games, named on the command line as any env is, in
    one mixture: each samples and scores its rollouts, and the policy updates. Tic Tac Toe is self-play: the
    opponent, in the first seat, is the policy, through the server the trainer publishes. reasoning-gym's one-digit
    sums carry the update: the bundled model gets 22% right (72 rollouts of 32 tokens), so 2 groups of 8 are all
    equal in a step with p ~ 0.02, and in both steps with p ~ 4e-4, before GuessTheNumber's partial credit varies
    too. (It counted leg_counting's legs right 1 time in 32, and wrote skyrl's '#### N' 3 times in 32.)"""
    for split, firsts in (("train", range(1, 6)), ("test", range(6, 8))):  # skyrl-gym's row format, its ground
        (tmp_path / f"{split}.jsonl").write_text("".join(  # truth a number, as datasets hold it
            json.dumps({"id": f"sum-{a}-{b}", "reward_spec": {"ground_truth": a + b},
                        "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer as #### N."}]}) + "\n"
            for a in firsts for b in range(1, 4)))
    mixture = ("env.mixture=[{name: 'reasoning_gym:basic_arithmetic', label: rg, weight: 2, kwargs: {num_train: 40, "
               "num_test: 8, answer: last_number, system_prompt: 'Answer with the number.', config: {min_terms: 2, "
               "max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+'], allow_negation: false, "
               "allow_parentheses: false}}}, "
               f"{{name: 'skyrl:gsm8k', label: sums, kwargs: {{tasks: '{tmp_path / 'train.jsonl'}', "
               f"test_tasks: '{tmp_path / 'test.jsonl'}'}}}}, "
               "{name: 'textarena:GuessTheNumber-v0', label: ta, kwargs: {max_turns: 2}}, "
               "{name: 'textarena:TicTacToe-v0', label: ttt, kwargs: {opponent: {max_tokens: 32}, seat: 1}}]")
    # A whole Tic Tac Toe game fits: as player 1 the policy moves at most 4 times, each after at most one reply the
    # game rejects, so 8 turns; such a game measured 1337 tokens with 22-token replies (the defaults, 4 turns and
    # 1024 tokens, cut off a game the policy played well, and it ended on max_turns, not done)
    steps = train(tmp_path / "run", policy_url, mixture, "generator.max_tokens=32", "trainer.eval_tasks=2",
                  "generator.max_turns=8", "generator.max_total_tokens=2048", prompts=5, every_step_updates=False)
    labels = ("rg", "sums", "ta", "ttt")
    for m in steps.values():
        assert [m[f"env/{label}/rollouts"] for label in labels] == [16, 8, 8, 8]
        assert [m[f"env/{label}/stop/done"] for label in labels] == [16, 8, 8, 8]
        assert all(0 <= m[f"env/{label}/reward/mean"] <= 1 for label in ("rg", "sums", "ta"))
        assert -1 <= m["env/ttt/reward/mean"] <= 1
    trajs = [json.loads(line) for line in (tmp_path / "run" / "final_trajectories.jsonl").read_text().splitlines()]
    game = [t["num_turns"] for t in trajs if t["env_name"] == "ta"]
    assert game and max(game) <= 4  # "within 2 turns": 2 moves, each after at most one reply the game rejected
    # as player 1, the policy first sees what its opponent, the policy on the same server, did
    seen = [t["messages"][0]["content"] for t in trajs if t["env_name"] == "ttt"]
    assert seen and all("You are Player 1" in s for s in seen)
    assert all("Player 0 placed their symbol" in s or "The game ended before your move" in s for s in seen)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(all(f"eval/{label}/accuracy" in r for label in labels) for r in evals)


def _skyrl_sums(out: Path) -> list[str]:
    """skyrl-gym rows (ground truth a number), train and test, whose prompt shows the '#### N' answer format twice:
    the bundled model then writes it. It is right on a sum far more often when the sum is 5 (63-88% of 32 samples at
    temperature 1) than otherwise (0-38%; 0 on 1 + 2, 2 + 2, 3 + 1), so the train rows are the sums it gets right
    25-80% of the time: a group of 8 then scores all alike with p < 0.14."""
    shots = [m for q, a in (("1 + 2", 3), ("2 + 2", 4)) for m in ({"role": "user", "content": f"What is {q}?"},
                                                                 {"role": "assistant", "content": f"#### {a}"})]
    train = [(1, 1), (1, 4), (2, 3), (3, 2), (4, 2), (4, 4), (5, 1), (5, 4), (6, 2)]
    for split, sums in (("tasks", train), ("test_tasks", [(6, 3), (7, 2)])):
        (out / f"{split}.jsonl").write_text("".join(json.dumps({
            "id": f"sum-{a}-{b}", "reward_spec": {"ground_truth": a + b},
            "prompt": [{"role": "system", "content": "Answer with #### and the number."}, *shots,
                       {"role": "user", "content": f"What is {a} + {b}?"}]}) + "\n"
            for a, b in sums))
    return [f"+env.kwargs.{split}={out / split}.jsonl" for split in ("tasks", "test_tasks")]


# Each ecosystem's env alone, named on the command line, with what varies its reward within a group (an update needs
# that): GuessTheNumber's partial credit; one-digit sums, 22% right (leg_counting, 2% right even for one animal and
# a table of legs in the prompt, would leave most steps without an update); the few-shot '#### N' rows (25-80%); and
# sophistry-bench-sprint's claims aggregate plus its rubric's 200-400 character band (the aggregate alone gives every
# reply without <claim> tags 0.5; the band needs a reply that ends by itself, within max_tokens). All but the game
# take 4 groups a step: 2 are both all-equal with p ~ 0.02 (a 2-group step of '#### N' rows once scored 0 on all 16
# rollouts and made no update; so did one of sophistry's, whose passages some make every reply run to max_tokens).
ECOSYSTEMS = {
    "textarena": ["env.name=textarena:GuessTheNumber-v0", "+env.kwargs.max_turns=2", "generator.max_turns=4"],
    "reasoning_gym": ["env.name=reasoning_gym:basic_arithmetic", "+env.kwargs.num_train=40", "+env.kwargs.num_test=8",
                      "+env.kwargs.answer=last_number", "+env.kwargs.system_prompt='Answer with the number.'",
                      "+env.kwargs.config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+'], "
                      "allow_negation: false, allow_parentheses: false}"],
    "skyrl": ["env.name=skyrl:gsm8k"],
    "verifiers": ["env.name=verifiers:sophistry_bench_sprint", "generator.max_tokens=96",
                  "+env.kwargs.env_args={n_items: 10, passage_chars: 300, weights: [1, 0, 0, 0, 0, 0, 1, 0]}"],
}


@pytest.mark.parametrize("ecosystem", sorted(ECOSYSTEMS))
def test_trains_on_each_ecosystems_env_alone(policy_url, tmp_path, ecosystem):
    """`python -m trainer env.name=<scheme>:<id>` for a textarena game, a reasoning-gym dataset, a skyrl-gym env and a
    verifiers package from PyPI (its own rollout loop through the capture gateway): 2 steps, each a real update."""
    overrides = list(ECOSYSTEMS[ecosystem])
    if ecosystem == "skyrl":
        overrides += _skyrl_sums(tmp_path)
    prompts = 2 if ecosystem == "textarena" else 4
    steps = train(tmp_path / "run", policy_url, *overrides, "trainer.eval_tasks=2", prompts=prompts)
    assert all(m["stop/done"] + m.get("stop/max_turns", 0) == 8 * prompts for m in steps.values()), steps
    trajs = [json.loads(line) for line in (tmp_path / "run" / "final_trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["loss_mask"].count(1) > 0 for t in trajs)


def test_trains_on_groups_that_branch_from_one_mid_episode_state(policy_url, tmp_path):
    """`generator.branch_at=1` on guess-number: each group's first rollout plays the first guess once and snapshots
    its env, the group's other rollouts go on from there in restored envs; both steps train on what they did after
    it (the shared turn is masked out). The rewards of a group differ by its later replies: a guess, or a reply
    without a number (-0.1). The secret is drawn from 1..10^6 so that no trunk finds it with its first guess (a
    trunk that did would end at turn 1, and its group would branch at turn 0: CI saw one with 1..100)."""
    steps = train(tmp_path / "run", policy_url, "env.name=guess-number", "+env.kwargs.high=1000000",
                  "generator.branch_at=1", "generator.max_turns=3", "generator.max_tokens=12", prompts=4)
    assert all(m["rollout/branch_turn"] == 1 and m["rollout/failed"] == 0 for m in steps.values()), steps
    trajs = [json.loads(line) for line in (tmp_path / "run" / "final_trajectories.jsonl").read_text().splitlines()]
    groups: dict[str, list[dict]] = {}
    for t in trajs:
        groups.setdefault(t["group_id"], []).append(t)
    trained = [g for g in groups.values() if len(g) == 8]  # the held-out evaluation's pairs play their own episodes
    assert len(trained) == 4 and all(t["branch_turn"] is None for g in groups.values() if len(g) == 2 for t in g)
    for group in trained:
        assert len({json.dumps(t["messages"][:4]) for t in group}) == 1  # the opening, turn 1 and the env's reply
        assert all(t["branch_turn"] == 1 and t["loss_mask"].count(1) > 0 for t in group)


def test_trains_on_a_judges_score_from_a_judge_server_the_run_starts(policy_url, tmp_path):
    """examples/train_judged.py: ``judge.model=bundled`` starts a vLLM judge beside the policy's server and publishes
    it; the env's LLM judge, made with no endpoint, scores every rollout through it (its expected digit: graded, where
    a reward of the env's own would be 0 or 1), and both steps update on those scores."""
    out = tmp_path / "run"
    steps = train(out, policy_url, example="train_judged", prompts=2)
    for m in steps.values():
        assert m["reward/mean"] == pytest.approx(m["rubric/polite"]) and 0 < m["rubric/polite"] < 1, m
        assert m["reward/mean"] not in (0.0, 0.5, 1.0) and "rubric/length_corr" in m and "rubric/env" in m
    assert (out / "judge" / "vllm.log").stat().st_size > 0


def test_trains_on_a_reward_models_and_a_relative_judges_scores(policy_url, tmp_path):
    """The bundled reward head as a rubric part beside the env's own grade, and a relative judge scoring each group
    in one call (``generator.group_rubric``) on the run's judge, here an external one (``judge.engine=openai``: the
    policy's own server): each rollout's reward is half the judge's score and half the env's, and both steps update
    on it."""
    steps = train(tmp_path / "run", policy_url, "+env.kwargs.rubric=rubric_parts:graded",
                  "generator.group_rubric=rubric_parts:relative", "judge.engine=openai",
                  f"judge.url={policy_url}/v1", "judge.model=policy", prompts=2,
                  env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    for m in steps.values():
        assert 0 < m["rubric/reward_model"] < 1 and 0 <= m["rubric/relative_judge"] <= 1, m
        assert m["reward/mean"] == pytest.approx(0.5 * m["rubric/relative_judge"] + 0.5 * m["rubric/weighted_sum"])


@pytest.mark.parametrize(("name", "prompts"), [("sums", 4), ("docker_sums", 2)])
def test_trains_on_an_agent_that_runs_its_own_loop(policy_url, tmp_path, name, prompts):
    """An AgentEnv named by entry point (tests/agent_envs.py): an openai-SDK tool loop of its own, or a program in a
    Docker container that reaches only its gateway; two calls an episode, each through the capture gateway; its
    rollouts train as any env's."""
    steps = train(tmp_path / "run", policy_url, f"env.name=agent_envs:{name}", "generator.max_tokens=24",
                  prompts=prompts,
                  env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    for m in steps.values():
        assert m["rollout/turns"] == 2 and m["stop/done"] == 8 * prompts
    trajs = [json.loads(line) for line in (tmp_path / "run" / "final_trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["segments"] == [] and t["template_mismatches"] <= 1 for t in trajs)  # 1 linked call
    assert all(t["loss_mask"].count(1) > 0 and t["loss_mask"].count(0) > 0 for t in trajs)  # tool output masked


# What each framework writes into its tool's schema (the request was the framework's own), and the prompts a step
# takes: the Agents SDK raises on a reply cut at max_tokens, which scores 0, so its runs take more groups, in which
# some rollouts score (a step whose groups all score alike makes no update).
FRAMEWORKS = {"openai_agents": ('"title": "add_args"', 4), "langgraph": ('"description": "Add two integers."', 2),
              "cli": ('"required": ["a", "b"], "properties"', 2)}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_trains_agents_built_with_third_party_frameworks(policy_url, tmp_path, framework):
    """The OpenAI Agents SDK over the Responses API (examples/train_agent_sdk.py, as the README runs it), LangGraph's
    ReAct agent (chat completions) and a command-line agent process (tests/cli_agent.py: an openai-SDK loop, a
    process per episode), unmodified from PyPI and named by entry point: two steps with real updates, every call
    through the capture gateway."""
    mark, prompts = FRAMEWORKS[framework]
    overrides = ["generator.max_tokens=24"] + ([] if framework == "openai_agents"
                                               else [f"env.name=agent_envs:{framework}_sums"])
    steps = train(tmp_path / "run", policy_url, *overrides, prompts=prompts,
                  example="train_agent_sdk" if framework == "openai_agents" else None,
                  env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    assert all(m.get("stop/done", 0) + m.get("stop/max_tokens", 0) + m.get("stop/max_turns", 0) == 8 * prompts
               for m in steps.values()), steps
    trajs = [json.loads(line) for line in (tmp_path / "run" / "final_trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["num_turns"] >= 1 and t["loss_mask"].count(1) > 0 for t in trajs)
    assert all(mark in t["messages"][0]["content"] for t in trajs)


# ---- the trainer's other modes on vLLM (their exact-reproduction tests use the seeded HF engine) -------------------


def test_async_mode_on_vllm_trains_one_version_behind_and_counts_it(policy_url, tmp_path):
    """max_staleness=1: step 1 trains groups sampled by the initial policy; the groups drawn beside them (also
    version 0, all in flight at once) are trained by step 2, one version behind, and counted as such."""
    steps = train(tmp_path / "run", policy_url, "trainer.mode=async", "trainer.max_staleness=1")
    assert [steps[s]["rollout/staleness"] for s in (1, 2)] == [0, 1], steps
    assert all(m["rollout/stale_dropped"] == 0 and m["stop/done"] == 32 for m in steps.values()), steps


def test_lora_on_vllm_trains_and_resumes_at_the_next_step(policy_url, tmp_path):
    """LoRA adapters merged into the weights the server samples with; a second run resumes from the step-2
    checkpoint and trains step 3 only."""
    out = tmp_path / "run"
    train(out, policy_url, "model.lora.r=8", "trainer.lr=1e-4", "trainer.save_every=1")
    overrides = [o for o in SMALL if not o.startswith("trainer.steps=")]
    result = subprocess.run([sys.executable, "-m", "trainer", f"inference.url={policy_url}",
                             f"trainer.output_dir={out}", *overrides, "generator.prompts_per_step=4",
                             "model.lora.r=8", "trainer.lr=1e-4", "trainer.steps=3", "trainer.resume=latest"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # steps 1 and 2 were not trained again
    assert changed_tensors(out / "weights" / "v3", out / "weights" / "v2") > 0
    assert nonfinite_tensors(out / "weights" / "v3") == []
