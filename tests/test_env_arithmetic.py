"""Behaviour of the arithmetic env (envs/arithmetic): seeding, splits, grading, levels."""

from __future__ import annotations

import re

import pytest
from envkit_arithmetic import DEFAULT_SYSTEM_PROMPT, ArithmeticEnv

import envkit
from envkit.errors import EpisodeDoneError, ResetNeededError


def _numbers(expression: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", expression)]


def _ops(expression: str) -> list[str]:
    return re.findall(r" ([-+*]) ", expression)


def _value(expression: str) -> int:
    return eval(expression, {"__builtins__": {}})  # the env's own generated expressions: digits, + - * and ()


async def test_make_goes_through_registry_and_checker() -> None:
    env = envkit.make("arithmetic", level=2)
    assert isinstance(env, envkit.ContractChecker)
    assert isinstance(env.unwrapped, ArithmeticEnv)
    assert env.spec is not None and env.spec.kwargs == {"level": 2}
    messages, info = await env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == DEFAULT_SYSTEM_PROMPT
    assert messages[1]["content"] == info["task"]["question"]
    listed = {s.name: s.description for s in envkit.list_envs()}
    assert listed["arithmetic"].startswith("Arithmetic: answer")


async def test_same_seed_same_messages_across_instances() -> None:
    for level in range(1, 6):
        first, _ = await envkit.make("arithmetic", level=level).reset(seed=123)
        second, _ = await ArithmeticEnv(level=level).reset(seed=123)
        assert first == second


async def test_seed_picks_train_task_modulo_split_size() -> None:
    env = ArithmeticEnv(level=3, num_train=50)
    train = env.tasks("train")
    for seed in (0, 7, 49, 50, 1234):
        _, info = await env.reset(seed=seed)
        assert info["task"] == train[seed % 50]
    questions = set()
    for seed in range(20):
        messages, _ = await env.reset(seed=seed)
        questions.add(messages[1]["content"])
    assert len(questions) == 20


async def test_unseeded_reset_draws_from_train() -> None:
    env = ArithmeticEnv()
    train_ids = {t["id"] for t in env.tasks("train")}
    for _ in range(20):
        _, info = await env.reset()
        assert info["task"]["id"] in train_ids


async def test_task_takes_precedence_over_seed() -> None:
    env = ArithmeticEnv()
    task = {"id": "custom", "question": "What is 40 + 2?", "answer": 42}
    messages, info = await env.reset(seed=3, task=task)
    assert messages[1]["content"] == "What is 40 + 2?"
    assert info["task"] is task
    assert (await env.step(envkit.assistant("42"))).reward == 1.0


@pytest.mark.parametrize("task", [{"answer": 3}, {"question": "What is 1 + 2?"}, {"question": "q", "answer": "3"}])
async def test_reset_rejects_malformed_task(task: dict) -> None:
    with pytest.raises(ValueError, match="task must"):
        await ArithmeticEnv().reset(task=task)


@pytest.mark.parametrize(
    ("reply", "reward", "parsed", "fmt"),
    [
        ("12 + 7 = 19\n#### 19", 1.0, 19, "hashes"),
        ("So we get \\boxed{19}.", 1.0, 19, "boxed"),
        ("12 plus 7 is 19. The answer is 19.", 1.0, 19, "answer_is"),
        ("19", 1.0, 19, "bare"),
        ("The answer is 18.", 0.0, 18, "answer_is"),
        ("I am not sure.", 0.0, None, None),
    ],
)
async def test_answer_formats(reply: str, reward: float, parsed: int | None, fmt: str | None) -> None:
    env = envkit.make("arithmetic")
    await env.reset(task={"question": "What is 12 + 7?", "answer": 19})
    result = await env.step(envkit.assistant(reply))
    assert result.terminated and not result.truncated and result.observation == []
    assert result.reward == reward
    assert result.info == {"correct": reward == 1.0, "parsed_answer": parsed, "expected": 19, "format": fmt}


@pytest.mark.parametrize(
    ("reply", "reward"),
    [("The answer is 19.", 1.25), ("19", 1.0), ("#### 20", 0.25), ("\\boxed{19}", 1.25), ("no idea", 0.0)],
)
async def test_format_bonus_rewards_marked_answers(reply: str, reward: float) -> None:
    env = envkit.make("arithmetic", format_bonus=0.25)
    await env.reset(task={"question": "What is 12 + 7?", "answer": 19})
    assert (await env.step(envkit.assistant(reply))).reward == pytest.approx(reward)


async def test_episode_is_single_turn() -> None:
    env = envkit.make("arithmetic")
    with pytest.raises(ResetNeededError):
        await env.step(envkit.assistant("1"))
    await env.reset(seed=1)
    await env.step(envkit.assistant("1"))
    with pytest.raises(EpisodeDoneError):
        await env.step(envkit.assistant("1"))
    with pytest.raises(ResetNeededError):  # unchecked envs guard too
        await ArithmeticEnv().step(envkit.assistant("1"))


def test_level_1_is_single_digit_addition() -> None:
    env = ArithmeticEnv(level=1)
    tasks = [*env.tasks("train"), *env.tasks("test")]
    for task in tasks:
        a, b = _numbers(task["expression"])
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert task["expression"] == f"{a} + {b}"
        assert task["question"] == f"What is {a} + {b}?"
        assert task["answer"] == a + b and task["level"] == 1
    # All 100 single-digit sums exist, each in exactly one split, with no repeats inside a split.
    assert len(tasks) == len({t["expression"] for t in tasks}) == 100


@pytest.mark.parametrize(
    ("level", "max_operand", "ops", "steps"),
    [(2, 99, {"+", "-"}, 1), (3, 99, {"+", "-", "*"}, 1), (4, 99, {"+", "-", "*"}, 2), (5, 999, {"+", "-", "*"}, 3)],
)
def test_levels_get_harder(level: int, max_operand: int, ops: set[str], steps: int) -> None:
    tasks = ArithmeticEnv(level=level, num_train=300).tasks("train")
    seen_ops: set[str] = set()
    for task in tasks:
        expression = task["expression"]
        assert len(_ops(expression)) == steps
        assert all(0 <= n <= max_operand for n in _numbers(expression))
        assert task["answer"] == _value(expression)
        assert task["level"] == level and task["id"].startswith(f"train-{level}-")
        assert task["ops"] == "".join(op for op in "+-*" if op in _ops(expression))  # a curriculum groups by it
        seen_ops.update(_ops(expression))
    assert seen_ops == ops
    # Operands reach the level's digit count, not just its upper bound.
    assert max(n for t in tasks for n in _numbers(t["expression"])) > max_operand // 10
    if steps > 1:
        assert all("(" in t["expression"] for t in tasks)


def test_overrides_customize_the_level() -> None:
    env = ArithmeticEnv(level=1, digits=2, ops="*-", steps=2, num_train=100)
    assert env.spaces()["ops"] == "-*" and env.spaces()["steps"] == 2
    for task in env.tasks("train"):
        assert set(_ops(task["expression"])) <= {"-", "*"} and len(_ops(task["expression"])) == 2
        assert task["answer"] == _value(task["expression"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"level": 0},
        {"level": 6},
        {"ops": "/"},
        {"ops": ""},
        {"digits": 0},
        {"steps": 0},
        {"format_bonus": -1.0},
        {"format_bonus": float("nan")},
        {"num_train": 0},
        {"num_test": -1},
    ],
)
def test_invalid_kwargs_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ArithmeticEnv(**kwargs)


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_train_and_test_never_overlap(level: int) -> None:
    env = ArithmeticEnv(level=level, num_train=3000, num_test=300)
    train = [t["expression"] for t in env.tasks("train")]
    test = [t["expression"] for t in env.tasks("test")]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)  # no repeats within a split
    assert not set(train) & set(test)
    assert 0 < len(test) <= 300


