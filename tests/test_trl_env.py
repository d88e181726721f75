"""envkit envs in TRL's GRPOTrainer (envkit.integrations.trl): the dataset, the environment_factory's instances as
TRL reads and calls them, the reward the env gives, and a real GRPOTrainer step on the bundled model."""

from __future__ import annotations

import inspect
import json
from typing import Any, Literal

import pytest
from required import require_module
from transformers.utils import get_json_schema

import envkit
import envkit.integrations.trl as envkit_trl
from envkit import Message, Task, ToolEnv, system, tool, user

require_module("trl", "`make install` installs it (the trl extra: pip install 'trl==1.16.0')")


class TypedToolsEnv(ToolEnv):
    """One tool with an argument of every JSON type; the answer is always 42."""

    @tool
    def lookup(self, key: str, count: int, scale: float, exact: bool, tags: list[str], options: dict[str, Any],
               unit: Literal["m", "km"] = "m", limit: int | None = None) -> str:
        """Look a key up.

        Args:
            key: what to look up
            count: how many results
            scale: a factor
            exact: match exactly
            tags: labels to filter by
            options: extra settings
            unit: the unit of the result
            limit: at most this many
        """
        return json.dumps({"key": key, "count": count, "scale": scale, "exact": exact, "tags": tags,
                           "options": options, "unit": unit, "limit": limit})

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": f"{split}-{i}", "question": f"question {i}"} for i in range(3)]

    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[Message], dict]:
        return [system("Use lookup."), user((task or {"question": "?"})["question"])], {}

    async def grade(self, answer: str) -> tuple[float, dict[str, Any]]:
        return float("42" in answer), {}


class ResetToolEnv(TypedToolsEnv):
    @tool
    def reset_counter(self) -> str:
        """Fine: only reset itself is reserved."""
        return "0"


class ReservedNameEnv(TypedToolsEnv):
    @tool
    def get_reward(self) -> str:
        """Clashes with the method TRL calls for an env-owned reward."""
        return "1"


envkit.register("trl-typed-tools", TypedToolsEnv)
envkit.register("trl-reset-tool", ResetToolEnv)
envkit.register("trl-reserved-name", ReservedNameEnv)


def test_dataset_rows_are_the_envs_openings_and_their_tasks():
    rows = envkit_trl.dataset("calculator", "test", n=4)
    env = envkit.SyncEnv(envkit.make("calculator"))
    tasks = list(env.tasks("test"))[:4]
    assert [json.loads(r["envkit_task"]) for r in rows] == tasks
    for row, task in zip(rows, tasks, strict=True):
        messages, _ = env.reset(task=task)
        assert row["prompt"] == [{"role": m["role"], "content": m["content"]} for m in messages]
        assert row["prompt"][-1]["content"] == task["question"]
    env.close()
    with pytest.raises(ValueError, match="does not list its tasks"):
        envkit_trl.dataset("guess-number")


def test_trl_reads_each_tool_back_as_the_envs_own_schema():
    instance = envkit_trl.environment_factory("trl-typed-tools")()
    # what GRPOTrainer does: every public function of the class but reset/get_reward is a tool
    public = {n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction) if not n.startswith("_")}
    assert public == {"reset", "lookup"}
    ours = TypedToolsEnv.tools[0].to_openai()["function"]
    theirs = get_json_schema(instance.lookup)["function"]  # what transformers renders into the prompt for TRL
    assert theirs["name"] == ours["name"] and theirs["description"] == ours["description"]
    assert theirs["parameters"]["required"] == ours["parameters"]["required"] == [
        "key", "count", "scale", "exact", "tags", "options"]
    types = {k: v.get("type") for k, v in theirs["parameters"]["properties"].items()}
    assert types == {"key": "string", "count": "integer", "scale": "number", "exact": "boolean", "tags": "array",
                     "options": "object", "unit": None, "limit": "integer"}
    assert theirs["parameters"]["properties"]["unit"]["enum"] == ["m", "km"]
    for name, prop in theirs["parameters"]["properties"].items():
        assert prop["description"] == ours["parameters"]["properties"][name]["description"]
    # the call TRL makes: the parsed arguments as keywords; what the env's tool returned comes back
    instance.reset(**envkit_trl.dataset("trl-typed-tools", n=1)[0])
    out = json.loads(instance.lookup(key="k", count=2, scale=0.5, exact=True, tags=["a"], options={"x": 1}))
    assert out == {"key": "k", "count": 2, "scale": 0.5, "exact": True, "tags": ["a"], "options": {"x": 1},
                   "unit": "m", "limit": None}
    # the env checks the arguments, as for any model: a missing one is the model's error, in the tool's output
    assert "missing required argument(s): exact" in instance.lookup(key="k", count=2, scale=0.5, tags=[],
                                                                     options={})


