"""Behaviour of the calculator tool env (envs/calculator): the safe evaluator, tool calls, grading, turns."""

from __future__ import annotations

import json
import re

import pytest
from envkit_calculator import DEFAULT_SYSTEM_PROMPT, CalculatorEnv, evaluate

import envkit
from envkit.errors import EpisodeDoneError, ResetNeededError

TASK = {"id": "t", "question": "A shop sells 37 boxes of 24 pens and 158 pens are returned. How many?", "answer": 730}


def _text_call(expression: str) -> envkit.Message:
    payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return envkit.assistant(f"Let me compute.\n<tool_call>{payload}</tool_call>")


def _native_call(name: str, arguments: dict, call_id: str = "call_abc") -> envkit.Message:
    call: envkit.ToolCall = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return envkit.assistant(None, [call])


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*24-158", 730),
        ("-(2 + 3) * 4", -20),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("7 % 4", 3),
        ("2 ** 10", 1024),
        ("1.5 * 4", 6.0),
        (" ( 1 + 2 ) ", 3),
    ],
)
def test_evaluate_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponents above 100"),
        ("(10 ** 90) * (10 ** 90)", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("abs(-3)", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("1 +", "not a valid arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_evaluate_rejects_unsafe_or_broken_input(expression: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        evaluate(expression)


def test_tool_schema() -> None:
    env = envkit.make("calculator")
    assert [t.name for t in env.tools] == ["calculator"]
    schema = env.tools[0].to_openai()["function"]
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "<tool_call>" in DEFAULT_SYSTEM_PROMPT and "The answer is N." in DEFAULT_SYSTEM_PROMPT


async def test_seed_determinism_and_task_precedence() -> None:
    first, _ = await envkit.make("calculator").reset(seed=11)
    second, info = await CalculatorEnv().reset(seed=11)
    assert first == second
    assert info["task"] == CalculatorEnv().tasks("train")[11]
    messages, info = await CalculatorEnv().reset(seed=11, task=TASK)
    assert messages[1]["content"] == TASK["question"] and info["task"] is TASK


async def test_text_tool_call_then_answer() -> None:
    env = envkit.make("calculator")
    await env.reset(task=TASK)
    result = await env.step(_text_call("37*24-158"))
    assert not result.done and result.reward == 0.0
    assert result.observation == [{"role": "tool", "content": "730", "tool_call_id": "call_0", "name": "calculator"}]
    result = await env.step(envkit.assistant("So 730 pens were sold. The answer is 730."))
    assert result.terminated and result.reward == 1.0
    assert result.info["correct"] and result.info["turn"] == 2 and result.info["format"] == "answer_is"


async def test_native_tool_calls_keep_their_ids() -> None:
    env = envkit.make("calculator")
    await env.reset(task=TASK)
    calls = [
        *_native_call("calculator", {"expression": "37*24"}, "a")["tool_calls"],
        *_native_call("calculator", {"expression": "888-158"}, "b")["tool_calls"],
    ]
    result = await env.step(envkit.assistant(None, calls))
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in result.observation] == [
        ("tool", "a", "888"),
        ("tool", "b", "730"),
    ]
    assert result.info["tool_calls"] == 2


@pytest.mark.parametrize(
    ("action", "error"),
    [
        (
            _native_call("calculator", {"expression": "12 +* 3"}),
            "Error: '12 +* 3' is not a valid arithmetic expression",
        ),
        (_native_call("calculator", {"expression": "1/0"}), "Error: division by zero"),
        (_native_call("calculator", {}), "Error: missing required argument(s): expression"),
        (_native_call("calculator", {"expression": 5}), "Error: argument 'expression' must be of type string"),
        (_native_call("python", {"code": "1+1"}), "Error: unknown tool 'python'. Available: calculator."),
    ],
)
async def test_tool_errors_come_back_as_text(action: envkit.Message, error: str) -> None:
    env = envkit.make("calculator")
    await env.reset(task=TASK)
    result = await env.step(action)
    assert not result.done
    assert result.observation[0]["role"] == "tool"
    assert result.observation[0]["content"].startswith(error)


async def test_malformed_text_tool_call_gets_feedback() -> None:
    env = envkit.make("calculator")
    await env.reset(task=TASK)
    result = await env.step(envkit.assistant('<tool_call>{"name": "calculator", </tool_call>'))
    assert not result.done and result.info["tool_call_errors"] == 1
    assert result.observation[-1]["role"] == "user" and "Malformed tool call" in result.observation[-1]["content"]


@pytest.mark.parametrize(
    ("reply", "reward"),
    [("#### 730", 1.0), ("\\boxed{730}", 1.0), ("730", 1.0), ("The answer is 731.", 0.0), ("I cannot tell.", 0.0)],
)
async def test_final_answer_grading(reply: str, reward: float) -> None:
    env = envkit.make("calculator")
    await env.reset(task=TASK)
    result = await env.step(envkit.assistant(reply))
    assert result.terminated and result.reward == reward and result.info["expected"] == 730


@pytest.mark.parametrize("max_turns", [None, 2])
async def test_max_turns_truncates(max_turns: int | None) -> None:
    env = envkit.make("calculator", max_turns=max_turns)
    expected_turns = max_turns or 6
    assert env.max_turns == expected_turns
    await env.reset(task=TASK)
    for turn in range(1, expected_turns + 1):
        result = await env.step(_text_call("1+1"))
        assert result.truncated is (turn == expected_turns) and not result.terminated and result.reward == 0.0
    with pytest.raises(EpisodeDoneError):
        await env.step(envkit.assistant("The answer is 730."))


def test_invalid_kwargs() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        CalculatorEnv(max_turns=0)
    with pytest.raises(ValueError, match="num_train"):
        CalculatorEnv(num_train=0)
    with pytest.raises(ValueError, match="valid splits"):
        CalculatorEnv().tasks("dev")


async def test_answer_before_reset_raises() -> None:
    with pytest.raises(ResetNeededError):
        await CalculatorEnv().step(envkit.assistant("The answer is 3."))


def test_tasks_are_disjoint_unique_and_correct() -> None:
    env = CalculatorEnv(num_train=3000, num_test=300)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 3000 and len(test) == 300
    train_q, test_q = [t["question"] for t in train], [t["question"] for t in test]
    assert len(set(train_q)) == 3000 and len(set(test_q)) == 300
    assert not set(train_q) & set(test_q)
    assert {t["template"] for t in train} == {"pens", "orchard", "bus", "crates", "savings", "theater"}
    for task in [*train, *test]:
        assert isinstance(task["answer"], int) and task["answer"] >= 0
        if task["template"] == "pens":
            a, b, c = map(int, re.findall(r"\d+", task["question"]))
            assert task["answer"] == evaluate(f"{a}*{b}-{c}")
    assert list(CalculatorEnv(num_train=10).tasks("train")) == train[:10]
