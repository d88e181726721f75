"""Task sources and mixtures (trainer/sources.py): env task lists (in-process, served, sandboxed), seed ranges,
dataset rows, exact per-step quotas, and data positions that resume exactly."""

from __future__ import annotations

import json
import re

import psutil
import pytest
from remote_envs import envkit_serve

import envkit
from sandboxes.tools import close_code_pools
from trainer import compose
from trainer.config import ConfigError
from trainer.sources import EnvStream, Mixture, SeedStarts, TaskStarts


def _mixture(*overrides: str) -> Mixture:
    return Mixture(compose(overrides).env, seed=0)


async def test_quotas_keep_every_env_within_one_prompt_of_its_share():
    mixture = _mixture("env.mixture=[{name: arithmetic, label: a, weight: 2}, {name: arithmetic, label: b}]")
    await mixture.open(pool_size=1)
    seen = []
    for _ in range(6):
        quotas = mixture.quotas(2)
        seen.append(quotas)
        for stream, k in zip(mixture.streams, quotas, strict=True):
            stream.next_starts(k)
        drawn = [s.drawn for s in mixture.streams]
        assert abs(drawn[0] - 2 * sum(drawn) / 3) < 1 and sum(drawn) % 2 == 0
    assert seen[:3] == [[1, 1], [2, 0], [1, 1]]
    three_one = _mixture("env.mixture=[{name: arithmetic, label: a, weight: 3}, {name: arithmetic, label: b}]")
    assert three_one.quotas(4) == [3, 1]


async def test_a_stream_resumed_from_its_state_draws_what_the_original_draws_next():
    original = _mixture("env.tasks.shuffle=true")
    await original.open(pool_size=1)
    stream = original.streams[0]
    for _ in range(20):  # 80 tasks in level 1's train split: this crosses epochs
        stream.next_starts(8)
    state = original.state()
    resumed = _mixture()
    await resumed.open(pool_size=1)
    resumed.load_state(json.loads(json.dumps(state)))  # as it comes back from state.json
    assert resumed.streams[0].next_starts(8) == stream.next_starts(8)
    assert state["arithmetic"]["epoch"] >= 1
    with pytest.raises(ConfigError, match="resume with the same env config"):
        resumed.load_state({"other": state["arithmetic"]})


async def test_envs_without_task_lists_draw_disjoint_train_and_eval_seeds():
    stream = _mixture("env.name=gym:Blackjack-v1", "env.tasks.train_seeds=[10,20]",
                      "env.tasks.eval_seeds=[20,25]").streams[0]
    await stream.open(pool_size=1)
    assert isinstance(stream.train, SeedStarts) and isinstance(stream.eval, SeedStarts)
    assert [s for _, s in stream.next_starts(12)] == [*range(10, 20), 10, 11]  # in order, then around
    assert [stream.eval[i][1] for i in range(len(stream.eval))] == [20, 21, 22, 23, 24]
    only_env = _mixture("env.name=gym:Blackjack-v1", "env.tasks.source=env").streams[0]
    with pytest.raises(ConfigError, match=r"does not list its tasks: use env\.tasks\.source=seeds"):
        await only_env.open(pool_size=1)


@pytest.mark.parametrize(("override", "message"), [
    ("env.tasks.eval_seeds=[500,2000000]", "overlap: the held-out evaluation must never see a training seed"),
    ("env.tasks.train_seeds=[5,5]", "must be [start, stop) with start < stop"),
    ("env.tasks.source=dataset", "needs env.tasks.dataset=PATH"),
    ("env.sandbox=podman", "env.sandbox='podman' is not one of: docker, local, auto"),
    ("env.mixture=[{name: arithmetic}, {name: arithmetic}]", "give each a distinct `label`"),
    ("inference.url=http://x", "inference.url attaches to a vLLM server"),
])
def test_bad_task_source_configs_fail_with_the_fix(override, message):
    overrides = [override, "inference.engine=hf"] if override.startswith("inference") else [override]
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(overrides)


