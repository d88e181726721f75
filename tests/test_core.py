"""The Env contract: call order, validation both ways, the sync facade, tools and ToolEnv, answer parsing."""

from __future__ import annotations

import asyncio
import json

import pytest

import envkit
from envkit import ContractChecker, Env, StepResult, SyncEnv, Tool, ToolEnv, tool
from envkit.errors import (
    ContractError,
    EnvClosedError,
    EpisodeDoneError,
    InvalidActionError,
    InvalidStepResultError,
    ResetNeededError,
)


class CountdownEnv(Env):
    """Counts down from `start`; each step reward 1, terminates at zero."""

    def __init__(self, start: int = 2) -> None:
        self.start = start
        self.left = start
        self.init_calls = 0
        self.close_calls = 0

    async def init(self) -> None:
        self.init_calls += 1

    async def reset(self, *, seed=None, task=None):
        self.left = (task or {}).get("start", self.start if seed is None else seed % 5 + 1)
        return [envkit.user(f"{self.left} left")], {"start": self.left}

    async def step(self, action):
        self.left -= 1
        return StepResult([envkit.user(f"{self.left} left")], 1.0, terminated=self.left == 0)

    async def close(self) -> None:
        self.close_calls += 1


class BadEnv(Env):
    """Returns whatever `out` holds from reset/step, to exercise result validation."""

    def __init__(self, reset_out=None, step_out=None) -> None:
        self.reset_out, self.step_out = reset_out, step_out

    async def reset(self, *, seed=None, task=None):
        return self.reset_out

    async def step(self, action):
        return self.step_out


async def test_episode_runs_and_init_is_lazy_and_once():
    inner = CountdownEnv(start=2)
    env = ContractChecker(inner)
    messages, info = await env.reset()
    assert messages == [{"role": "user", "content": "2 left"}] and info == {"start": 2}
    r1 = await env.step(envkit.assistant("go"))
    r2 = await env.step(envkit.assistant("go"))
    assert (r1.terminated, r2.terminated) == (False, True) and r2.done
    await env.reset()
    assert inner.init_calls == 1


async def test_step_before_reset_after_done_and_after_close_raise_specific_errors():
    env = ContractChecker(CountdownEnv(start=1))
    with pytest.raises(ResetNeededError, match="before reset"):
        await env.step(envkit.assistant("x"))
    await env.reset()
    await env.step(envkit.assistant("x"))
    with pytest.raises(EpisodeDoneError, match="Call reset"):
        await env.step(envkit.assistant("x"))
    await env.close()
    with pytest.raises(EnvClosedError):
        await env.reset()
    with pytest.raises(EnvClosedError):
        await env.step(envkit.assistant("x"))


async def test_close_is_idempotent_and_async_context_manager_closes():
    inner = CountdownEnv()
    async with ContractChecker(inner) as env:
        await env.reset()
    await env.close()
    assert inner.close_calls == 1 and inner.init_calls == 1


@pytest.mark.parametrize(
    ("action", "match"),
    [
        ("just text", "assistant message dict"),
        ({"role": "user", "content": "hi"}, "role 'assistant'"),
        ({"role": "assistant", "content": 3}, "string or None"),
        ({"role": "assistant", "content": None}, "both are empty"),
        ({"role": "assistant", "content": None, "tool_calls": "calc"}, "must be a list"),
        ({"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]}, r"tool_calls\[0\]"),
    ],
)
async def test_malformed_actions_are_rejected_with_the_reason(action, match):
    env = ContractChecker(CountdownEnv())
    await env.reset()
    with pytest.raises(InvalidActionError, match=match):
        await env.step(action)
    # the episode is still usable after a rejected action
    assert (await env.step(envkit.assistant("ok"))).reward == 1.0


@pytest.mark.parametrize(
    ("reset_out", "step_out", "match"),
    [
        ([envkit.user("hi")], None, r"must return \(messages, info\)"),
        (([{"role": "robot", "content": "x"}], {}), None, "list of chat messages"),
        (([envkit.user("hi")], {}), ([], 1.0, True), "envkit.StepResult"),
        (([envkit.user("hi")], {}), StepResult([], reward="1"), "reward must be a number"),
        (([envkit.user("hi")], {}), StepResult([], reward=float("nan")), "finite"),
        (([envkit.user("hi")], {}), StepResult(["text"]), "list of chat messages"),
    ],
)
async def test_malformed_env_results_raise_invalid_step_result(reset_out, step_out, match):
    env = ContractChecker(BadEnv(reset_out, step_out))
    with pytest.raises(InvalidStepResultError, match=match):
        await env.reset()
        await env.step(envkit.assistant("x"))


async def test_same_seed_same_start_and_task_overrides_seed():
    env = ContractChecker(CountdownEnv())
    a, _ = await env.reset(seed=7)
    b, _ = await env.reset(seed=7)
    c, _ = await env.reset(seed=7, task={"start": 4})
    assert a == b and c == [envkit.user("4 left")]


def test_sync_facade_runs_episode_and_accepts_plain_strings():
    inner = CountdownEnv(start=2)
    with SyncEnv(ContractChecker(inner)) as env:
        assert env.unwrapped is inner
        env.reset()
        assert env.step("one").reward == 1.0
        assert env.step(envkit.assistant("two")).terminated
    env.close()
    assert inner.close_calls == 1


async def test_sync_facade_refuses_to_run_inside_an_event_loop():
    env = SyncEnv(CountdownEnv())
    with pytest.raises(ContractError, match="running event loop"):
        env.reset()


def test_wrapper_forwards_extra_attributes_and_unwrapped():
    inner = CountdownEnv(start=3)
    env = ContractChecker(ContractChecker(inner))
    assert env.start == 3 and env.unwrapped is inner


def test_tool_from_function_builds_openai_schema():
    def search(query: str, k: int = 3, exact: bool | None = None) -> str:
        """Search the notes.

        Args:
            query: words to look for
            k: how many hits
        """
        return query

    t = Tool.from_function(search)
    assert t.to_openai() == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "words to look for"},
                    "k": {"type": "integer", "description": "how many hits"},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    }
    assert t.validate_arguments({"query": "x"}) is None
    assert "missing required" in t.validate_arguments({"k": 1})
    assert "unknown argument(s): q" in t.validate_arguments({"query": "x", "q": 1})
    assert "must be of type integer" in t.validate_arguments({"query": "x", "k": "3"})
    assert "must be of type integer" in t.validate_arguments({"query": "x", "k": True})