def test_commuted_problems_share_a_split() -> None:
    env = ArithmeticEnv(level=1)
    test = {t["expression"] for t in env.tasks("test")}
    train = {t["expression"] for t in env.tasks("train")}
    swapped = {" + ".join(reversed(e.split(" + "))) for e in test}
    assert swapped <= test and not swapped & train


def test_small_spaces_cap_split_sizes() -> None:
    env = ArithmeticEnv(level=1, num_train=10_000, num_test=500)
    assert len(env.tasks("train")) + len(env.tasks("test")) == 100
    assert 0 < len(env.tasks("test")) < 50


def test_a_list_of_levels_mixes_their_problems_in_turn_each_task_naming_its_level() -> None:
    mixed = ArithmeticEnv(level=[1, 3, 4], num_train=600, num_test=90)
    train, test = mixed.tasks("train"), mixed.tasks("test")
    # Each level's problems in its own order, one level after another, until level 1 (80 train problems) runs out.
    alone = {level: ArithmeticEnv(level=level, num_train=300).tasks("train") for level in (1, 3, 4)}
    assert [t["level"] for t in train[:9]] == [1, 3, 4] * 3
    for level in (1, 3, 4):
        mine = [t["expression"] for t in train if t["level"] == level]
        assert mine == [t["expression"] for t in alone[level][:len(mine)]]
    ones = len(alone[1])
    assert 70 < ones < 90 and [t["level"] for t in train[3 * ones - 1:3 * ones + 4]] == [4, 3, 4, 3, 4]
    assert all(t["answer"] == _value(t["expression"]) for t in train)
    assert not {t["expression"] for t in train} & {t["expression"] for t in test}
    assert [t["id"] for t in test[:2]] == ["test-1-3-4-0", "test-1-3-4-1"] and len(test) == 90
    assert mixed.spaces()["level"] == [1, 3, 4] and "digits" not in mixed.spaces()
    for bad in ([], [2, 2], [2, 6]):
        with pytest.raises(ValueError, match="level must be one of"):
            ArithmeticEnv(level=bad)
    with pytest.raises(ValueError, match="not a mixture's"):
        ArithmeticEnv(level=[2, 3], digits=3)