async def test_dataset_rows_become_tasks_with_renamed_columns_and_a_fixed_held_out_split(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {i} + 1?", "a": i + 1, "source": "mine"}) + "\n"
                            for i in range(20)))
    overrides = ["env.tasks.source=dataset", f"env.tasks.dataset={data}", "env.tasks.eval_rows=5",
                 "+env.tasks.columns.question=q", "+env.tasks.columns.answer=a"]
    stream = _mixture(*overrides).streams[0]
    await stream.open(pool_size=1)
    assert isinstance(stream.train, TaskStarts) and (len(stream.train), len(stream.eval)) == (15, 5)
    train_ids = {stream.train[i][0]["id"] for i in range(15)}
    eval_ids = {stream.eval[i][0]["id"] for i in range(5)}
    assert not train_ids & eval_ids and len(train_ids | eval_ids) == 20
    task = stream.train[0][0]
    assert set(task) == {"id", "question", "answer", "source"} and task["id"].startswith("sums-")
    async with stream.make() as env:  # the env grades the renamed fields
        messages, _ = await env.reset(task=task)
        assert messages[-1]["content"] == task["question"]
        result = await env.step(envkit.assistant(f"The answer is {task['answer']}."))
        assert result.reward == 1.0
    again = _mixture(*overrides).streams[0]
    await again.open(pool_size=1)
    assert {again.eval[i][0]["id"] for i in range(5)} == eval_ids  # the same held-out rows every run

    bad = _mixture(*overrides[:3], "+env.tasks.columns.question=prompt").streams[0]
    with pytest.raises(ConfigError, match=r"names columns the dataset lacks: \['prompt'\]"):
        await bad.open(pool_size=1)


async def test_csv_files_and_saved_dataset_dicts_bring_their_splits(tmp_path):
    import datasets

    csv = tmp_path / "t.csv"
    csv.write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    stream = _mixture("env.tasks.source=dataset", f"env.tasks.dataset={csv}").streams[0]
    await stream.open(pool_size=1)
    assert [stream.train[i][0]["answer"] for i in range(2)] == [2, 4] and len(stream.eval) == 0

    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"question": "What is 3 + 3?", "answer": 6}] * 3),
        "test": datasets.Dataset.from_list([{"question": "What is 4 + 4?", "answer": 8}]),
    }).save_to_disk(str(saved))
    stream = _mixture("env.tasks.source=dataset", f"env.tasks.dataset={saved}").streams[0]
    await stream.open(pool_size=1)
    assert (len(stream.train), len(stream.eval)) == (3, 1) and stream.eval[0][0]["answer"] == 8


async def test_served_and_sandboxed_envs_list_the_tasks_of_the_env_inside():
    local = list(envkit.make("arithmetic", level=2).tasks("train"))
    with envkit_serve("arithmetic", "--kwargs", '{"level": 2}') as server:
        remote = envkit.make(f"ws://127.0.0.1:{server.port}/arithmetic")
        served = remote.tasks("train")
        assert len(served) == len(local) and list(served) == local  # several pages of 256
        with pytest.raises(ValueError, match="Unknown split 'dev'"):
            remote.tasks("dev")
    with envkit_serve("guess-number") as server:
        assert envkit.make(f"http://127.0.0.1:{server.port}/guess-number").tasks("train") is None

    stream = EnvStream(compose(["env.name=arithmetic", "env.sandbox=local", "env.pool_size=1"]).env, "arithmetic")
    await stream.open(pool_size=4)
    try:
        assert stream.pool is not None and stream.pool.size == 1
        assert [stream.train[i][0] for i in range(len(stream.train))] == list(envkit.make("arithmetic").tasks())
    finally:
        await stream.close()


@pytest.mark.parametrize("episodes_here", [True, False])
async def test_an_env_whose_episodes_run_here_starts_its_code_sandboxes_when_the_run_opens(episodes_here):
    """compute's python tool leases from a shared pool: the run's opening warms it (CodeSandboxEnv.warm) while the
    inference server starts, not at the first code call (a pool size of 0: the episodes run in env workers)."""
    def runners() -> list[psutil.Process]:
        return [p for p in psutil.Process().children(recursive=True)
                if "sandboxes.tools:Runner" in " ".join(p.cmdline())]

    stream = EnvStream(compose(["env.name=compute", "+env.kwargs.code_sandbox=local",
                                "+env.kwargs.pool_size=1"]).env, "compute")
    try:
        await stream.open(pool_size=4 if episodes_here else 0)
        assert len(stream.train) == 10_000
        assert len(runners()) == (1 if episodes_here else 0)
    finally:
        await close_code_pools()
    assert not runners()
