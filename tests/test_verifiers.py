"""verifiers:ENV_ID: verifiers environment packages (the classic API, in the venv `make install` builds for them) as
envkit envs. Their datasets become disjoint task splits; their own rollout loops (single-turn, multi-turn, tools) play
through the capture gateway against the session's vLLM server, and their rubrics score the episodes.

``sophistry_bench_sprint`` is a package from PyPI; ``vf_sums`` (tests/verifiers_envs) is a small multi-turn and tool
env of the same API, loaded from PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import psutil
import pytest

import envkit
from envkit.errors import EnvLoadError
from envkit.integrations.verifiers import DRIVER
from generators.rollout import Generator, GeneratorConfig

pytestmark = pytest.mark.verifiers

VF_ENVS = Path(__file__).parent / "verifiers_envs"
SOPHISTRY = {"n_items": 5, "passage_chars": 200}


@pytest.fixture(autouse=True)
def vf_envs_on_path(monkeypatch):
    """The driver processes started in these tests find tests/verifiers_envs (they inherit PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(VF_ENVS), os.environ.get("PYTHONPATH")])))


def test_a_packages_dataset_is_the_train_split_and_its_eval_dataset_the_test_split():
    with_eval = envkit.make("verifiers:vf_sums")
    train, test = with_eval.tasks("train"), with_eval.tasks("test")
    assert len(train) == 12 and [t["answer"] for t in test] == ["10", "7", "9", "9"]
    assert test[0]["prompt"] == [{"role": "user", "content": "What is 5 + 5?"}]
    assert not {t["id"] for t in train} & {t["id"] for t in test}


def test_without_an_eval_dataset_the_last_rows_are_held_out_of_training():
    """sophistry-bench-sprint has no eval dataset: its 10 rows (2 per item) split 8/2, never the same prompt."""
    env = envkit.make("verifiers:sophistry_bench_sprint", env_args=SOPHISTRY)
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (8, 2)
    assert [t["example_id"] for t in test] == [8, 9]
    assert not {json.dumps(t["prompt"]) for t in train} & {json.dumps(t["prompt"]) for t in test}
    everything = envkit.make("verifiers:sophistry_bench_sprint", env_args=SOPHISTRY, holdout=0)
    assert len(everything.tasks("train")) == 10 and everything.tasks("test") == []


def test_an_env_that_cannot_load_says_why():
    with pytest.raises(EnvLoadError, match="does not exist"):
        envkit.make("verifiers:vf_sums", python="/nonexistent/bin/python")
    with pytest.raises(EnvLoadError, match="no_such_env"):
        envkit.make("verifiers:no_such_env").tasks("train")
    with pytest.raises(EnvLoadError, match="bogus"):  # load_environment's own complaint
        envkit.make("verifiers:vf_sums", env_args={"bogus": 1}).tasks("train")
    with pytest.raises(EnvLoadError, match="holdout"):
        envkit.make("verifiers:vf_sums", holdout=1.5)


async def test_an_env_that_cannot_load_fails_its_first_episode_with_why():
    """In an event loop (a generator, an env worker) the tasks come from the episodes' own driver process."""
    with pytest.raises(EnvLoadError, match="no_such_env"):
        await envkit.make("verifiers:no_such_env").init()
    with pytest.raises(EnvLoadError, match="bogus"):
        await envkit.make("verifiers:vf_sums", env_args={"bogus": 1}).init()
    env = envkit.make("verifiers:vf_sums", env_args={"tools": False})  # a spec not listed yet in this process
    await env.init()
    assert len(env.tasks("train")) == 12


async def test_a_server_session_cannot_choose_the_program_the_env_runs():
    """``python=`` names the program a verifiers env starts: over `envkit serve` a session naming one ('/bin/sh')
    is refused; the operator sets it (envkit serve --kwargs)."""
    from envkit.remote.protocol import ApiError
    from envkit.remote.server.sessions import EnvServer

    server = EnvServer("verifiers:vf_sums", env_kwargs={})
    with pytest.raises(ApiError, match="python cannot be set by a session"):
        await server.create({"python": "/bin/sh"})
    created = await server.create({"env_args": {"tools": True}})
    assert (await server.reset(created["session_id"], 1, None))["observation"][0]["role"] == "user"
    await server.delete(created["session_id"])


