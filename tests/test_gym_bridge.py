"""The gymnasium bridge: gymnasium envs played as text games, envkit envs driven as gymnasium envs."""

from __future__ import annotations

import importlib
import random
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envkit
from envkit import Env, StepResult
from envkit.gym_bridge import (
    REPLACEMENT_CHAR,
    BlackjackRenderer,
    FrozenLakeRenderer,
    GymnasiumEnv,
    GymTextEnv,
    Renderer,
    as_gymnasium,
    parse_action,
)

FIRM_ICE = {"is_slippery": False}
# The 4x4 map: SFFF / FHFH / FFFH / HFFG.
PATH_TO_GOAL = ["Down", "Down", "Right", "Right", "Down", "Right"]


def say(text: str) -> envkit.Message:
    return envkit.assistant(text)


class EchoEnv(Env):
    """Repeat the word: reward 1 and done when the reply is the word, truncated after three tries."""

    WORDS = ("apple", "river", "stone", "cloud")

    async def reset(self, *, seed=None, task=None):
        self.word = task["word"] if task else random.Random(seed).choice(self.WORDS)
        self.tries = 0
        return [envkit.system("Repeat the word after me."), envkit.user(self.word)], {"word": self.word}

    async def step(self, action):
        self.tries += 1
        solved = (action["content"] or "").strip() == self.word
        return StepResult(
            [envkit.user("Correct." if solved else f"No, the word is {self.word}.")],
            reward=float(solved),
            terminated=solved,
            truncated=not solved and self.tries >= 3,
            info={"tries": self.tries},
        )


