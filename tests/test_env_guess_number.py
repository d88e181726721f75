"""Behaviour of the guess-number game (envs/guess_number): hints, invalid replies, reward shaping, truncation."""

from __future__ import annotations

import pytest
from envkit_guess_number import MIN_REWARD, GuessNumberEnv

import envkit
from envkit.errors import EpisodeDoneError, ResetNeededError


async def _play(env: envkit.Env, *guesses: str) -> list[envkit.StepResult]:
    return [await env.step(envkit.assistant(g)) for g in guesses]


async def test_make_and_opening_messages() -> None:
    env = envkit.make("guess-number")
    assert isinstance(env.unwrapped, GuessNumberEnv)
    messages, info = await env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "from 1 to 100" in messages[1]["content"] and "7 guesses" in messages[1]["content"]
    other, _ = await env.reset(task={"secret": info["task"]["secret"] % 100 + 1})
    assert other == messages  # the opening does not depend on (leak) the secret


async def test_same_seed_same_secret() -> None:
    secrets = []
    for seed in range(30):
        _, a = await envkit.make("guess-number").reset(seed=seed)
        _, b = await GuessNumberEnv().reset(seed=seed)
        assert a["task"]["secret"] == b["task"]["secret"]
        assert 1 <= a["task"]["secret"] <= 100
        secrets.append(a["task"]["secret"])
    assert len(set(secrets)) > 15


async def test_higher_and_lower_hints() -> None:
    env = envkit.make("guess-number")
    await env.reset(task={"secret": 42})
    low, high = await _play(env, "My guess is 10.", "90")
    assert low.observation == [{"role": "user", "content": "Higher."}]
    assert high.observation == [{"role": "user", "content": "Lower."}]
    assert low.reward == high.reward == 0.0 and not low.done and not high.done
    assert (low.info["guess"], high.info["guess"], high.info["turn"]) == (10, 90, 2)


@pytest.mark.parametrize("reply", ["I have no idea.", "Maybe fifty?", "50.5"])
async def test_reply_without_whole_number_is_penalized_and_uses_a_turn(reply: str) -> None:
    env = envkit.make("guess-number", max_turns=2)
    await env.reset(task={"secret": 42})
    first, last = await _play(env, reply, reply)
    assert first.reward == pytest.approx(-0.1) and not first.done
    assert "no whole number" in first.observation[0]["content"] and first.info["guess"] is None
    assert last.truncated and last.reward == pytest.approx(-0.1)


async def test_custom_invalid_penalty() -> None:
    env = envkit.make("guess-number", invalid_penalty=-0.5)
    await env.reset(task={"secret": 42})
    assert (await env.step(envkit.assistant("hmm"))).reward == pytest.approx(-0.5)


@pytest.mark.parametrize(("turn", "reward"), [(1, 1.0), (2, 0.85), (4, 0.55), (6, 0.25), (7, 0.1)])
async def test_reward_shrinks_linearly_with_turns_used(turn: int, reward: float) -> None:
    env = envkit.make("guess-number")
    await env.reset(task={"secret": 42})
    results = await _play(env, *["1"] * (turn - 1), "42")
    assert all(not r.done for r in results[:-1])
    assert results[-1].terminated and not results[-1].truncated
    assert results[-1].reward == pytest.approx(reward)
    assert results[-1].info["correct"] and results[-1].observation == []


def test_reward_formula_endpoints() -> None:
    env = GuessNumberEnv(max_turns=10)
    assert env.reward_for(1) == pytest.approx(1.0)
    assert env.reward_for(10) == pytest.approx(MIN_REWARD)
    assert GuessNumberEnv(max_turns=1).reward_for(1) == 1.0


async def test_running_out_of_turns_truncates() -> None:
    env = envkit.make("guess-number", max_turns=3)
    await env.reset(task={"secret": 42})
    results = await _play(env, "50", "25", "37")
    assert [r.truncated for r in results] == [False, False, True]
    assert all(r.reward == 0.0 and not r.terminated for r in results)
    assert results[-1].observation[0]["content"] == "Higher. You are out of guesses; the number was 42."
    assert results[-1].info["secret"] == 42
    with pytest.raises(EpisodeDoneError):
        await env.step(envkit.assistant("42"))


async def test_binary_search_always_wins_in_default_turns() -> None:
    env = GuessNumberEnv()
    for secret in range(1, 101):
        await env.reset(task={"secret": secret})
        low, high = 1, 100
        while True:
            guess = (low + high) // 2
            result = await env.step(envkit.assistant(str(guess)))
            if result.terminated:
                assert result.reward >= MIN_REWARD
                break
            assert not result.truncated
            if result.observation[0]["content"] == "Higher.":
                low = guess + 1
            else:
                high = guess - 1


async def test_custom_range() -> None:
    env = GuessNumberEnv(low=-5, high=5, max_turns=4)
    for seed in range(20):
        _, info = await env.reset(seed=seed)
        assert -5 <= info["task"]["secret"] <= 5
    await env.reset(task={"secret": -3})
    assert (await env.step(envkit.assistant("-4"))).observation[0]["content"] == "Higher."
    assert (await env.step(envkit.assistant("The answer is -3"))).reward == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"low": 10, "high": 10}, "low < high"),
        ({"low": 1.5}, "low < high"),
        ({"max_turns": 0}, "max_turns"),
        ({"invalid_penalty": 0.5}, "invalid_penalty"),
    ],
)
def test_invalid_kwargs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuessNumberEnv(**kwargs)


async def test_task_validation_and_step_before_reset() -> None:
    env = GuessNumberEnv()
    with pytest.raises(ValueError, match="secret"):
        await env.reset(task={"secret": 101})
    with pytest.raises(ResetNeededError):
        await env.step(envkit.assistant("5"))
    assert env.tasks("train") is None