def generator(vllm_engine, chat_tokenizer, **config) -> Generator:
    return Generator(vllm_engine, chat_tokenizer, GeneratorConfig(**{"max_tokens": 24, "max_turns": 4, **config}))


async def test_a_multi_turn_env_plays_its_own_loop_and_its_rubric_scores_it(vllm_engine, chat_tokenizer):
    """vf_sums asks again after the first reply: two model turns a rollout, the env's message between them as
    observation tokens, and the reward the rubric gave the last reply (1 when it holds the sum)."""
    env = envkit.make("verifiers:vf_sums")
    tasks = env.tasks("test")[:2]
    trajs = await generator(vllm_engine, chat_tokenizer, samples_per_prompt=4).generate(
        lambda: envkit.make("verifiers:vf_sums"), tasks=tasks)
    assert [t.stop_reason for t in trajs] == ["done"] * 8, [t.error for t in trajs]
    answers = {t["id"]: t["answer"] for t in tasks}
    for t in trajs:
        assert t.num_turns == 2 and t.loss_mask.count(0) > 0 and t.loss_mask.count(1) > 0
        assert {"role": "user", "content": "Say only the number."} in t.messages
        last = [m for m in t.messages if m["role"] == "assistant"][-1]
        assert t.reward == float(answers[t.task_id] in (last.get("content") or ""))


async def test_a_tool_envs_tools_reach_the_model(vllm_engine, chat_tokenizer):
    """vf_sums with tools=True is a vf.ToolEnv: its ``add`` function goes to the gateway as an OpenAI tool, which the
    bundled model's prompt then describes."""
    tasks = envkit.make("verifiers:vf_sums", env_args={"tools": True}).tasks("test")[:1]
    trajs = await generator(vllm_engine, chat_tokenizer, samples_per_prompt=2).generate(
        lambda: envkit.make("verifiers:vf_sums", env_args={"tools": True}), tasks=tasks)
    assert [t.stop_reason for t in trajs] == ["done"] * 2, [t.error for t in trajs]
    assert all('"name": "add"' in t.messages[0]["content"] and "Add two integers." in t.messages[0]["content"]
               for t in trajs)


async def test_a_driver_that_dies_fails_its_rollouts_alone_and_the_next_ones_start_a_new_one(vllm_engine,
                                                                                              chat_tokenizer,
                                                                                              monkeypatch):
    tasks = envkit.make("verifiers:vf_sums").tasks("test")[:1]
    gen = generator(vllm_engine, chat_tokenizer, samples_per_prompt=4)

    def drivers() -> list[psutil.Process]:  # vf_sums without env args (the other tests' drivers may live on)
        return [p for p in psutil.Process().children(recursive=True)
                if p.cmdline()[-4:-1] == [str(DRIVER), "vf_sums", "{}"]]

    await gen.generate(lambda: envkit.make("verifiers:vf_sums"), tasks=tasks)
    first = drivers()
    assert len(first) == 1

    # kill the driver while a batch's episodes are in flight (its first model call is waiting on the engine):
    # those fail with its exit status, none hangs
    sample = vllm_engine.generate

    async def kill_then_sample(*args, **kwargs):
        if first[0].is_running():
            first[0].kill()
            await asyncio.to_thread(first[0].wait, 30)
        return await sample(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(vllm_engine, "generate", kill_then_sample)
        trajs = await gen.generate(lambda: envkit.make("verifiers:vf_sums"), tasks=tasks)
    assert not first[0].is_running()
    failed = [t for t in trajs if t.stop_reason == "error"]
    assert failed and all("verifiers driver exited" in (t.error or "") for t in failed), [t.error for t in trajs]
    again = await gen.generate(lambda: envkit.make("verifiers:vf_sums"), tasks=tasks)
    assert [t.stop_reason for t in again] == ["done"] * 4, [t.error for t in again]
    # they started one driver, which lives on for the next batches: not none, not the dead one (a Process compares
    # by pid and start time, so a new process given the old pid is not taken for it)
    replaced = drivers()
    assert len(replaced) == 1 and replaced[0] != first[0] and replaced[0].is_running(), (first, replaced)
