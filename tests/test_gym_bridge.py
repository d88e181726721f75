"""The gymnasium bridge: gymnasium envs played as text games, envkit envs driven as gymnasium envs."""

from __future__ import annotations

import asyncio
import importlib
import random
import warnings
from collections import deque

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from remote_envs import envkit_serve

import envkit
from envkit import Env, StepResult
from envkit.errors import EnvNotFoundError
from envkit.integrations.gym_bridge import (
    REPLACEMENT_CHAR,
    GymnasiumEnv,
    GymTextEnv,
    as_gymnasium,
    parse_action,
)
from envkit.integrations.gym_games import RENDERERS, Renderer

FIRM_ICE = {"is_slippery": False}
# The 4x4 map: SFFF / FHFH / FFFH / HFFG.
PATH_TO_GOAL = ["Down", "Down", "Right", "Right", "Down", "Right"]
# Taxi-v3 until gymnasium 1.2, Taxi-v4 since: the bridge plays whichever is installed.
TAXI_IDS = [gym_id for gym_id in ("Taxi-v3", "Taxi-v4") if gym_id in gymnasium.registry]
TAXI = ["South", "North", "East", "West", "Pickup", "Dropoff"]
TAXI_MAP = ["+---------+", "|R: | : :G|", "| : | : : |", "| : : : : |", "| | : | : |", "|Y| : |B: |", "+---------+"]
CLIFF = ["Up", "Right", "Down", "Left"]
CLIFF_BOARD = "\n".join(["  ".join("o" * 12)] * 3 + ["  ".join("x" + "C" * 10 + "T")])


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
    assert env.renderer is RENDERERS["FrozenLake"]
    await env.close()


async def test_blackjack_renders_and_plays():
    env = envkit.make("gym:Blackjack-v1")
    assert env.renderer is RENDERERS["Blackjack"] and env.gym_env.render_mode is None  # no ansi: words only
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