def test_task_i_depends_only_on_split_level_and_index() -> None:
    small, big = ArithmeticEnv(level=4, num_train=20, num_test=5), ArithmeticEnv(level=4)
    assert list(small.tasks("train")) == big.tasks("train")[:20]
    assert list(small.tasks("test")) == big.tasks("test")[:5]
    assert [t["id"] for t in small.tasks("test")] == [f"test-4-{i}" for i in range(5)]


def test_tasks_is_a_lazy_sequence() -> None:
    tasks = ArithmeticEnv(level=5).tasks("train")
    assert len(tasks) == 10_000
    assert tasks[-1] == tasks[9999] and tasks[-1]["id"] == "train-5-9999"
    assert len(tasks[10:15]) == 5
    with pytest.raises(IndexError):
        tasks[10_000]
    with pytest.raises(ValueError, match="'train', 'test'"):
        ArithmeticEnv().tasks("validation")


async def test_custom_system_prompt() -> None:
    messages, _ = await ArithmeticEnv(system_prompt="Be brief.").reset(seed=0)
    assert messages[0] == {"role": "system", "content": "Be brief."}


def test_sync_facade() -> None:
    env = envkit.SyncEnv(envkit.make("arithmetic"))
    _, info = env.reset(seed=0)
    result = env.step(f"The answer is {info['task']['answer']}")
    assert result.reward == 1.0 and result.done
    env.close()


async def test_followups_are_turns_of_their_own_graded_on_the_right_running_value() -> None:
    env = envkit.make("arithmetic", followups=2)
    _, info = await env.reset(seed=3)
    expected = info["task"]["answer"]
    # wrong first answer: the env says so, gives the right value, and asks for the next sum on top of it
    first = await env.step(envkit.assistant(f"The answer is {expected + 1}."))
    assert (first.reward, first.terminated) == (0.0, False)
    [ask] = first.observation
    addend = int(re.fullmatch(rf"Not quite: it is {expected}\. Now add (\d) to it\. What is the result\?",
                              ask["content"])[1])
    second = await env.step(envkit.assistant(f"The answer is {expected + addend}."))
    assert second.reward == pytest.approx(1 / 3) and not second.terminated
    assert second.observation[0]["content"].startswith("Correct. Now add ")
    addend2 = int(re.search(r"add (\d)", second.observation[0]["content"])[1])
    last = await env.step(envkit.assistant(f"The answer is {expected + addend + addend2}."))
    assert last.reward == pytest.approx(1 / 3) and last.terminated
    with pytest.raises(EpisodeDoneError):
        await env.step(envkit.assistant("5"))
    # the same task is the same episode: the addends depend only on the question
    again = envkit.make("arithmetic", followups=2)
    await again.reset(seed=3)
    assert (await again.step(envkit.assistant("0"))).observation[0]["content"].endswith(
        f"Now add {addend} to it. What is the result?")


def test_followups_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="followups must be between 0 and 16"):
        ArithmeticEnv(followups=-1)
    with pytest.raises(ValueError, match=r"lets marked wrong answers reach reward 1\.0"):
        ArithmeticEnv(followups=1, format_bonus=0.5)  # right + marked-wrong would score 0.75 + 0.25


async def test_the_answer_rubric_grades_a_chat_as_the_env_does():
    """Traffic the env never produced (a served policy's calls) is graded from the chat alone, as step() grades it;
    what is not a problem scores 0 and is never evaluated as code."""
    from envkit_arithmetic.rubric import answer, expected_answer

    from envkit.rewards.rubrics import Episode

    env = envkit.make("arithmetic", level=4)
    for task in list(env.tasks("test"))[:20]:
        assert expected_answer(task["question"]) == task["answer"]
        for reply in (f"The answer is {task['answer']}.", f"The answer is {task['answer'] + 1}."):
            messages, _ = await env.reset(task=task)
            graded = await env.step(envkit.assistant(reply))
            chat = [*messages, {"role": "assistant", "content": reply}]
            assert (await answer.score(Episode(None, chat))).value == float(graded.info["correct"])
    assert expected_answer("What is __import__('os').system('id')?") is None
    assert expected_answer("What is 2 ** 99999?") is None