def test_a_rollout_is_stepped_and_scored_by_the_env():
    factory = envkit_trl.environment_factory("calculator")
    rows = envkit_trl.dataset("calculator", "test", n=2)
    first, second = factory(), factory()
    assert type(first) is type(second)  # one class per tool set: TRL lists the tools of the class
    task = json.loads(rows[0]["envkit_task"])
    assert first.reset(**rows[0]) is None  # TRL prompts with the row's messages
    assert first.calculator(expression="6*7") == "42"
    assert first.calculator(expression="1/0") == "Error: division by zero"
    assert not first.done
    second.reset(**rows[0])
    right, wrong = [[{"role": "assistant", "content": f"The answer is {n}."}] for n in (task["answer"], -1)]
    assert envkit_trl.reward([right, wrong], environments=[first, second]) == [1.0, 0.0]
    assert first.done and second.done
    # scored once: a second reward function reading the same rollouts gets the same returns
    assert envkit_trl.reward([wrong, right], environments=[first, second]) == [1.0, 0.0]
    # the instance is reused (TRL pools them): reset starts a new episode
    assert first.reset(**rows[1]) is None and not first.done and first.episode_return == 0.0
    # a row without a prompt: the opening's text goes to TRL to append to its own prompt
    opening = first.reset(envkit_task=rows[1]["envkit_task"])
    assert opening.endswith(json.loads(rows[1]["envkit_task"])["question"])


def test_turns_run_out_and_the_episode_earns_nothing_more():
    instance = envkit_trl.environment_factory("calculator", max_turns=2)()
    row = envkit_trl.dataset("calculator", "test", n=1)[0]
    instance.reset(**row)
    assert instance.calculator(expression="1+1") == "2"
    assert instance.calculator(expression="2+2") == "4\n(The episode is over.)"
    assert instance.done
    assert instance.calculator(expression="3+3") == "Error: the episode is over; no more tool calls."
    answer = json.loads(row["envkit_task"])["answer"]
    assert envkit_trl.reward([[{"role": "assistant", "content": f"The answer is {answer}."}]], [instance]) == [0.0]


def test_bad_rows_names_and_calls_fail_clearly():
    instance = envkit_trl.environment_factory("calculator")()
    row = envkit_trl.dataset("calculator", "test", n=1)[0]
    drifted = {**row, "prompt": [*row["prompt"][:-1], {"role": "user", "content": "another question"}]}
    with pytest.raises(ValueError, match="not the row's prompt"):
        instance.reset(**drifted)
    with pytest.raises(ValueError, match="needs its 'envkit_task' column"):
        instance.reset(prompt=row["prompt"])
    with pytest.raises(ValueError, match="environment_factory"):
        envkit_trl.reward(["The answer is 1."])
    with pytest.raises(TypeError, match=r"envkit\.integrations\.trl environments"):
        envkit_trl.reward(["The answer is 1."], environments=[object()])
    with pytest.raises(ValueError, match="'get_reward' cannot be a TRL environment method"):
        envkit_trl.environment_factory("trl-reserved-name")()
    assert "reset_counter" in dir(envkit_trl.environment_factory("trl-reset-tool")())


@pytest.mark.e2e  # a training run
@pytest.mark.trl
def test_grpo_trainer_runs_the_readmes_example_on_an_envkit_env(tmp_path, monkeypatch, capsys):
    """TRL's own trainer, as its guide runs it (its block, as written, on the bundled model): it probes the factory,
    renders the env's tool into the prompt, resets one instance per rollout on its row's task, and takes the rewards
    the envs gave."""
    from test_docs import expected_prints, readme_block

    monkeypatch.chdir(tmp_path)  # the block writes its output_dir there
    namespace: dict[str, Any] = {}
    code = readme_block("GRPOTrainer(")
    exec(compile(code, "docs/guides/trl.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert expected_prints(code) == ["1"] and all(want in printed for want in expected_prints(code)), printed
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    assert [t.__name__ for t in trainer.tools] == ["calculator"]
    row = envkit_trl.dataset("calculator", "train", n=1)[0]
    rendered = trainer.processing_class.apply_chat_template(row["prompt"], tools=trainer.tools, tokenize=False)
    assert '"name": "calculator"' in rendered and "numbers with + - * / // % ** and parentheses" in rendered
    used = trainer.environments  # the step's rollouts' instances, each reset on its row's task and stepped to the end
    assert len({id(e) for e in used}) == 4 and all(e.done for e in used)
    returns = [e.episode_return for e in used]
    assert trainer.state.log_history[0]["reward"] == pytest.approx(sum(returns) / 4)