def shortest_plan(env: gymnasium.Env) -> list[int]:
    """The actions of a shortest way from the env's state to the end of the episode (deterministic envs only)."""
    start = env.unwrapped.s
    came_from: dict[int, tuple[int, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for action, [(_, after, _, done)] in env.unwrapped.P[state].items():
            if done:
                plan = [action]
                while came_from[state] is not None:
                    state, previous = came_from[state]
                    plan.insert(0, previous)
                return plan
            if after not in came_from:
                came_from[after] = (state, action)
                queue.append(after)
    raise AssertionError("no way to the end")


# The ways a model names an action; a scripted episode cycles through them.
REPLIES = ["Action: {name}", "I'll go {lower}.", "<action>{upper}</action>", "{number}",
           "Not {other}, I choose {name}!"]


async def play(env: GymTextEnv, plan: list[int]) -> list[StepResult]:
    """Send ``plan`` as replies in every style of REPLIES; each must be read as the planned action."""
    results = []
    for turn, action in enumerate(plan):
        name = env.action_names[action]
        reply = REPLIES[turn % len(REPLIES)].format(name=name, lower=name.lower(), upper=name.upper(),
                                                    number=action, other=env.action_names[action - 1])
        results.append(await env.step(say(reply)))
        assert results[-1].info["action"] == name and results[-1].info["invalid"] is False, reply
    return results


@pytest.mark.parametrize("gym_id", TAXI_IDS)
async def test_taxi_shows_its_map_and_delivers_the_passenger(gym_id: str):
    env = envkit.make(f"gym:{gym_id}")
    messages, info = await env.reset(seed=0)
    assert env.renderer is RENDERERS["Taxi"] and env.gym_env.render_mode == "ansi"
    assert "Valid actions: South, North, East, West, Pickup, Dropoff (or their numbers 0-5)." in messages[0]["content"]
    lines = messages[1]["content"].splitlines()
    board, said = lines[:7], lines[7:]
    row, col, passenger, destination = env.gym_env.unwrapped.decode(env.gym_env.unwrapped.s)
    taxi_map = [list(line) for line in TAXI_MAP]
    taxi_map[1 + row][2 * col + 1] = "T"
    assert board == ["".join(line) for line in taxi_map]  # gymnasium's map with the taxi drawn as T
    assert said[0].startswith(f"The taxi (T) is at row {row + 1}, column {col + 1}")
    assert said[1].startswith(f"The passenger waits at {'RGYB'[passenger]} (row ")
    assert f"wants to go to {'RGYB'[destination]} (row " in said[1]
    assert info["action_mask"].dtype == np.int8

    plan = shortest_plan(env.gym_env)
    assert TAXI.index("Pickup") in plan and plan[-1] == TAXI.index("Dropoff")
    results = await play(env, plan)
    assert [r.reward for r in results] == [-1.0] * (len(plan) - 1) + [20.0]
    assert results[-1].terminated and not any(r.done for r in results[:-1])
    assert "The passenger is in the taxi" in results[plan.index(TAXI.index("Pickup"))].observation[0]["content"]
    assert "The passenger has arrived at" in results[-1].observation[0]["content"]
    assert results[-1].observation[0]["content"].endswith("The episode is over. Reward: 20.")
    await env.close()


async def test_taxi_wrong_pickup_shows_its_penalty():
    env = envkit.make(f"gym:{TAXI_IDS[-1]}")
    await env.reset(seed=0)  # the taxi starts away from the passenger
    result = await env.step(say("Pickup"))
    assert result.reward == -10.0 and result.observation[0]["content"].endswith("\n\nReward: -10.")
    await env.close()


def test_the_taxi_gymnasium_lacks_is_not_found_and_the_one_it_has_is_named():
    missing = {"Taxi-v3", "Taxi-v4"} - set(TAXI_IDS)
    for gym_id in missing:
        with pytest.raises(EnvNotFoundError, match=rf"No environment named '{gym_id}'. Did you mean: '{TAXI_IDS[0]}'"):
            envkit.make(f"gym:{gym_id}")
    with pytest.raises(EnvNotFoundError, match=r"Did you mean: 'Taxi-v\d'\? gymnasium .* says: .*`Taxy` doesn't exist"):
        envkit.make("gym:Taxy-v4")


async def test_cliffwalking_shows_its_grid_and_reaches_the_goal():
    env = envkit.make("gym:CliffWalking-v1")
    messages, _ = await env.reset(seed=0)
    assert env.renderer is RENDERERS["CliffWalking"] and env.gym_env.render_mode == "ansi"
    assert "Valid actions: Up, Right, Down, Left (or their numbers 0-3)." in messages[0]["content"]
    assert messages[1]["content"] == f"{CLIFF_BOARD}\nYou (x) are at row 4, column 1.\n" \
        "Legend: x you, o safe ground, C cliff, T goal."

    fall = await env.step(say("I move Right."))  # onto the cliff: back to the start, and told the cost
    assert (fall.reward, fall.done) == (-100.0, False)
    assert fall.observation[0]["content"].startswith(CLIFF_BOARD) and fall.observation[0]["content"].endswith(
        "Reward: -100.")
    plan = shortest_plan(env.gym_env)
    assert [CLIFF[a] for a in plan] == ["Up"] + ["Right"] * 11 + ["Down"]
    results = await play(env, plan)
    assert sum(r.reward for r in results) == -13.0 and results[-1].terminated
    last = results[-1].observation[0]["content"]
    assert last.splitlines()[3].endswith("C  x") and "You reached the goal!" in last
    await env.close()


@pytest.mark.parametrize(
    ("name", "gym_kwargs", "said"),
    [
        ("gym:CliffWalkingSlippery-v1", {}, {"slippery"}),
        (f"gym:{TAXI_IDS[-1]}", {"is_rainy": True, "fickle_passenger": True}, {"raining", "change their mind"}),
        (f"gym:{TAXI_IDS[-1]}", {}, set()),
    ],
)
async def test_rules_say_when_moves_are_uncertain(name: str, gym_kwargs: dict, said: set[str]):
    env = envkit.make(name, gym_kwargs=gym_kwargs)
    rules = (await env.reset(seed=0))[0][0]["content"]
    assert {warning for warning in ("slippery", "raining", "change their mind") if warning in rules} == said
    await env.close()


async def test_a_render_mode_the_caller_picks_is_kept():
    env = envkit.make("gym:CliffWalking-v1", gym_kwargs={"render_mode": None})
    messages, _ = await env.reset(seed=0)
    assert env.gym_env.render_mode is None  # no ansi board to show: the state in words remains
    assert messages[1]["content"].startswith("You (x) are at row 4, column 1.")
    await env.close()


async def test_generic_renderer_shows_the_ansi_rendering_without_colours():
    env = GymTextEnv("FrozenLake-v1", gym_kwargs=FIRM_ICE, renderer=Renderer())
    messages, _ = await env.reset(seed=0)
    assert "You are playing the gymnasium environment FrozenLake-v1." in messages[0]["content"]
    assert "Valid actions: 0, 1, 2, 3." in messages[0]["content"]
    assert messages[1]["content"] == "SFFF\nFHFH\nFFFH\nHFFG"  # the player was only a colour
    result = await env.step(say("1"))
    assert result.observation[0]["content"] == "  (Down)\nSFFF\nFHFH\nFFFH\nHFFG\n\nReward: 0."
    await env.close()


async def test_generic_renderer_without_ansi_shows_the_observation():
    env = envkit.make("gym:CartPole-v1")
    assert env.renderer == Renderer() and env.gym_env.render_mode is None
    messages, _ = await env.reset(seed=0)
    assert "Valid actions: 0, 1." in messages[0]["content"]
    assert messages[1]["content"].startswith("Observation: [")
    result = await env.step(say("Action: 1"))
    assert result.observation[0]["content"].startswith("Observation: [")
    assert (result.info["action"], result.reward) == ("1", 1.0)
    assert env.spaces()["action"] == "text naming one of 0, 1 (Discrete(2))"
    await env.close()


async def test_action_names_passed_by_the_user():
    env = envkit.make("gym:CartPole-v1", action_names=["push left", "push right"])
    messages, _ = await env.reset(seed=0)
    assert "Valid actions: push left, push right (or their numbers 0-1)." in messages[0]["content"]
    assert (await env.step(say("I will push right."))).info["action"] == "push right"
    assert (await env.step(say("0"))).info["action"] == "push left"
    assert env.spec.kwargs["action_names"] == ["push left", "push right"]  # in the spec, for a remake or a server
    await env.close()

    lake = GymTextEnv("FrozenLake-v1", gym_kwargs=FIRM_ICE, action_names=["West", "South", "East", "North"])
    messages, _ = await lake.reset(seed=0)
    assert "Valid actions: West, South, East, North" in messages[0]["content"]
    assert messages[1]["content"].startswith("P F F F")  # the game's board and rules stay
    assert (await lake.step(say("south"))).observation[0]["content"].startswith("S F F F\nP H F H")
    await lake.close()


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        (["Left", "Down", "Right"], r"3 action names \(Left, Down, Right\) for CartPole-v1's Discrete\(2\): give "
                                    r"exactly one name per action, in order"),
        (["Go", "go"], "action names must differ ignoring case"),
        (["Go", " "], "action names must be non-empty strings"),
    ],
)
def test_action_names_are_checked(names: list[str], problem: str):
    with pytest.raises(ValueError, match=problem):
        GymTextEnv("CartPole-v1", action_names=names)


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
    closes = []
    close = gym_env.close
    gym_env.close = lambda: (closes.append(1), close())[1]
    env = GymTextEnv(gym_env, system_prompt="Cross the lake.", max_invalid=1)
    messages, _ = await env.reset(seed=1)
    assert messages[0]["content"] == "Cross the lake."
    await env.close()
    assert len(closes) == 1
    await env.close()
    assert len(closes) == 1  # a second close does not close the gym env again