@pytest.fixture
def echo_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register EchoEnv as "echo" in a fresh process-wide registry, so other tests never see it."""
    registry = envkit.Registry()
    registry.register("echo", EchoEnv)
    monkeypatch.setattr(importlib.import_module("envkit.registry"), "registry", registry)


def check_env_warnings(env: gymnasium.Env, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, **kwargs)
    return [str(w.message) for w in caught]


# ---------------------------------------------------------------------------------------------- gymnasium → envkit


async def test_frozenlake_reaches_the_goal():
    env = envkit.make("gym:FrozenLake-v1", gym_kwargs=FIRM_ICE)
    messages, _ = await env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "Left, Down, Right, Up" in messages[0]["content"] and "slippery" not in messages[0]["content"]
    assert messages[1]["content"].startswith("P F F F\nF H F H\nF F F H\nH F F G\n")
    for move in PATH_TO_GOAL:
        result = await env.step(say(f"Action: {move}"))
        assert result.info["action"] == move and result.info["invalid"] is False
    assert (result.reward, result.terminated, result.truncated) == (1.0, True, False)
    assert "H F F P" in result.observation[0]["content"] and "reached the goal" in result.observation[0]["content"]
    await env.close()


async def test_frozenlake_hole_ends_the_episode_with_zero():
    env = envkit.make("gym:FrozenLake-v1", gym_kwargs=FIRM_ICE)
    await env.reset(seed=0)
    await env.step(say("Right"))
    result = await env.step(say("Down"))
    assert (result.reward, result.terminated) == (0.0, True)
    assert "F P F H" in result.observation[0]["content"] and "fell into a hole" in result.observation[0]["content"]
    await env.close()


async def test_frozenlake_keeps_gymnasium_slippery_default():
    env = envkit.make("gym:FrozenLake-v1")
    messages, _ = await env.reset(seed=0)
    assert "slippery" in messages[0]["content"]
    assert isinstance(env.renderer, FrozenLakeRenderer)
    await env.close()


async def test_blackjack_renders_and_plays():
    env = envkit.make("gym:Blackjack-v1")
    assert isinstance(env.renderer, BlackjackRenderer)
    messages, _ = await env.reset(seed=0)
    assert "Stick, Hit" in messages[0]["content"]
    total = env.gym_env.unwrapped._get_obs()[0]
    assert f"Your cards total {total}" in messages[1]["content"] and "The dealer shows" in messages[1]["content"]
    result = await env.step(say("Eleven is low, so I'll hit."))
    assert result.info["action"] == "Hit"
    while not result.done:
        result = await env.step(say("<action>stick</action>"))
    assert result.reward in (-1.0, 0.0, 1.0) and "The episode is over" in result.observation[0]["content"]
    await env.close()


async def test_generic_renderer_on_cliffwalking():
    env = envkit.make("gym:CliffWalking-v1")
    assert type(env.renderer) is Renderer
    messages, _ = await env.reset(seed=0)
    assert "Valid actions: 0, 1, 2, 3." in messages[0]["content"]
    assert messages[1]["content"] == "Observation: 36"
    result = await env.step(say("Action: 0"))  # up, off the start cell
    assert result.observation[0]["content"] == "Observation: 24"
    assert (result.info["action"], result.reward) == ("0", -1.0)
    assert env.spaces() == {
        "observation": "text rendering of Discrete(48)",
        "action": "text naming one of 0, 1, 2, 3 (Discrete(4))",
    }
    await env.close()


async def test_invalid_reply_gets_feedback_and_penalty_without_moving():
    env = envkit.make("gym:FrozenLake-v1", gym_kwargs=FIRM_ICE, invalid_penalty=-0.5)
    await env.reset(seed=0)
    await env.step(say("Down"))
    state = env.gym_env.unwrapped.s
    result = await env.step(say("I would rather jump."))
    assert (result.reward, result.terminated, result.truncated) == (-0.5, False, False)
    assert result.info == {"action": None, "invalid": True, "error": "no action found in your reply"}
    feedback = result.observation[0]["content"]
    assert feedback.startswith("Invalid reply: no action found") and "Left, Down, Right, Up" in feedback
    assert env.gym_env.unwrapped.s == state
    result = await env.step(say("Down"))
    assert result.info["invalid"] is False and env.gym_env.unwrapped.s == state + 4
    await env.close()


async def test_max_invalid_truncates_after_consecutive_invalid_replies():
    env = envkit.make("gym:FrozenLake-v1", gym_kwargs=FIRM_ICE, max_invalid=2)
    await env.reset(seed=0)
    assert not (await env.step(say("hmm"))).truncated
    assert not (await env.step(say("Down"))).truncated  # a valid reply resets the streak
    assert not (await env.step(say("hmm"))).truncated
    result = await env.step(say("Action: fly"))
    assert result.truncated and not result.terminated
    assert "2 invalid replies in a row" in result.observation[0]["content"]
    await env.close()


async def test_gym_time_limit_truncates():
    env = envkit.make("gym:FrozenLake-v1", gym_kwargs={**FIRM_ICE, "max_episode_steps": 2})
    await env.reset(seed=0)
    assert not (await env.step(say("Left"))).done
    result = await env.step(say("Left"))
    assert (result.terminated, result.truncated) == (False, True)
    await env.close()


async def test_same_seed_same_episode():
    env = envkit.make("gym:Blackjack-v1")
    starts = [(await env.reset(seed=s))[0] for s in range(10)]
    assert (await env.reset(seed=3))[0] == starts[3] == (await env.reset(task={"seed": 3}))[0]
    assert len({m[1]["content"] for m in starts}) > 1
    await env.close()

    slippery = envkit.make("gym:FrozenLake-v1")

    async def play(seed: int) -> list[str]:
        await slippery.reset(seed=seed)
        return [(await slippery.step(say("Right"))).observation[0]["content"] for _ in range(3)]

    assert await play(7) == await play(7)
    await slippery.close()


async def test_wraps_a_gymnasium_env_instance_and_closes_it_once():
    gym_env = gymnasium.make("FrozenLake-v1", is_slippery=False)
    env = GymTextEnv(gym_env, system_prompt="Cross the lake.", max_invalid=1)
    messages, _ = await env.reset(seed=1)
    assert messages[0]["content"] == "Cross the lake."
    await env.close()
    await env.close()


def test_rejects_what_it_cannot_play():
    with pytest.raises(TypeError, match="Discrete"):
        GymTextEnv("Pendulum-v1")
    with pytest.raises(ValueError, match="gym_kwargs"):
        GymTextEnv(gymnasium.make("FrozenLake-v1"), gym_kwargs=FIRM_ICE)
    with pytest.raises(ValueError, match="names 2 actions"):
        GymTextEnv("FrozenLake-v1", renderer=BlackjackRenderer())


FROZEN = ["Left", "Down", "Right", "Up"]


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("Left", 0),
        ("I'll go left.", 0),
        ("Action: left", 0),
        ("**Action:** Down", 1),
        ("<action>UP</action>", 3),
        ("<action>\nRight\n</action>", 2),
        ("Not Left but Right", 2),  # no marker: the last name mentioned
        ("Action: Left\nbecause Right leads to a hole", 0),  # a marker beats later mentions
        ("Action: Left ... on second thought, Action: Up", 3),  # the last marker
        ("The best action: go down, then right", 1),  # the first name inside the marker
        ("2", 2),
        ("**3**.", 3),
        ("Action: 1", 1),
        ("<action> 0 </action>", 0),
    ],
)
def test_parse_action(reply: str, action: int):
    assert parse_action(reply, FROZEN) == action


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ("", "your reply is empty"),
        (None, "your reply is empty"),
        ("Leftover rightward", "no action found in your reply"),
        ("I'd walk 2 cells", "no action found in your reply"),  # a number only counts on its own
        ("Action: jump", "'Action: jump' names no valid action"),
        ("7", "there is no action number 7"),
        ("-1", "no action found in your reply"),
    ],
)
def test_parse_action_errors(reply: str | None, problem: str):
    with pytest.raises(ValueError, match=problem):
        parse_action(reply, FROZEN)


def test_parse_action_other_names():
    assert parse_action("Hit me? No, I'll stick.", ["Stick", "Hit"]) == 0
    assert parse_action("From state 36 I pick 1", ["0", "1", "2", "3"]) == 1
    assert parse_action("hit me now", ["Hit", "Hit me"]) == 1


# ---------------------------------------------------------------------------------------------- envkit → gymnasium


def test_check_env_passes_without_warnings_on_a_registered_env(echo_registered):
    env = as_gymnasium(envkit.make("echo"))
    assert env.spec is not None and env.spec.id == "echo"
    assert check_env_warnings(env) == []
    env.close()


def test_check_env_on_an_unregistered_env_only_misses_a_spec():
    env = GymnasiumEnv(EchoEnv())
    assert env.spec is None
    assert check_env_warnings(env, skip_render_check=True) == []
    [warning] = check_env_warnings(env)
    assert "not having a spec" in warning
    env.close()


@pytest.mark.parametrize("name", ["frozenlake", "gym:FrozenLake-v1", "gym:Blackjack-v1"])
def test_check_env_passes_on_gym_text_envs_round_tripped(name: str):
    env = as_gymnasium(name)
    assert check_env_warnings(env) == []
    env.close()
    env.close()


def test_frozenlake_package_env():
    spec = envkit.spec("frozenlake")
    assert spec.package == "envkit-frozenlake"
    assert envkit.list_envs()[[s.name for s in envkit.list_envs()].index("frozenlake")].description.startswith(
        "Walk across a frozen lake"
    )
    env = GymnasiumEnv("frozenlake", env_kwargs={"map_name": "8x8"})
    obs, _ = env.reset(seed=0)
    assert "slippery" not in obs and "8 rows and 8 columns" in obs
    obs, reward, terminated, truncated, info = env.step("Action: Down")
    assert (reward, terminated, truncated, info["action"]) == (0.0, False, False, "Down")
    assert info["messages"][0]["content"] == obs and "row 2, column 1" in obs
    env.close()


def test_gymnasium_env_plays_an_episode(echo_registered):
    env = as_gymnasium("echo")
    obs, info = env.reset(seed=0, options={"task": {"word": "river"}})
    assert obs == "Repeat the word after me.\n\nriver"
    assert info == {"word": "river", "messages": [envkit.system("Repeat the word after me."), envkit.user("river")]}
    assert env.step("lake")[1:4] == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step("river")
    assert (obs, reward, terminated, truncated, info["tries"]) == ("Correct.", 1.0, True, False, 2)
    remade = gymnasium.make(env.spec)
    assert remade.reset(seed=0, options={"task": {"word": "stone"}})[0].endswith("stone")
    remade.close()
    env.close()


def test_unseeded_resets_follow_the_last_seed():
    env = GymnasiumEnv(EchoEnv())
    env.reset(seed=5)
    first = [env.reset()[0] for _ in range(5)]
    env.reset(seed=5)
    assert [env.reset()[0] for _ in range(5)] == first
    env.close()


def test_observations_are_cut_and_mapped_into_the_space():
    env = GymnasiumEnv(EchoEnv(), max_length=40)
    word = "naïve “café” ☃ 日本 " + "x" * 50
    obs, info = env.reset(options={"task": {"word": word}})
    assert obs == "Repeat the word after me.\n\nnaïve “café” "  # cut to 40 characters
    assert obs in env.observation_space
    obs, *_ = env.reset(options={"task": {"word": "☃日本"}})
    assert obs.endswith(3 * REPLACEMENT_CHAR) and obs in env.observation_space
    assert info["messages"][1]["content"] == word
    env.close()


@pytest.mark.parametrize("name", ["echo", "frozenlake", "gym:Blackjack-v1", "gym:Taxi-v4"])
def test_random_actions_never_crash(echo_registered, name: str):
    env = as_gymnasium(name)
    env.action_space.seed(0)
    obs, _ = env.reset(seed=0)
    for _ in range(60):
        assert obs in env.observation_space
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert isinstance(reward, float) and isinstance(info["messages"], list)
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
