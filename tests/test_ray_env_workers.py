"""Env workers on a real local Ray cluster (tests/conftest.py) that reach the session's vLLM server: agent envs play
their episodes in the workers, the workers share one reward-model actor and see the run's judge, and an agent
process dies with its cancelled rollout."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


@pytest.mark.agent_frameworks  # agent_envs:where, an openai-SDK call
async def test_agent_envs_play_their_episodes_in_env_workers(cluster, vllm_engine, chat_tokenizer):
    """On env workers an agent env's agent runs, and is graded, in the worker (each episode's reward is the pid that
    played and graded it), and reaches the policy through the generator's gateway: its calls are captured."""
    from envkit.ref import EnvRef
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    pool = EnvWorkerPool(2, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(max_tokens=8, samples_per_prompt=2))
        trajs = await generator.generate(lambda: WorkerEnv(pool, EnvRef("agent_envs:where")),
                                         tasks=[{"id": "q", "question": "What is 2 + 3?"}] * 2)
        assert [t.stop_reason for t in trajs] == ["done"] * 4, [t.error for t in trajs]
        pids = {int(t.reward) for t in trajs}
        assert os.getpid() not in pids
        assert all(psutil.Process(pid).cmdline()[0].startswith("ray::EnvWorker") for pid in pids)
    finally:
        await pool.close()
    assert all(t.num_turns == 1 and sum(t.loss_mask) > 0 for t in trajs)


async def test_env_workers_share_one_reward_model_actor_and_see_the_runs_judge(cluster, vllm_engine, chat_tokenizer,
                                                                               monkeypatch):
    """A RewardModel in the rubric of envs on two env workers is one Ray actor: every episode's row goes to it, in
    batches the workers share. The judge the driver published reaches the envs in the workers."""
    import ray
    from rubric_parts import JUDGE_SEEN, REWARD_MODEL

    from envkit.ref import EnvRef
    from envkit.rewards.judges import JUDGE_URL_VAR
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    monkeypatch.setenv(JUDGE_URL_VAR, JUDGE_SEEN)
    pool = EnvWorkerPool(2, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(max_tokens=8, samples_per_prompt=4))
        ref = EnvRef("arithmetic", kwargs={"rubric": "rubric_parts:reward_model"})
        trajs = await generator.generate(lambda: WorkerEnv(pool, ref), tasks=[
            {"id": "a", "question": "What is 2 + 3?", "answer": 5}, {"id": "b", "question": "What is 4 + 4?",
                                                                     "answer": 8}])
        assert [t.stop_reason for t in trajs] == ["done"] * 8, [t.error for t in trajs]
        assert all(0 < t.scores["reward_model"] < 1 and t.scores["published"] == 1.0 for t in trajs)
        batches = await ray.get_actor(REWARD_MODEL.actor_name).batches.remote()
        assert sum(batches) == 8 and len(batches) < 8, batches  # every episode, in shared forward passes
    finally:
        await pool.close()


async def test_an_agent_process_in_an_env_worker_dies_with_its_cancelled_rollout(cluster, vllm_engine, chat_tokenizer):
    """A Command agent that hangs, in an env worker: the rollout times out, and the cancellation reaches the worker,
    which kills the agent's processes (the agent and the child it started)."""
    from agent_envs import watching

    from envkit.ref import EnvRef
    from generators.rollout import Generator, GeneratorConfig
    from trainer.placement.env_workers import EnvWorkerPool, WorkerEnv

    task_id = f"h{os.getpid()}"
    marker = f"envkit-hang-{task_id}"
    pool = EnvWorkerPool(1, {"CPU": 1}, sandbox_pool_size=0)
    try:
        generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(timeout_s=10))
        [t], seen = await watching([marker], generator.generate(lambda: WorkerEnv(pool, EnvRef("agent_envs:hang")),
                                                                tasks=[{"id": task_id, "question": "hang"}]))
        assert t.stop_reason == "timeout", t.error
        assert len(seen[marker]) == 2, seen  # the agent and its child ran
        # the cancellation crosses to the worker asynchronously: give it a moment
        _, alive = await asyncio.to_thread(psutil.wait_procs, seen[marker], timeout=30)
        assert alive == []
    finally:
        await pool.close()