def test_rejects_what_it_cannot_play():
    with pytest.raises(TypeError, match="Discrete"):
        GymTextEnv("Pendulum-v1")
    with pytest.raises(ValueError, match="gym_kwargs"):
        GymTextEnv(gymnasium.make("FrozenLake-v1"), gym_kwargs=FIRM_ICE)
    with pytest.raises(ValueError, match=r"2 action names \(Stick, Hit\) for FrozenLake-v1's Discrete\(4\)"):
        GymTextEnv("FrozenLake-v1", renderer=RENDERERS["Blackjack"])


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


@pytest.mark.parametrize(
    ("reply", "names", "action"),
    [
        ("I move Right.", CLIFF, 1),
        ("Pickup", TAXI, 4),
        ("action: DROPOFF", TAXI, 5),
        ("Drive north, then I can pick the passenger up.", TAXI, 1),  # "pick ... up" is no name
        ("West or east? East.", TAXI, 2),
        ("5", TAXI, 5),
    ],
)
def test_parse_action_with_the_games_names(reply: str, names: list[str], action: int):
    assert parse_action(reply, names) == action


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ("I'll drop off the passenger.", "no action found in your reply"),
        ("Action: drop off", "'Action: drop off' names no valid action"),
        ("6", "there is no action number 6"),
    ],
)
async def test_unreadable_taxi_replies_are_invalid_and_say_why(reply: str, problem: str):
    env = envkit.make(f"gym:{TAXI_IDS[-1]}")
    await env.reset(seed=0)
    state = env.gym_env.unwrapped.s
    result = await env.step(say(reply))
    assert (result.reward, result.done, result.info) == (-0.1, False, {"action": None, "invalid": True,
                                                                       "error": problem})
    assert result.observation[0]["content"] == (
        f"Invalid reply: {problem}. Valid actions: South, North, East, West, Pickup, Dropoff (or their numbers "
        "0-5). End your reply with a line 'Action: <action>'.")
    assert env.gym_env.unwrapped.s == state
    await env.close()


