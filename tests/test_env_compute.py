"""The compute env's tasks and grading (no sandbox needed): answers that are right, splits that never overlap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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


def test_every_kind_has_a_program_that_prints_its_answer() -> None:
    tasks = ComputeEnv(num_train=200).tasks("train")
    for name in _KINDS:
        task = next(t for t in tasks if t["kind"] == name)
        code = _KINDS[name].program(*task["args"])
        out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == str(task["answer"]), (name, code, out.stderr)


async def test_a_demonstration_calls_python_then_answers_what_it_printed() -> None:
    env = envkit.make("compute")
    task = ComputeEnv().tasks("train")[0]
    with pytest.raises(envkit.errors.ResetNeededError):
        await env.demonstrate([])
    messages, _ = await env.reset(task=task)
    [call] = (await env.demonstrate(messages))["tool_calls"]
    assert call["function"]["name"] == "python"
    assert json.loads(call["function"]["arguments"])["code"] == _KINDS[task["kind"]].program(*task["args"])
    printed = [*messages, envkit.assistant(None, [call]), envkit.tool_result("1234", call["id"], "python")]
    assert (await env.demonstrate(printed))["content"] == "The answer is 1234."
    await env.reset(task={"question": "What is 6 * 7?", "answer": 42})  # not one of its own: nothing to show
    with pytest.raises(envkit.errors.InvalidTaskError, match="only the env's own tasks can be demonstrated"):
        await env.demonstrate([])
    await env.close()


async def test_allowed_tools_narrows_what_the_model_is_offered_and_may_call() -> None:
    env = envkit.make("compute", allowed_tools=["python"])
    assert [t.name for t in env.tools] == ["python"]
    await env.reset(task={"question": "What is 6 * 7?", "answer": 42})
    call = '<tool_call>{"name": "bash", "arguments": {"command": "echo 42"}}</tool_call>'
    result = await env.step(envkit.assistant(call))
    assert result.observation[0]["content"].startswith("Error: unknown tool 'bash'")
    assert result.info["tool_results"] == [{"name": "bash", "status": "error"}]
    await env.close()
    with pytest.raises(ValueError, match="allowed_tools must name some of"):
        ComputeEnv(allowed_tools=["perl"])
    assert ComputeEnv(code_sandbox="docker").code_sandbox == "docker" and ComputeEnv().code_sandbox == "auto"
    with pytest.raises(ValueError, match="code_sandbox must be docker, local or auto"):
        ComputeEnv(code_sandbox="vm")