def test_parse_tool_calls_text_form():
    text = (
        'Let me compute. <tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"3\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls, errors = envkit.parse_tool_calls(text)
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expr": "2+2"}, {"expr": "3"}]
    assert len(errors) == 2 and "not valid JSON" in errors[0] and "must be an object" in errors[1]
    assert envkit.parse_tool_calls("no calls here") == ([], [])


class NotesEnv(ToolEnv):
    """Store a note, then answer with what was stored."""

    max_turns = 3

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.notes: list[str] = []

    @tool
    def write(self, text: str) -> str:
        """Write a note."""
        self.notes.append(text)
        return f"stored {len(self.notes)}"

    @tool
    async def explode(self) -> str:
        """A tool that fails."""
        raise RuntimeError("boom")

    async def start_episode(self, *, seed, task):
        self.notes = []
        return [envkit.user("Write 'x' then answer with it.")], {}

    async def grade(self, answer):
        return float(answer.strip() in self.notes), {"notes": list(self.notes)}


async def test_tool_env_native_and_text_calls_errors_answer_and_max_turns():
    assert [t.name for t in NotesEnv.tools] == ["write", "explode"]
    env = envkit.ContractChecker(NotesEnv())
    await env.reset()
    native = {"id": "a1", "type": "function", "function": {"name": "write", "arguments": '{"text": "x"}'}}
    r = await env.step(envkit.assistant(None, [native]))
    assert r.observation == [{"role": "tool", "content": "stored 1", "tool_call_id": "a1", "name": "write"}]
    r = await env.step(envkit.assistant('<tool_call>{"name": "explode", "arguments": {}}</tool_call>'
                                        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'))
    assert [m["content"] for m in r.observation] == [
        "Error: RuntimeError: boom",
        "Error: unknown tool 'nope'. Available: write, explode.",
    ]
    r = await env.step(envkit.assistant("x"))
    assert r.terminated and r.reward == 1.0 and r.info["notes"] == ["x"]

    await env.reset()
    for _ in range(2):
        assert not (await env.step(envkit.assistant('<tool_call>{"name": "write"}</tool_call>'))).done
    r = await env.step(envkit.assistant('<tool_call>{"name": "write", "arguments": {"text": 1}}</tool_call>'))
    assert r.truncated and not r.terminated and r.reward == 0.0
    assert "must be of type string" in r.observation[0]["content"]


def test_tool_env_rejects_bad_max_turns():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        NotesEnv(max_turns=0)


@pytest.mark.parametrize(
    ("text", "value", "fmt"),
    [
        ("so #### 1,234.", 1234.0, "hashes"),
        ("\\boxed{-3/4}", -0.75, "boxed"),
        ("The answer is: 19", 19.0, "answer_is"),
        ("answer = **42**", 42.0, "answer_is"),
        ("first 3, then The answer is 5. Checking 2+3", 5.0, "answer_is"),
        ("i think 7 or 8", 8.0, "bare"),
        ("costs $12.50", 12.5, "bare"),
        ("−7", -7.0, "bare"),
    ],
)
def test_extract_answer_formats(text, value, fmt):
    ans = envkit.extract_answer(text)
    assert ans is not None and ans.value == value and ans.format == fmt
    assert ans.explicit == (fmt != "bare")


@pytest.mark.parametrize("text", [None, "", "no digits at all", "####"])
def test_extract_answer_none(text):
    assert envkit.extract_answer(text) is None


def test_env_runs_under_plain_asyncio_gather():
    async def episode(seed: int) -> float:
        env = ContractChecker(CountdownEnv())
        await env.reset(seed=seed)
        total = 0.0
        while True:
            r = await env.step(envkit.assistant("next"))
            total += r.reward
            if r.done:
                return total

    async def all_episodes() -> list[float]:
        return list(await asyncio.gather(*(episode(s) for s in range(5))))

    assert asyncio.run(all_episodes()) == [1.0, 2.0, 3.0, 4.0, 5.0]