def test_parse_action_other_names():
    assert parse_action("Hit me? No, I'll stick.", ["Stick", "Hit"]) == 0
    assert parse_action("From state 36 I pick 1", ["0", "1", "2", "3"]) == 1
    assert parse_action("hit me now", ["Hit", "Hit me"]) == 1


def as_json(value: object) -> object:
    """``value`` with every numpy array and scalar as the Python lists and numbers it holds."""
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


@pytest.fixture(scope="module")
def taxi_server():
    with envkit_serve(f"gym:{TAXI_IDS[-1]}") as server:
        yield server


@pytest.mark.parametrize("scheme", ["http", "ws"])
async def test_taxi_over_envkit_serve_gives_the_local_episode_with_info_as_json(taxi_server, scheme: str):
    name = f"gym:{TAXI_IDS[-1]}"
    async with envkit.make(name) as local, envkit.make(f"{scheme}://127.0.0.1:{taxi_server.port}/{name}") as remote:
        (local_messages, local_info), (remote_messages, remote_info) = await local.reset(seed=3), \
            await remote.reset(seed=3)
        assert remote_messages == local_messages and isinstance(local_info["action_mask"], np.ndarray)
        assert remote_info == as_json(local_info) == {"prob": 1.0, "action_mask": local_info["action_mask"].tolist()}
        assert all(type(x) is int for x in remote_info["action_mask"])
        for reply in ["North", "Pickup", "hmm", "Action: West", "Dropoff"]:
            mine, theirs = await local.step(say(reply)), await remote.step(say(reply))
            assert theirs.observation == mine.observation
            assert (theirs.reward, theirs.terminated, theirs.truncated) == (mine.reward, mine.terminated,
                                                                            mine.truncated)
            assert theirs.info == as_json(mine.info)


@pytest.mark.e2e
async def test_the_bundled_model_plays_each_board_game_greedily(vllm_engine, chat_tokenizer):
    """FrozenLake, Taxi and CliffWalking at once on the session's server (one batch): each board reaches the model
    as the env drew it, and the env answers every turn with the next board or why the reply was invalid."""
    from generators.rollout import Generator, GeneratorConfig, env_factory

    names = [f"gym:{gym_id}" for gym_id in ("FrozenLake-v1", TAXI_IDS[-1], "CliffWalking-v1")]
    generator = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(temperature=0.0, max_tokens=48, max_turns=3))
    played = await asyncio.gather(*(generator.generate(env_factory(name), seeds=[0], env_name=name)
                                    for name in names))
    for name, [traj] in zip(names, played, strict=True):
        assert not traj.failed, (name, traj.error)
        assert traj.stop_reason in ("done", "max_turns") and traj.num_turns >= 1
        traj.check()
        async with envkit.make(name) as env:
            opening, _ = await env.reset(seed=0)
        assert traj.messages[:2] == opening, name
        prompt = chat_tokenizer.decode(traj.prompt_ids)
        assert all(line in prompt for line in opening[1]["content"].splitlines()), name  # the board the model saw
        replies = [m["content"] for m in traj.messages[2:] if m["role"] == "user"]  # the env's answer to each turn
        assert len(replies) == traj.num_turns
        assert all(r.startswith("Invalid reply: ") or "\nLegend: " in r for r in replies), (name, replies)


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
