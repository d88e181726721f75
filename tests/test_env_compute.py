"""The compute env's tasks and grading (no sandbox needed): answers that are right, splits that never overlap."""

from __future__ import annotations

from envkit_compute.env import _KINDS, ComputeEnv

import envkit


def test_every_kind_of_question_has_the_known_answer() -> None:
    known = {"prime_sum": ((100,), 1060), "prime_count": ((1000,), 168), "divisors": ((720720,), 240),
             "fibonacci": ((10, 1000), 55), "digit_sum": ((15,), 26), "collatz": ((27,), 111),
             "multiples": ((100, 6, 33), 16 + 3 - 1)}  # lcm(6, 33) = 66, not 6 * 33
    assert set(known) == set(_KINDS)
    for name, (args, answer) in known.items():
        assert _KINDS[name].answer(*args) == answer, name


def test_splits_are_disjoint_and_reproducible() -> None:
    env = ComputeEnv(num_train=300, num_test=100)
    train = {t["question"] for t in env.tasks("train")}
    test = {t["question"] for t in env.tasks("test")}
    assert len(train) == 300 and len(test) == 100 and not train & test
    assert [t["question"] for t in ComputeEnv(num_test=100).tasks("test")] == [t["question"] for t in env.tasks("test")]


async def test_the_final_number_is_graded_and_ends_the_episode() -> None:
    env = envkit.make("compute")
    messages, _ = await env.reset(task={"question": "What is 6 * 7?", "answer": 42})
    assert [m["role"] for m in messages] == ["system", "user"] and "python" in messages[0]["content"]
    assert sorted(t.name for t in env.tools) == ["bash", "python"]
    result = await env.step(envkit.assistant("I computed it. The answer is 42."))
    assert (result.reward, result.terminated) == (1.0, True)
    await env.reset(task={"question": "What is 6 * 7?", "answer": 42})
    assert (await env.step(envkit.assistant("The answer is 41."))).reward == 0.0
    await env.close()
